"""The rollout-correction experiment's table and decision (issue 51), from the JSON that
``aqn_seeds.py --experiment correction`` writes:

    python docs/experiments/correction_report.py docs/results/correction_seeds.json --out docs/correction_seeds.md

The decision rule is the one written in ``aqn_seeds.py``'s docstring before any run: the default rollout correction
(``token_truncate``, cap 2: the arm ``nvfp4_aqn``) changes to a candidate only if the candidate's final held-out
accuracy minus ``nvfp4_aqn``'s, paired by seed, has a positive mean and a 95% interval above 0; of two such
candidates, the larger mean difference. The accuracy is the AQN experiment's (``aqn_report.summarize``: the
flexible held-out accuracy at the experiment's last validation). The mismatch statistics are shown beside it and decide
nothing; a candidate that masks more than half of the tokens on average is named as training on a minority of them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aqn_report import fmt, summarize  # noqa: E402
from aqn_stats import mean_interval, paired_difference  # noqa: E402

REFERENCE = "nvfp4_aqn"
ARMS = {  # arm -> what its correction is, as a TRL or verl user would call it
    "nvfp4_aqn": "token_truncate, cap 2 (the default)",
    "nvfp4_aqn_sequence_mask": "sequence_mask, C_max 3 (TRL's default)",
    "nvfp4_aqn_icepop": "token_mask [0.5, 5] (IcePop)",
}
MISMATCH = {  # key in a run's result -> column title; each the mean over the run's steps, then over seeds
    "sampling_logp_diff_mean": "mean \\|logp gap\\|",
    "sampling_logp_diff_max": "max \\|logp gap\\|",
    "is_raw_ratio_mean": "IS ratio before bounds",
    "is_masked_frac": "tokens masked",
    "is_masked_seq_frac": "sequences masked",
}
MASKED_MAJORITY = 0.5


def run_mean(values: list | None) -> float:
    """The mean over a run's steps of a per-step value (nan where the run did not log it)."""
    kept = [v for v in values or [] if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else math.nan


def decide(data: dict) -> dict:
    """Per arm: the final accuracy over seeds, its paired difference to ``nvfp4_aqn`` and the mismatch statistics;
    and the decision: the candidate that passes the rule (``choice``, None: the default stays)."""
    summary = summarize(data)
    finals = {arm: {s["seed"]: s["final_accuracy"] for s in entry["per_seed"]}
              for arm, entry in summary["arms"].items()}
    rows, passing = {}, []
    for arm, entry in data["arms"].items():
        row = {"final": mean_interval(list(finals[arm].values())),
               **{key: mean_interval([run_mean(s.get(key)) for s in entry["seeds"]]) for key in MISMATCH}}
        if arm != REFERENCE and REFERENCE in finals:
            seeds = sorted(set(finals[arm]) & set(finals[REFERENCE]))
            row["difference"] = paired_difference([finals[arm][s] for s in seeds],
                                                  [finals[REFERENCE][s] for s in seeds])
            if row["difference"].n >= 2 and row["difference"].mean > 0 and row["difference"].low > 0:
                passing.append(arm)
        rows[arm] = row
    choice = max(passing, key=lambda arm: rows[arm]["difference"].mean, default=None)
    minority = [arm for arm, row in rows.items() if row["is_masked_frac"].mean > MASKED_MAJORITY]
    return {"rows": rows, "choice": choice, "minority": minority, "complete": data.get("complete", False)}


def render(decision: dict) -> str:
    """The markdown table and the decision's sentence."""
    head = ["arm", "correction", "final held-out accuracy", "minus token TIS (paired)", *MISMATCH.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, row in decision["rows"].items():
        difference = fmt(row["difference"], "{:+.3f}") if "difference" in row else "(reference)"
        cells = [arm, ARMS.get(arm, arm), fmt(row["final"]), difference,
                 *(fmt(row[key], "{:.4f}") for key in MISMATCH)]
        lines.append("| " + " | ".join(cells) + " |")
    choice = decision["choice"]
    sentence = (f"By the rule fixed before the runs, the default becomes `{ARMS[choice]}`." if choice else
                "By the rule fixed before the runs, the default stays token-level truncated IS with cap 2: no "
                "candidate's paired difference has a 95% interval above 0.")
    if decision["minority"]:
        sentence += " Masking more than half of the tokens (training on a minority of them): " + \
            ", ".join(decision["minority"]) + "."
    if not decision["complete"]:
        sentence = "The experiment is not complete; no decision. " + sentence
    return "\n".join(lines) + "\n\n" + sentence + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="the experiment's JSON (aqn_seeds.py --experiment correction)")
    parser.add_argument("--out", default=None, help="write the markdown there (default: print it)")
    args = parser.parse_args(argv)
    decision = decide(json.loads(Path(args.json).read_text()))
    text = render(decision)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return decision


if __name__ == "__main__":
    main()
