"""docs/model_sizes.md is what docs/make_model_sizes.py writes from the memory plan and bench/results (so the largest
model per card cannot drift from the plan), and the plan's answer is the one the recipes promise: a 70B-class model
trains in NVFP4 on one 80 GB card, its bf16 LoRA baseline on no single card."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_model_sizes", ROOT / "docs" / "make_model_sizes.py")
make_model_sizes = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("make_model_sizes", make_model_sizes)
_spec.loader.exec_module(make_model_sizes)


def test_the_committed_page_is_what_the_plan_and_the_results_give(no_model_loads):
    page = (ROOT / "docs" / "model_sizes.md").read_text()
    assert make_model_sizes.render() == page, (
        "docs/model_sizes.md is out of date: run python docs/make_model_sizes.py and commit the page")
    largest = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:3]
               for line in page.splitlines() if line.startswith("| ") and " GB (" in line}
    nvfp4_80, bf16_80 = largest["80 GB (H100, A100 80GB)"]
    assert nvfp4_80.startswith(("qwen2.5-72b", "llama3.3-70b")) and bf16_80.startswith(("qwen2.5-32b", "qwen3-32b"))
    assert not largest["141 GB (H200)"][1].startswith(("qwen2.5-72b", "llama3.3-70b"))  # 141 GB of bf16 weights
