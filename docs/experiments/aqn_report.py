"""The AQN experiment's JSON (``aqn_seeds.py``) -> statistics, plots and ``docs/learning.md``.

    python docs/experiments/aqn_report.py docs/results/aqn_seeds.json
    python docs/experiments/aqn_report.py docs/results/aqn_seeds.json --level 0.4 --early-steps 20 --page /tmp/x.md

The page's first paragraph is generated from the numbers: whether NVFP4 + AQN learned faster than bf16 LoRA (reward
area, steps to a held-out accuracy level, final held-out accuracy; paired by seed, 95% Student-t intervals) and
whether it explored more early (rollout and teacher-forced entropy over the first steps). Then the per-arm table, the
paired differences, the commands that reproduce it and what would change the answer. The statistics are the pure
functions of ``aqn_stats.py``; plots need matplotlib (``pip install -e ".[docs]"``) and are skipped without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aqn_stats import (  # noqa: E402
    Interval,
    area_under_curve,
    censored_steps,
    early_mean,
    first_reaching,
    mean_interval,
    paired_difference,
    t_ppf,
)

REFERENCE = "nvfp4_aqn"
LABELS = {
    "nvfp4_aqn": "NVFP4 + AQN",
    "nvfp4": "NVFP4",
    "bf16_lr_high": "bf16 LoRA, NVFP4 rate",
    "bf16_lr_low": "bf16 LoRA, bf16 rate",
}
STATISTICS = {  # key -> (column title, format, what "better" means for the finding)
    "reward_auc": ("train reward, area / steps", "{:.3f}", "higher"),
    "steps_to_level": ("steps to held-out level", "{:.0f}", "lower"),
    "final_accuracy": ("final held-out accuracy", "{:.3f}", "higher"),
    "early_rollout_entropy": ("early rollout entropy (nats)", "{:.3f}", None),
    "early_train_entropy": ("early teacher-forced entropy (nats)", "{:.3f}", None),
}


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


def seed_statistics(seed: dict, metric: str, level: float, early_steps: int) -> dict:
    """The five statistics of one run."""
    heldout = seed["heldout"]
    return {
        "seed": seed["seed"],
        "reward_auc": area_under_curve(seed["steps"], seed["reward"]),
        "steps_to_level": first_reaching(heldout["steps"], heldout[metric], level),
        "final_accuracy": heldout[metric][-1],
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
    arms = {}
    for arm, entry in data["arms"].items():
        per_seed = [seed_statistics(s, metric, level, early_steps) for s in entry["seeds"]]
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
    paired = {}
    if REFERENCE in arms:
        reference = {s["seed"]: s for s in arms[REFERENCE]["per_seed"]}
        for arm, summary in arms.items():
            if arm == REFERENCE:
                continue
            other = {s["seed"]: s for s in summary["per_seed"]}
            seeds = sorted(set(reference) & set(other))
            paired[arm] = {"seeds": seeds}
            for key in STATISTICS:
                a = [_censor(reference[s][key], key, steps) for s in seeds]
                b = [_censor(other[s][key], key, steps) for s in seeds]
                paired[arm][key] = paired_difference(a, b)
            paired[arm]["censored"] = any(reference[s]["steps_to_level"] is None or other[s]["steps_to_level"] is None
                                          for s in seeds)
    return {"metric": metric, "level": level, "early_steps": early_steps, "steps": steps, "arms": arms,
            "paired": paired}


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


def finding(summary: dict) -> str:
    """The page's first paragraph: the answer and its confidence, from the numbers only."""
    arms, paired = summary["arms"], summary["paired"]
    n = min((len(a["per_seed"]) for a in arms.values()), default=0)
    if REFERENCE not in arms or not paired:
        return f"**Not answered yet:** the data hold no {label(REFERENCE)} arm or nothing to compare it with."
    parts = [f"**Finding (seeds per arm: {n}; {summary['steps']} steps; 95% Student-t intervals; differences paired "
             f"by seed):**"]
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


def render(data: dict, summary: dict, report_command: str, plots: list[str]) -> str:
    metric, level = summary["metric"], summary["level"]
    device = data.get("device", {})
    where = device.get("gpu") or device.get("cpu") or device.get("requested", "?")
    lines = [
        "# Does NVFP4 (+ AQN) learn faster than bf16 LoRA, and does it explore more early?",
        "",
        finding(summary),
        "",
        f"Setup: `{data['config']['path']}` (the embedded SmolLM2-135M-Instruct learning two-digit arithmetic "
        f"expressions; greedy held-out accuracy `{metric}` on questions training never draws), {summary['steps']} "
        f"steps per run, arms x seeds as listed, on {where}. "
        + ("" if data.get("complete", True) else f"**Incomplete: missing {', '.join(data['missing'])}.** ")
        + f"Statistics: train-reward area = trapezoidal area under the per-step mean reward divided by the steps; "
        f"steps to level = the first validation step at which held-out accuracy >= {level:.2f} (runs that never "
        f"reach it count as {summary['steps']}, so such a mean is a lower bound: marked >= and censored); early "
        f"entropy = mean over the first {summary['early_steps']} steps of `rollout/entropy` (the sampling policy, "
        "with its noise, on its own samples) and `train/entropy` (the clean training policy on the same tokens: "
        "teacher-forced).",
        "",
        "## Per arm (mean [95% interval] over seeds)",
        "",
        arm_table(summary),
        "",
        f"## Paired by seed: {label(REFERENCE)} minus each arm",
        "",
        paired_table(summary),
        "",
    ]
    if plots:
        lines += ["## Curves (mean over seeds, band: 95% t-interval per step)", ""]
        lines += [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    lines += [
        "## Reproduce",
        "",
        f"    {data['command']}",
        f"    {report_command}",
        "",
        "Every run's `train.py` arguments are in the JSON (`train_args`); the JSON holds every curve per seed.",
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
    """Mean and 95% t-interval per point over seeds (the mean alone for one seed)."""
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
            if key == metric:
                curves = [s["heldout"][key] for s in seeds if s["heldout"].get(key)]
                steps = seeds[0]["heldout"]["steps"]
            else:
                curves = [moving_average(s[key], window) for s in seeds]
                steps = seeds[0]["steps"]
            if not curves or len({len(c) for c in curves}) != 1:
                continue
            mean, low, high = band(curves)
            ax.plot(steps, mean, color=f"C{i}", marker="o" if key == metric else None, ms=3,
                    label=f"{label(arm)} (n={len(curves)})")
            ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.18, linewidth=0)
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
        written = plot(data, args.metric, args.plots)
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
