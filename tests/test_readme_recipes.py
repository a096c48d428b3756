"""The README's table of memory per recipe is the memory plan's: the least free GPU memory the plan accepts for each
recipe as shipped (NVFP4 and its bf16 baseline) and the NVFP4 weights + LoRA it holds, recomputed here from the
recipes and the models' real shapes (no model loads)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def readme_rows() -> dict[str, tuple[int, int, float]]:
    """recipe -> (least GiB NVFP4, least GiB bf16, NVFP4 weights + LoRA GiB), from the README's table."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Memory and time per recipe"):text.index("## Any Hub model")]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([\w.\-]+)_(gsm8k|bigmath)`( / `_bigmath`)? \| ([\d /,]+) \| ([\d.]+) \|", line)
        if not match:
            continue
        name, first, both, least, resident = match.groups()
        pairs = [tuple(int(v) for v in pair.split("/")) for pair in least.split(",")]
        tasks = ["gsm8k", "bigmath"] if both else [first]
        for task, pair in zip(tasks, pairs, strict=True):
            rows[f"{name}_{task}"] = (*pair, float(resident))
    return rows


def least_gib(recipe: str, quantization: str) -> tuple[int, float]:
    """The least whole GiB the plan accepts, and the resident GiB of the plan there."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_memory import configured

    from qerl.model.footprint import ModelShape
    from qerl.run.memory_plan import MemoryPlanError, plan_memory
    from qerl.run.resolve import engine_settings, run_settings
    from qerl.testing.random_models import model_config

    model, task = recipe.rsplit("_", 1)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cli = configured({"model": model, "task": task, "quantization": quantization})
    settings, shape = run_settings(cli.config), ModelShape.from_config(model_config(model))

    def plan(gib: int):
        try:
            return plan_memory(shape, settings, free_bytes=gib * GIB, total_bytes=gib * GIB,
                               wave_rows=engine_settings(cli.config.model.rollout).wave_rows,
                               micro_batch_tokens=cli.config.model["update"].micro_batch_tokens)
        except MemoryPlanError:
            return None

    low, high = 1, 200  # plan(low) refused, plan(high) accepted
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if plan(middle) else (middle, high)
    return high, plan(high).peak("resident") / GIB


def test_the_readme_has_every_recipe():
    recipes = {p.stem for p in (ROOT / "configs" / "recipes").glob("*.yaml") if p.stem.endswith(("_gsm8k", "_bigmath"))}
    assert set(readme_rows()) == recipes


@pytest.mark.parametrize("recipe", sorted(readme_rows()))
def test_the_least_memory_and_the_weights_are_the_plans(recipe, no_model_loads, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes are read from configs/
    nvfp4, bf16, resident = readme_rows()[recipe]
    least, planned_resident = least_gib(recipe, "nvfp4")
    assert (least, round(planned_resident, 1)) == (nvfp4, resident)
    assert least_gib(recipe, "bf16")[0] == bf16
