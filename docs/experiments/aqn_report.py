"""The AQN experiment's JSON (``aqn_seeds.py``) -> statistics, plots and ``docs/learning.md``.

    python docs/experiments/aqn_report.py docs/results/aqn_seeds.json
    python docs/experiments/aqn_report.py docs/results/aqn_seeds.json --level 0.4 --early-steps 20 --page /tmp/x.md

The page's first paragraph is generated from the numbers (paired by seed, 95% Student-t intervals), from contrasts
whose two arms differ in one setting: (a) does the noise help without quantization (bf16 + AQN minus bf16 at one
rate), (b) how much of NVFP4's gap to bf16 is the quantization (NVFP4 minus bf16 without noise at one rate, beside
NVFP4 + AQN's whole gap and the untrained model's score per format, paired by held-out question), (c) does a run's
early rollout-entropy rise predict its later reward (Pearson r over all runs and within arms, Fisher-z intervals).
The second paragraph is issue 22's question: whether NVFP4 + AQN learned faster than bf16 LoRA (reward area, steps to
a held-out accuracy level, final held-out accuracy) and explored more early (rollout and teacher-forced entropy). Then
the per-arm table, the untrained scores, the contrasts, the paired differences, the correlations, the plots (curves
with 95% bands, the per-run scatter), the commands that reproduce it, the runs' time, what would change the recipes'
defaults and what would change the answer. The statistics are the pure
functions of ``aqn_stats.py``; plots need matplotlib (``pip install -e ".[docs]"``) and are skipped without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aqn_stats import (  # noqa: E402
    Correlation,
    Interval,
    area_under_curve,
    censored_steps,
    correlation,
    early_mean,
    entropy_rise,
    first_reaching,
    mean_interval,
    paired_difference,
    t_ppf,
    within_groups,
)

REFERENCE = "nvfp4_aqn"
LABELS = {
    "nvfp4_aqn": "NVFP4 + AQN",
    "nvfp4": "NVFP4",
    "bf16_lr_high": "bf16 LoRA, NVFP4 rate",
    "bf16_lr_low": "bf16 LoRA, bf16 rate",
    "bf16_aqn": "bf16 + AQN, bf16 rate",
    "bf16_aqn_lr_high": "bf16 + AQN, NVFP4 rate",
    "nvfp4_aqn_lr_low": "NVFP4 + AQN, bf16 rate",
}
CONTRASTS = {  # (arm, minus arm) -> what the difference isolates; each pair differs in one setting
    ("bf16_aqn", "bf16_lr_low"): "noise without quantization, bf16 rate",
    ("bf16_aqn_lr_high", "bf16_lr_high"): "noise without quantization, NVFP4 rate",
    ("nvfp4_aqn", "nvfp4"): "noise with NVFP4, NVFP4 rate",
    ("nvfp4", "bf16_lr_high"): "quantization without noise, NVFP4 rate",
    ("nvfp4_aqn", "bf16_aqn_lr_high"): "quantization with noise, NVFP4 rate",
    ("nvfp4_aqn_lr_low", "bf16_aqn"): "quantization with noise, bf16 rate",
    ("nvfp4_aqn", "bf16_lr_high"): "NVFP4 + AQN's whole gap, NVFP4 rate",
    ("nvfp4_aqn_lr_low", "nvfp4_aqn"): "the bf16 rate for NVFP4 + AQN",
    ("bf16_lr_low", "bf16_lr_high"): "the bf16 rate for bf16",
}
STATISTICS = {  # key -> (column title, format, what "better" means for the finding)
    "reward_auc": ("train reward, area / steps", "{:.3f}", "higher"),
    "steps_to_level": ("steps to held-out level", "{:.0f}", "lower"),
    "final_accuracy": ("final held-out accuracy", "{:.3f}", "higher"),
    "early_rollout_entropy": ("early rollout entropy (nats)", "{:.3f}", None),
    "early_train_entropy": ("early teacher-forced entropy (nats)", "{:.3f}", None),
    "entropy_rise": ("early rollout-entropy rise (nats)", "{:.3f}", None),
    "late_reward": ("late train reward", "{:.3f}", "higher"),
}
PREDICTED = {"final_accuracy": "final held-out accuracy", "late_reward": "late train reward"}  # (c)'s y values


def label(arm: str) -> str:
    return LABELS.get(arm, arm)


# ----------------------------------------------------------------------------------------------------------------
# Numbers.


def auto_level(data: dict, metric: str) -> float:
    """Half-way from the untrained score to the best arm's mean final score, rounded down to a multiple of 0.05 (at
    least one step of 0.05 above the untrained score): a level some runs reach, so that steps-to-level compares
    speeds rather than counting runs that never got there."""
    starts, finals = [], []
    for arm in data["arms"].values():
        arm_finals = [s["heldout"][metric][-1] for s in arm["seeds"] if s["heldout"].get(metric)]
        starts += [s["heldout"][metric][0] for s in arm["seeds"] if s["heldout"].get(metric)]
        if arm_finals:
            finals.append(sum(arm_finals) / len(arm_finals))
    if not finals:
        raise ValueError(f"no held-out '{metric}' in the data: pick --metric from the JSON's heldout keys.")
    base = min(starts)
    level = math.floor(20 * (base + (max(finals) - base) / 2) + 1e-9) / 20
    return max(level, math.floor(20 * base + 1e-9) / 20 + 0.05)


def default_early_steps(data: dict) -> int:
    """The first two AQN stages (noise-free, then sigma_start): where the paper says quantization noise matters."""
    stages = int(data["config"]["settings"].get("aqn", {}).get("num_stages", 10))
    return max(1, 2 * int(data["steps"]) // stages)


def rise_steps(data: dict, early_steps: int) -> tuple[int, int]:
    """(baseline, window) of the entropy rise: the steps of the noise-free first AQN stage, then the early window's end
    (at least one step after the baseline; both within the run)."""
    stages = int(data["config"]["settings"].get("aqn", {}).get("num_stages", 10))
    steps = int(data["steps"])
    baseline = min(max(1, steps // stages), steps - 1)
    return baseline, min(steps, max(early_steps, baseline + 1))


def seed_statistics(seed: dict, metric: str, level: float, early_steps: int,
                    rise: tuple[int, int] | None = None, final_step: int | None = None) -> dict:
    """The statistics of one run (``rise``: the entropy rise's baseline and window, see ``rise_steps``). Its final
    held-out accuracy is its validation at ``final_step`` (the experiment's last validation, ``final_validation_step``):
    nan where that validation is missing (a run stopped while validating resumes from the checkpoint written just
    before it, so that point is never made)."""
    heldout = seed["heldout"]
    baseline, window = rise or (1, max(2, early_steps))
    window = min(window, len(seed["rollout_entropy"]))
    return {  # (a run of one step has no rise: nan)
        "entropy_rise": entropy_rise(seed["rollout_entropy"], baseline, window) if 1 <= baseline < window else math.nan,
        "late_reward": early_mean(seed["reward"][::-1], early_steps),
        "seed": seed["seed"],
        "reward_auc": area_under_curve(seed["steps"], seed["reward"]),
        "steps_to_level": first_reaching(heldout["steps"], heldout[metric], level),
        "final_accuracy": heldout[metric][-1] if final_step in (None, heldout["steps"][-1]) else math.nan,
        "early_rollout_entropy": early_mean(seed["rollout_entropy"], early_steps),
        "early_train_entropy": early_mean(seed["train_entropy"], early_steps),
    }


def summarize(data: dict, metric: str = "expressions_acc_flexible", level: float | None = None,
              early_steps: int | None = None) -> dict:
    """Per arm: each statistic's values per seed and their interval over seeds; per other arm: the paired difference
    ``nvfp4_aqn - arm`` of each statistic over the seeds both have."""
    level = auto_level(data, metric) if level is None else level
    early_steps = default_early_steps(data) if early_steps is None else early_steps
    steps = int(data["steps"])
    rise = rise_steps(data, early_steps)
    final_step = final_validation_step(data)
    arms = {}
    for arm, entry in data["arms"].items():
        per_seed = [seed_statistics(s, metric, level, early_steps, rise, final_step) for s in entry["seeds"]]
        intervals = {}
        for key in STATISTICS:
            values = [s[key] for s in per_seed]
            if key == "steps_to_level":
                intervals[key], reached = censored_steps(values, steps)
                intervals["reached"] = reached
            else:
                intervals[key] = mean_interval(values)
        arms[arm] = {"per_seed": per_seed, "intervals": intervals, "lr": entry.get("lr"),
                     "quantization": entry.get("quantization"), "aqn": entry.get("aqn")}
    paired = {arm: paired_statistics(arms, REFERENCE, arm, steps) for arm in arms if arm != REFERENCE} \
        if REFERENCE in arms else {}
    contrasts = {pair: paired_statistics(arms, *pair, steps) for pair in CONTRASTS if set(pair) <= set(arms)}
    runs = [(arm, s) for arm, entry in arms.items() for s in entry["per_seed"]]
    correlations = {}
    for key in PREDICTED:
        kept = [(a, r) for a, r in runs if not (_isnan(r["entropy_rise"]) or _isnan(r[key]))]
        x, y, groups = [r["entropy_rise"] for _, r in kept], [r[key] for _, r in kept], [a for a, _ in kept]
        correlations[key] = {"pooled": correlation(x, y), "within": within_groups(x, y, groups)}
    return {"metric": metric, "level": level, "early_steps": early_steps, "rise": rise, "steps": steps,
            "final_step": final_step, "arms": arms,
            "paired": paired, "contrasts": contrasts, "correlations": correlations,
            "base": base_summary(data, metric)}


def final_validation_step(data: dict) -> int | None:
    """The step of the experiment's last validation: the latest last held-out step over all runs (a run whose curve
    ends earlier lacks it)."""
    ends = [s["heldout"]["steps"][-1] for a in data["arms"].values() for s in a["seeds"] if s["heldout"]["steps"]]
    return max(ends, default=None)


def paired_statistics(arms: dict, a: str, b: str, steps: int) -> dict:
    """Every statistic's paired difference ``a - b`` over the seeds both arms have."""
    first, second = ({s["seed"]: s for s in arms[arm]["per_seed"]} for arm in (a, b))
    seeds = sorted(set(first) & set(second))
    out = {"seeds": seeds}
    for key in STATISTICS:
        out[key] = paired_difference([_censor(first[s][key], key, steps) for s in seeds],
                                     [_censor(second[s][key], key, steps) for s in seeds])
    out["censored"] = any(first[s]["steps_to_level"] is None or second[s]["steps_to_level"] is None for s in seeds)
    return out


def _isnan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


VERDICT_FIELD = {False: "correct", True: "correct_flexible"}  # the base's per-question field of a strict/flexible metric


def base_summary(data: dict, metric: str) -> dict:
    """The untrained model's score per format, and NVFP4 minus bf16 paired by held-out question (the greedy verdicts
    of both on the same questions) when the JSON holds them."""
    base = {q: b for q, b in (data.get("base") or {}).items() if b}
    scores = {q: b["heldout"].get(metric) for q, b in base.items()}
    out = {"scores": scores, "difference": None}
    if {"nvfp4", "bf16"} <= set(base):
        field = VERDICT_FIELD[metric.endswith("_flexible")]  # a breakdown (``_level1_acc``) has no such pairs
        verdicts = [{(r["source"], r["question"]): float(r[field]) for r in base[q].get("questions") or []
                     if metric.startswith(f"{r['source']}_acc")} for q in ("nvfp4", "bf16")]
        common = sorted(set(verdicts[0]) & set(verdicts[1]))
        if common:
            out["difference"] = paired_difference([verdicts[0][k] for k in common], [verdicts[1][k] for k in common])
    return out


def _censor(value, key: str, steps: int):
    return steps if key == "steps_to_level" and value is None else value


def seeds_to_resolve(difference: Interval) -> int | None:
    """About how many seeds would make a paired difference of the observed mean and spread exclude 0 at 95%."""
    if not difference.n or math.isnan(difference.sd) or difference.mean == 0:
        return None
    if difference.sd == 0:
        return difference.n
    for n in range(2, 10_000):
        if t_ppf(0.975, n - 1) * difference.sd / math.sqrt(n) < abs(difference.mean):
            return n
    return None


# ----------------------------------------------------------------------------------------------------------------
# Text.


def fmt(interval: Interval, pattern: str = "{:.3f}") -> str:
    if interval.n == 0 or math.isnan(interval.mean):
        return "n/a"
    if interval.n < 2:
        return f"{pattern.format(interval.mean)} (1 seed)"
    return f"{pattern.format(interval.mean)} [{pattern.format(interval.low)}, {pattern.format(interval.high)}]"


def fmt_p(p: float) -> str:
    return "p n/a" if math.isnan(p) else ("p < 0.001" if p < 0.001 else f"p = {p:.3f}")


def verdict(difference: Interval, better: str, pattern: str = "{:.3f}") -> str:
    """``higher (+0.12 [0.03, 0.21], p = 0.02)``-style words for a paired difference (reference minus other)."""
    if difference.n < 2:
        return f"not testable with {difference.n} paired seed(s)"
    words = {("higher", 1): "better", ("higher", -1): "worse", ("lower", 1): "worse", ("lower", -1): "better"}
    numbers = f"{pattern.replace('{:', '{:+').format(difference.mean)} [{pattern.format(difference.low)}, " \
              f"{pattern.format(difference.high)}], {fmt_p(difference.p_value)}"
    if difference.low > 0 or difference.high < 0:
        sign = 1 if difference.low > 0 else -1
        return f"{words[(better, sign)]} ({numbers})" if better else \
            f"{'higher' if sign > 0 else 'lower'} ({numbers})"
    return f"no different within the 95% interval ({numbers})"


def span(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def fmt_r(c: Correlation) -> str:
    if math.isnan(c.r):
        return f"not computable from {c.n} runs"
    interval = "" if math.isnan(c.low) else f" [{c.low:+.2f}, {c.high:+.2f}]"
    return f"r = {c.r:+.2f}{interval}, {fmt_p(c.p_value)}"


def finding(summary: dict) -> str:
    """The page's first paragraph, from the numbers only: (a) does noise help without quantization, (b) how much of
    NVFP4's gap to bf16 is the quantization, (c) does the early entropy rise predict the later reward, per run."""
    arms, contrasts = summary["arms"], summary["contrasts"]
    n = min((len(a["per_seed"]) for a in arms.values()), default=0)
    parts = [f"**Finding (seeds per arm: {n}; {summary['steps']} steps; 95% Student-t intervals; differences paired "
             f"by seed):**"]
    measures = ("final_accuracy", "reward_auc")

    def compared(pair, keys=measures) -> str:
        d = contrasts[pair]
        return f"{label(pair[0])} minus {label(pair[1])}: " + ", ".join(
            f"{STATISTICS[k][0]} {verdict(d[k], STATISTICS[k][2])}" for k in keys)

    def testable(pair) -> bool:
        return pair in contrasts and contrasts[pair]["final_accuracy"].n >= 2

    # (a) noise without quantization
    noise = [p for p in (("bf16_aqn", "bf16_lr_low"), ("bf16_aqn_lr_high", "bf16_lr_high")) if testable(p)]
    if noise:
        text = "; ".join(compared(p, measures + ("early_rollout_entropy",)) for p in noise)
        significant = [(p, k) for p in noise for k in measures
                       if contrasts[p][k].low > 0 or contrasts[p][k].high < 0]
        ups = {contrasts[p][k].low > 0 for p, k in significant}
        where = "; ".join(" and ".join(STATISTICS[k][0] for q, k in significant if q == p)
                          + f" at the {CONTRASTS[p].rsplit(', ', 1)[-1]}"
                          for p in noise if any(q == p for q, _ in significant))
        effect = "helped" if ups == {True} else "hurt" if ups == {False} else "helped and hurt"
        so = ("so without quantization these seeds show no effect of the noise on learning" if not significant else
              f"so without quantization the noise {effect} on {where}, and on no other measure of learning")
        parts.append(f"(a) Does noise help without quantization? {text}; {so}.")  # (labels keep their case)
    else:
        parts.append("(a) Does noise help without quantization? Not answered: the data hold no bf16 + AQN arm with "
                     "at least 2 seeds paired with its bf16 arm.")
    # (b) the quantization's share of the gap
    base, words = summary["base"], []
    if {"nvfp4", "bf16"} <= {q for q, v in base["scores"].items() if v is not None}:
        d = base["difference"]
        paired_q = f" ({d.mean:+.3f} [{d.low:.3f}, {d.high:.3f}] paired over {d.n} held-out questions)" \
            if d is not None and d.n >= 2 else ""
        words.append(f"Before training the model scored {base['scores']['nvfp4']:.3f} in NVFP4 and "
                     f"{base['scores']['bf16']:.3f} in bf16 on `{summary['metric']}`{paired_q}.")
    whole, quant, aqn = ("nvfp4_aqn", "bf16_lr_high"), ("nvfp4", "bf16_lr_high"), ("nvfp4_aqn", "nvfp4")
    if testable(quant):
        q = contrasts[quant]["final_accuracy"]
        words.append(f"After training at the NVFP4 rate without noise in either, NVFP4 minus bf16 was "
                     f"{verdict(q, 'higher')} on final held-out accuracy")
        if testable(whole) and testable(aqn):
            words[-1] += (f"; of NVFP4 + AQN's whole gap to that bf16 arm "
                          f"({contrasts[whole]['final_accuracy'].mean:+.3f}), {q.mean:+.3f} is the quantization and "
                          f"{contrasts[aqn]['final_accuracy'].mean:+.3f} the noise on top (NVFP4 + AQN minus NVFP4: "
                          f"{verdict(contrasts[aqn]['final_accuracy'], 'higher')})")
        words[-1] += "."
    for pair, what in ((("nvfp4_aqn_lr_low", "bf16_aqn"), "At the bf16 rate with noise in both"),
                       (("nvfp4_aqn", "bf16_aqn_lr_high"), "At the NVFP4 rate with noise in both")):
        if testable(pair):
            words.append(f"{what}, NVFP4 minus bf16 was {verdict(contrasts[pair]['final_accuracy'], 'higher')} on "
                         f"final held-out accuracy.")
    parts.append("(b) How much of the NVFP4 gap is the quantization? " + (" ".join(words) if words else
                 "Not answered: the data hold neither the untrained scores of both formats nor NVFP4 and bf16 arms "
                 "at one rate with at least 2 seeds."))
    # (c) early entropy rise -> later reward, per run
    baseline, window = summary["rise"]
    runs = sum(len(a["per_seed"]) for a in arms.values())
    lines = []
    for key, name in PREDICTED.items():
        c = summary["correlations"][key]
        lines.append(f"with {name} {fmt_r(c['pooled'])} over all runs, {fmt_r(c['within'])} within arms")
    within = [summary["correlations"][k]["within"] for k in PREDICTED]
    signs = {c.low > 0 for c in within if not math.isnan(c.low) and (c.low > 0 or c.high < 0)}
    so = ("so runs whose entropy rose more than their arm's did learned more" if signs == {True} else
          "so runs whose entropy rose more than their arm's did learned less" if signs == {False} else
          "so the two measures disagree" if signs else
          "so not answered: too few runs for an interval within arms" if all(math.isnan(c.low) for c in within) else
          "so within an arm the early rise does not predict the later reward at this number of runs (the pooled r "
          "mixes the arms' differences)")
    parts.append(f"(c) Does the early entropy rise predict the later reward? Per run ({runs} runs; rise = mean "
                 f"rollout entropy over {span(baseline + 1, window)} minus {span(1, baseline)}, the noise-free "
                 f"first AQN stage; late reward = mean train reward over the last {summary['early_steps']} steps): "
                 + "; ".join(lines) + f"; {so}.")
    if outlier_sentence(summary):
        parts.append(outlier_sentence(summary))
    return " ".join(parts)


def reference_finding(summary: dict) -> str:
    """The earlier question (issue 22), kept as the page's second paragraph: NVFP4 + AQN against each other arm."""
    arms, paired = summary["arms"], summary["paired"]
    n = min((len(a["per_seed"]) for a in arms.values()), default=0)
    if REFERENCE not in arms or not paired:
        return f"**Not answered yet:** the data hold no {label(REFERENCE)} arm or nothing to compare it with."
    parts = [f"**NVFP4 + AQN against bf16 LoRA (seeds per arm: {n}):**"]
    if all(d[key].n < 2 for d in paired.values() for key in STATISTICS):
        parts.append(f"Not answered: a paired interval needs at least 2 seeds run in both arms "
                     f"(here: {max(len(d['seeds']) for d in paired.values())}).")
        return " ".join(parts)
    learn = []
    for arm in [a for a in ("bf16_lr_high", "bf16_lr_low", "nvfp4") if a in paired]:
        d = paired[arm]
        learn.append(f"against {label(arm)} it was on final held-out accuracy "
                     f"{verdict(d['final_accuracy'], 'higher')}, on train-reward area "
                     f"{verdict(d['reward_auc'], 'higher')}")
    parts.append("Does NVFP4 + AQN learn faster than bf16 LoRA here? " + _capitalized("; ".join(learn)) + ".")
    significant = [(arm, key) for arm in ("bf16_lr_high", "bf16_lr_low") if arm in paired
                   for key in ("final_accuracy", "reward_auc")
                   if paired[arm][key].n >= 2 and (paired[arm][key].low > 0 or paired[arm][key].high < 0)]
    if not significant:
        parts.append("So with these seeds there is no evidence that it learns faster or slower than bf16 LoRA.")
    else:
        faster = all(paired[a][k].low > 0 for a, k in significant)
        slower = all(paired[a][k].high < 0 for a, k in significant)
        parts.append("So it learned " + ("faster" if faster else "slower" if slower else "faster on some measures and "
                                         "slower on others") + " than bf16 LoRA on the measures whose interval "
                     "excludes 0 (" + ", ".join(f"{label(a)}: {STATISTICS[k][0]}" for a, k in significant) + ").")
    explore = []
    for arm in [a for a in ("bf16_lr_high", "bf16_lr_low") if a in paired]:
        d = paired[arm]
        explore.append(f"against {label(arm)}, its rollout entropy was "
                       f"{verdict(d['early_rollout_entropy'], None)} and its teacher-forced entropy "
                       f"{verdict(d['early_train_entropy'], None)}")
    parts.append(f"Does it explore more early (entropy in nats, mean over the first {summary['early_steps']} steps)? "
                 + _capitalized("; ".join(explore)) + ".")
    if "nvfp4" in paired:
        d = paired["nvfp4"]
        parts.append(f"AQN's own share (against NVFP4 without AQN): early rollout entropy "
                     f"{verdict(d['early_rollout_entropy'], None)}, final held-out accuracy "
                     f"{verdict(d['final_accuracy'], 'higher')}.")
    return " ".join(parts)


OUTLIER = 0.25  # a run this far from its arm's median final held-out accuracy is named in the finding


def outliers(summary: dict) -> list[tuple[str, dict, float]]:
    """(arm, run, the arm's median) for each run whose final held-out accuracy lies more than ``OUTLIER`` from its
    arm's median: a few such runs decide an arm's mean and widen every interval they enter."""
    found = []
    for arm, entry in summary["arms"].items():
        values = sorted(s["final_accuracy"] for s in entry["per_seed"] if not _isnan(s["final_accuracy"]))
        if len(values) < 3:
            continue
        median = (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2
        found += [(arm, s, median) for s in entry["per_seed"]
                  if not _isnan(s["final_accuracy"]) and abs(s["final_accuracy"] - median) > OUTLIER]
    return found


def outlier_sentence(summary: dict) -> str:
    found = outliers(summary)
    if not found:
        return ""
    runs = ", ".join(f"{label(arm)} seed {s['seed']} ({s['final_accuracy']:.3f}; its arm's median {median:.3f})"
                     for arm, s, median in found)
    # (the per-run table puts the strict twin beside each value: whether such a run states its answers)
    return (f"Runs far from their arm (final held-out accuracy more than {OUTLIER:.2f} from the arm's median): "
            f"{runs}. They decide their arm's mean and widen every interval they enter; the per-run table shows "
            "them.")


def run_table(data: dict, summary: dict) -> str:
    """Final held-out accuracy of every run, per arm and seed (with the strict twin of a flexible metric)."""
    metric = summary["metric"]
    strict = metric.removesuffix("_flexible") if metric.endswith("_flexible") else None
    seeds = sorted({s["seed"] for entry in data["arms"].values() for s in entry["seeds"]})
    lines = ["| arm | " + " | ".join(f"seed {seed}" for seed in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for arm, entry in data["arms"].items():
        by_seed = {s["seed"]: s["heldout"] for s in entry["seeds"]}
        cells = []
        for seed in seeds:
            heldout = by_seed.get(seed)
            if heldout is None:
                cells.append("missing")
                continue
            cell = f"{heldout[metric][-1]:.3f}"
            if strict and strict in heldout:
                cell += f" ({heldout[strict][-1]:.3f})"
            if heldout["steps"][-1] != summary["final_step"]:  # its last validation is missing: no final score
                cell = f"none (step {heldout['steps'][-1]}: {cell})"
            cells.append(cell)
        lines.append(f"| {label(arm)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def arm_table(summary: dict) -> str:
    head = ["arm", "lr", "seeds", *(STATISTICS[k][0] for k in STATISTICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, entry in summary["arms"].items():
        cells = [label(arm), f"{entry['lr']:.1e}" if entry["lr"] is not None else "", str(len(entry["per_seed"]))]
        for key, (_, pattern, _) in STATISTICS.items():
            interval = entry["intervals"][key]
            cell = fmt(interval, pattern)
            if key == "steps_to_level" and entry["intervals"]["reached"] < interval.n:
                cell = f">= {cell} ({entry['intervals']['reached']}/{interval.n} reached)"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_table(summary: dict) -> str:
    head = ["difference", "seeds", *(STATISTICS[k][0] for k in STATISTICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, d in summary["paired"].items():
        cells = [f"{label(REFERENCE)} - {label(arm)}", str(len(d["seeds"]))]
        for key, (_, pattern, _) in STATISTICS.items():
            cell = f"{fmt(d[key], pattern)}, {fmt_p(d[key].p_value)}"
            if key == "steps_to_level" and d["censored"]:
                cell += " (censored)"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def contrast_table(summary: dict) -> str:
    head = ["difference", "isolates", "seeds", *(STATISTICS[k][0] for k in STATISTICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (a, b), d in summary["contrasts"].items():
        cells = [f"{label(a)} - {label(b)}", CONTRASTS[(a, b)], str(len(d["seeds"]))]
        for key, (_, pattern, _) in STATISTICS.items():
            cells.append(f"{fmt(d[key], pattern)}, {fmt_p(d[key].p_value)}"
                         + (" (censored)" if key == "steps_to_level" and d["censored"] else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def base_table(summary: dict) -> str:
    base = summary["base"]
    lines = [f"| format | untrained `{summary['metric']}` |", "|---|---|"]
    lines += [f"| {q} | {v:.3f} |" for q, v in sorted(base["scores"].items()) if v is not None]
    d = base["difference"]
    if d is not None and d.n >= 2:
        lines.append(f"| nvfp4 - bf16, paired over {d.n} questions | {fmt(d)}, {fmt_p(d.p_value)} |")
    return "\n".join(lines)


def correlation_table(summary: dict) -> str:
    lines = ["| early rollout-entropy rise vs | all runs | within arms (each arm's mean out) |", "|---|---|---|"]
    for key, name in PREDICTED.items():
        c = summary["correlations"][key]
        lines.append(f"| {name} | {fmt_r(c['pooled'])} | {fmt_r(c['within'])} |")
    return "\n".join(lines)


def plateau(data: dict, metric: str) -> str:
    """Whether the best arm's held-out accuracy had stopped rising: its mean over seeds at the last validations."""
    best, best_curve, steps = None, None, None
    for arm, entry in data["arms"].items():
        curves = [s["heldout"][metric] for s in entry["seeds"] if s["heldout"].get(metric)]
        if not curves or len({len(c) for c in curves}) != 1:
            continue
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]
        if best_curve is None or mean[-1] > best_curve[-1]:
            best, best_curve, steps = arm, mean, entry["seeds"][0]["heldout"]["steps"]
    if best is None:
        return "no held-out curve to judge"
    tail = ", ".join(f"{v:.3f} (step {s})" for s, v in list(zip(steps, best_curve))[-3:])
    return f"the best arm ({label(best)}) had a mean held-out accuracy of {tail} at its last validations"


PLAN = [  # what the answers decide (issue 40); fixed text, true whatever the numbers say
    "## What would change the recipes' defaults",
    "",
    "AQN is on in every recipe, `configs/recipes/bf16.yaml` included (it changes the format and the rate, not the "
    "noise). If (a) shows bf16 + AQN below bf16 at the same rate on final held-out accuracy (interval below 0 with 5 "
    "seeds) and (b) shows NVFP4 + AQN below NVFP4 at the same rate too, AQN goes off by default for small models "
    "(`aqn.enabled: false` in the configs that train the embedded 135M model) and the README says where it "
    "introduces AQN that it hurt here; if (a) or the NVFP4 noise contrast lies above 0, AQN stays on and the "
    "README cites the interval; if both include 0, the defaults stay (the paper's setting) and the page says the "
    "noise made no difference these seeds can see. `bf16.yaml` turns AQN off only if bf16 + AQN is below bf16 at "
    "the bf16 rate.",
]


def decision(summary: dict) -> str:
    """What ``PLAN``'s rule makes of these numbers."""
    contrasts = summary["contrasts"]
    pairs = {"bf16": ("bf16_aqn", "bf16_lr_low"), "NVFP4": ("nvfp4_aqn", "nvfp4")}
    found = {k: contrasts[p]["final_accuracy"] for k, p in pairs.items()
             if p in contrasts and contrasts[p]["final_accuracy"].n >= 2}
    if len(found) < 2:
        return "Decision: not yet (the rule needs both noise contrasts with at least 2 seeds)."
    below = [k for k, d in found.items() if d.high < 0]
    above = [k for k, d in found.items() if d.low > 0]
    text = "AQN minus no AQN at one rate, final held-out accuracy: " + ", ".join(
        f"{k} {fmt(d, '{:+.3f}')}" for k, d in found.items())
    if len(below) == 2:
        return f"Decision from these numbers ({text}): AQN goes off by default for small models."
    if above:
        return f"Decision from these numbers ({text}): AQN stays on; the README cites the interval."
    if below:
        return (f"Decision from these numbers ({text}): the "
                f"defaults stay, since only the {below[0]} contrast lies below 0; the README says where it introduces "
                "AQN that it hurt here.")
    return f"Decision from these numbers ({text}): the defaults stay; the noise made no difference these seeds can see."


def gpu_time(data: dict) -> list[str]:
    """The runs' wall time (from each run's ``wall_seconds``) and the machine time of the calls that ran them (from
    ``calls``: start to last write of each; a JSON without them: the run time over ``--parallel``)."""
    seconds = [s.get("wall_seconds") for a in data["arms"].values() for s in a["seeds"]]
    seconds += [b.get("wall_seconds") for b in (data.get("base") or {}).values() if b]
    seconds = [x for x in seconds if x is not None]
    if not seconds:
        return []
    text = (f"Time: {len(seconds)} runs took {sum(seconds) / 60:.1f} minutes of run time in all "
            f"({max(seconds):.0f} s the longest)")
    calls = data.get("calls") or []
    if calls:
        spans = [call_seconds(c) for c in calls]
        text += (f"; {len(calls)} calls of the command ran them in {sum(spans) / 60:.1f} minutes of machine time ("
                 + ", ".join(f"{t / 60:.1f} min with {c['parallel']} at a time" for c, t in zip(calls, spans))
                 + "), not counting each machine's start.")
    else:
        parallel = int(data.get("parallel") or 1)
        text += f"; with {parallel} at a time that is about {sum(seconds) / parallel / 60:.1f} minutes of machine time."
    return [text, ""]


def call_seconds(call: dict) -> float:
    start, end = (datetime.strptime(call[k], "%Y-%m-%dT%H:%M:%SZ") for k in ("started", "written"))
    return (end - start).total_seconds()


def render(data: dict, summary: dict, report_command: str, plots: list[str]) -> str:
    metric, level = summary["metric"], summary["level"]
    device = data.get("device", {})
    where = device.get("gpu") or device.get("cpu") or device.get("requested", "?")
    unscored = [f"{arm}/seed_{r['seed']}" for arm, entry in summary["arms"].items() for r in entry["per_seed"]
                if _isnan(r["final_accuracy"])]
    lines = [
        "# Is it the noise or the quantization? NVFP4, AQN and bf16 LoRA on one small model",
        "",
        finding(summary),
        "",
        reference_finding(summary),
        "",
        f"Setup: `{data['config']['path']}` (the embedded SmolLM2-135M-Instruct learning two-digit arithmetic "
        f"expressions; greedy held-out accuracy `{metric}` on questions training never draws), {summary['steps']} "
        f"steps per run, arms x seeds as listed, on {where}. "
        + ("" if data.get("complete", True) else f"**Incomplete: missing {', '.join(data['missing'])}.** ")
        + (f"**No validation at the last step (no final score): {', '.join(unscored)}.** " if unscored else "")
        + f"Statistics: train-reward area = trapezoidal area under the per-step mean reward divided by the steps; "
        f"steps to level = the first validation step at which held-out accuracy >= {level:.2f} (runs that never "
        f"reach it count as {summary['steps']}, so such a mean is a lower bound: marked >= and censored); early "
        f"entropy = mean over the first {summary['early_steps']} steps of `rollout/entropy` (the sampling policy, "
        "with its noise, on its own samples) and `train/entropy` (the clean training policy on the same tokens: "
        f"teacher-forced); early rollout-entropy rise = its mean over {span(summary['rise'][0] + 1, summary['rise'][1])}"
        f" minus {span(1, summary['rise'][0])}; late train reward = the mean reward of the last "
        f"{summary['early_steps']} steps.",
        "",
        "## Per arm (mean [95% interval] over seeds)",
        "",
        arm_table(summary),
        "",
        f"## Final `{metric}` per run"
        + (f" (`{metric.removesuffix('_flexible')}`, the stated answer only, in parentheses)"
           if metric.endswith("_flexible") else ""),
        "",
        run_table(data, summary),
        "",
        "## The untrained model per format (step 0 of every curve; greedy, so one value per format)",
        "",
        base_table(summary),
        "",
        "## Contrasts: each pair differs in one setting (paired by seed)",
        "",
        contrast_table(summary),
        "",
        *([f"## Paired by seed: {label(REFERENCE)} minus each arm", "", paired_table(summary), ""]
          if summary["paired"] else []),
        "## Early entropy rise and later reward, per run (Pearson r, Fisher-z 95% interval)",
        "",
        correlation_table(summary),
        "",
    ]
    if plots:
        lines += ["## Curves (mean over seeds, band: 95% t-interval per step) and the runs' scatter", ""]
        lines += [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    lines += [
        "## Reproduce",
        "",
        f"    {(data.get('calls') or [data])[0]['command']}",
        f"    {report_command}",
        "",
        *(["The first line again (same arguments) until it prints `complete`: a call resumes the stopped runs and "
           "skips the finished ones (`--archive` carries them to a fresh machine)."]
          if len(data.get("calls") or []) > 1 else []),
        "",
        "Every run's `train.py` arguments are in the JSON (`train_args`); the JSON holds every curve per seed.",
        "",
        *gpu_time(data),
        *PLAN,
        "",
        decision(summary),
        "",
        "## What would change the answer",
        "",
    ]
    for arm, d in summary["paired"].items():
        if arm.startswith("bf16"):
            n = seeds_to_resolve(d["final_accuracy"])
            if n is not None and n > d["final_accuracy"].n:
                lines.append(f"- More seeds: a final-accuracy difference against {label(arm)} of the observed size "
                             f"({d['final_accuracy'].mean:+.3f}, spread {d['final_accuracy'].sd:.3f}) would need about "
                             f"{n} seeds to exclude 0.")
    lines += [
        f"- Longer runs: {plateau(data, metric)}; if it was still rising, the final accuracies compare speeds, not "
        "end points.",
        "- Another model: one 135M model, where NVFP4 costs relatively more accuracy than in the paper's 3B-32B "
        "models (docs/entropy.md: its NVFP4 samples have *lower* entropy than bf16's), so the paper's claim may hold "
        "at scale and not here, or the reverse.",
        "- Other rates and schedules: one rate per arm (the recipes' rule for bf16 at both), the QeRL AQN schedule "
        "(K = 10, 1e-2 -> 1e-4); another held-out level (`--level`) or early window (`--early-steps`) changes those "
        "two columns only.",
        "- Noise below the weights' resolution: on the GPU the norm weights are bf16 in every arm (the policy's "
        "dtype), so a draw smaller than half a bf16 step of its weight rounds away, which in the last stages is most "
        "of them; the same in every AQN arm, bf16 or NVFP4, so no contrast is tilted by it, but the late stages add "
        "less noise than the schedule says.",
        "",
        "Earlier (one seed per arm, 16 steps of a + b within 1..9, 81 distinct questions) the arms could not be told "
        "apart; that page is in the git history of docs/learning.md.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Plots (matplotlib imported only here).


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def band(curves: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Mean and 95% t-interval per point over seeds (the mean alone for one seed; nan values left out)."""
    means, lows, highs = [], [], []
    for values in zip(*curves):
        interval = mean_interval(values)
        means.append(interval.mean)
        lows.append(interval.low if interval.n > 1 else interval.mean)
        highs.append(interval.high if interval.n > 1 else interval.mean)
    return means, lows, highs


def plot(data: dict, metric: str, out: Path, window: int = 5) -> list[Path]:
    """One PNG: train reward, held-out accuracy, rollout entropy and teacher-forced entropy per arm, mean over seeds
    with a 95% band (train curves smoothed per seed by a ``window``-step moving average). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "train reward"), (metric, f"held-out {metric}"), ("rollout_entropy", "rollout entropy"),
              ("train_entropy", "teacher-forced entropy")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 3.5))
    for ax, (key, title) in zip(axes, panels):
        for i, (arm, entry) in enumerate(data["arms"].items()):
            seeds = entry["seeds"]
            if not seeds:
                continue
            if key == metric:  # aligned by step: a validation missing in one seed is left out of that point only
                steps = sorted({t for s in seeds for t in s["heldout"]["steps"]})
                curves = [[dict(zip(s["heldout"]["steps"], s["heldout"][key])).get(t, math.nan) for t in steps]
                          for s in seeds if s["heldout"].get(key)]
            else:
                curves = [moving_average(s[key], window) for s in seeds]
                steps = seeds[0]["steps"]
            if not curves or len({len(c) for c in curves}) != 1:
                continue
            mean, low, high = band(curves)
            ax.plot(steps, mean, color=f"C{i}", marker="o" if key == metric else None, ms=3,
                    label=f"{label(arm)} (n={len(curves)})")
            ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.18, linewidth=0)
        if key == metric:  # the untrained model per format: every curve's step 0, drawn across the panel
            for quantization, style in (("nvfp4", ":"), ("bf16", "--")):
                value = ((data.get("base") or {}).get(quantization) or {}).get("heldout", {}).get(metric)
                if value is not None:
                    ax.axhline(value, color="0.4", linestyle=style, linewidth=1, label=f"untrained, {quantization}")
            ax.legend(fontsize=6, loc="lower right")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def scatter(summary: dict, out: Path) -> Path:
    """One PNG: every run's early rollout-entropy rise against its final held-out accuracy and its late train reward,
    a colour per arm, r over all runs and within arms in each panel's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PREDICTED), figsize=(5.2 * len(PREDICTED), 4.0))
    for ax, (key, name) in zip(axes, PREDICTED.items()):
        for i, (arm, entry) in enumerate(summary["arms"].items()):
            runs = entry["per_seed"]
            ax.scatter([r["entropy_rise"] for r in runs], [r[key] for r in runs], color=f"C{i}", s=22,
                       label=f"{label(arm)} (n={len(runs)})")
        c = summary["correlations"][key]
        ax.set_title(f"{name}\nall runs {fmt_r(c['pooled'])}\nwithin arms {fmt_r(c['within'])}", fontsize=8)
        ax.set_xlabel("early rollout-entropy rise (nats)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    path = out.with_name(out.name + "_entropy_rise").with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="the JSON aqn_seeds.py wrote")
    parser.add_argument("--metric", default="expressions_acc_flexible",
                        help="the held-out metric (a key of each seed's heldout curves)")
    parser.add_argument("--level", type=float, default=None,
                        help="held-out accuracy level for steps-to-level (default: half-way from the untrained score "
                             "to the best arm's final score, rounded down to 0.05)")
    parser.add_argument("--early-steps", type=int, default=None,
                        help="steps averaged for early entropy (default: the first two AQN stages)")
    parser.add_argument("--page", type=Path, default=Path("docs/learning.md"))
    parser.add_argument("--plots", type=Path, default=Path("docs/results/aqn_seeds"),
                        help="plot path without extension")
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    summary = summarize(data, args.metric, args.level, args.early_steps)
    plots = []
    try:
        written = plot(data, args.metric, args.plots) + [scatter(summary, args.plots)]
        plots = [Path(os.path.relpath(p, args.page.parent)).as_posix() for p in written]
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[docs]')", file=sys.stderr)
    command = shlex.join(["python", "docs/experiments/aqn_report.py", *argv])
    args.page.write_text(render(data, summary, command, plots))
    print(finding(summary))
    print(f"wrote {args.page}" + (f" and {', '.join(plots)}" if plots else ""))
    return summary


if __name__ == "__main__":
    main()
