"""One run's TensorBoard event file -> a PNG of the Custom Scalars dashboard (the charts of ``LAYOUT``).

    python docs/experiments/plot_dashboard.py runs/smoke --out docs/results/dashboard

Draws each chart of ``qerl.callbacks.scalar_layout.LAYOUT`` (the layout every run writes) with the tags its regexes
match, one row per category. Needs matplotlib (``pip install -e ".[docs]"``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_runs import read_scalars  # noqa: E402

from qerl.callbacks.scalar_layout import LAYOUT  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a directory holding event files (the newest version is used)")
    parser.add_argument("--out", default="docs/results/dashboard", help="output path without extension")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalars = read_scalars(args.run)
    width = max(len(charts) for charts in LAYOUT.values())
    fig, axes = plt.subplots(len(LAYOUT), width, figsize=(4.2 * width, 2.8 * len(LAYOUT)), squeeze=False)
    for row, (category, charts) in zip(axes, LAYOUT.items()):
        for ax, (title, patterns) in zip(row, charts.items()):
            tags = sorted(t for t in scalars if any(re.search(p, t) for p in patterns))
            for tag in tags:
                steps, values = zip(*scalars[tag])
                ax.plot(steps, values, marker="o" if len(steps) < 4 else None, ms=3, label=tag)
            ax.set_title(f"{category[2:]}: {title}" if ax is row[0] else title, fontsize=9)
            ax.tick_params(labelsize=7)
            if tags:
                ax.legend(fontsize=6)
            else:
                ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", fontsize=8, color="gray")
        for ax in row[len(charts):]:
            ax.axis("off")
    fig.suptitle(f"Custom Scalars layout: {args.run.name}", fontsize=11)
    fig.tight_layout()
    out = Path(args.out).with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
