"""TensorBoard event files of several runs -> one PNG of reward / accuracy / entropy curves (+ a JSON of the numbers).

    python docs/experiments/plot_runs.py runs/learn_nvfp4_aqn runs/learn_nvfp4_noaqn runs/learn_bf16_lora \
        --labels "NVFP4 + AQN" "NVFP4" "bf16 LoRA" --out docs/results/learning

Each run argument is a directory holding event files (searched recursively, e.g. ``runs/smoke`` with its
``version_*``; the newest version is used). Tags default to the ones the trainer writes; ``--smooth`` applies an
exponential moving average to the train curves (the raw points are drawn faintly). Needs matplotlib
(``pip install -e ".[docs]"``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TAGS = ["train/reward", "train/accuracy", "train/entropy", "rollout/entropy", "val/arithmetic_acc"]


def read_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from the newest ``version_*`` (or the directory itself) of ``run``."""
    candidates = sorted({p.parent for p in run.rglob("events.out.tfevents.*")}, key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise FileNotFoundError(f"no TensorBoard event file under {run}")
    return {tag: sorted(points.items()) for tag, points in merged_scalars(candidates[-1]).items()}


def merged_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every event file directly in ``directory``, read in the order they were written:
    a run resumed from a checkpoint logs the steps after it again (into a new file), and the later value wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def written(path: Path) -> tuple[int, float, str]:  # events.out.tfevents.<unix time>.<host>.<pid>.<n>
        stamp = path.name.split(".")[3]
        return (int(stamp) if stamp.isdigit() else 0, path.stat().st_mtime, path.name)

    merged: dict[str, dict[int, float]] = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*"), key=written):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0}).Reload()
        for tag in events.Tags()["scalars"]:
            merged.setdefault(tag, {}).update((e.step, e.value) for e in events.Scalars(tag))
    return merged


def ema(values: list[float], weight: float) -> list[float]:
    out, last = [], None
    for v in values:
        last = v if last is None else weight * last + (1 - weight) * v
        out.append(last)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="*", default=None)
    parser.add_argument("--tags", nargs="*", default=TAGS)
    parser.add_argument("--smooth", type=float, default=0.6, help="EMA weight for train/* and rollout/* curves")
    parser.add_argument("--out", default="docs/results/learning", help="output path without extension")
    args = parser.parse_args(argv)
    labels = args.labels or [str(r) for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error("give one label per run")
    data = {label: read_scalars(run) for label, run in zip(labels, args.runs)}
    tags = [t for t in args.tags if any(t in d for d in data.values())]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {label: {tag: {"steps": len(d.get(tag, [])),
                             "first": d[tag][0][1] if d.get(tag) else None,
                             "last": d[tag][-1][1] if d.get(tag) else None,
                             "mean": sum(v for _, v in d[tag]) / len(d[tag]) if d.get(tag) else None}
                       for tag in tags}
               for label, d in data.items()}
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "scalars": data}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tags), figsize=(4 * len(tags), 3.4), squeeze=False)
    for ax, tag in zip(axes[0], tags):
        for i, (label, d) in enumerate(data.items()):
            points = d.get(tag, [])
            if not points:
                continue
            steps, values = zip(*points)
            color = f"C{i}"
            if tag.startswith("val/"):
                ax.plot(steps, values, "o-", color=color, label=label)
            else:
                ax.plot(steps, values, color=color, alpha=0.25)
                ax.plot(steps, ema(list(values), args.smooth), color=color, label=label)
        ax.set_title(tag, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    for label, tags_summary in summary.items():
        print(label, {t: (s["first"], s["last"], s["steps"]) for t, s in tags_summary.items()})
    return summary


if __name__ == "__main__":
    main()
