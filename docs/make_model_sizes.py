"""Writes ``docs/model_sizes.md``: the largest model each GPU size trains, NVFP4 and bf16 LoRA, from the memory plan,
with the memory rows measured on GPUs beside it.

    python docs/make_model_sizes.py            # rewrite docs/model_sizes.md
    python docs/make_model_sizes.py --check    # exit 1 when the page is not what the plan and the results give

No GPU: each model's gsm8k recipe is parsed as ``train.py fit`` parses it (the Llama 3 shapes without a recipe of
their own take the Qwen2.5 one of their size), with gradient checkpointing on and ``micro_batch_tokens: auto``, and
planned (``qerl.run.memory_plan``) for the memory each card leaves PyTorch, as ``--memory_budget_gb`` plans it: the
plan chooses the waves and the micro-batch budget, or refuses. ``tests/test_model_sizes_page.py`` checks that the
committed page is current.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "model_sizes.md"
RESULTS = ROOT / "bench" / "results"
# GiB a card leaves PyTorch after the CUDA context (what --memory_budget_gb holds a run to), by its nominal size
CARDS = {24: 22.5, 48: 44.5, 80: 78.6, 141: 139.0}
CARD_NAMES = {24: "RTX 4090, L4", 48: "L40S, RTX 6000 Ada", 80: "H100, A100 80GB", 141: "H200"}
FORMATS = ("nvfp4", "bf16")
# the Llama 3 shapes without a recipe of their own run the Qwen2.5 one of about their size
RECIPE_OF = {"llama3.2-1b": "qwen2.5-3b", "llama3.2-3b": "qwen2.5-3b", "llama3.1-8b": "qwen2.5-7b"}


def shapes() -> list[tuple[str, float]]:
    """(shape name, billions of parameters) of every shape in ``qerl.testing.random_models``, smallest first."""
    from qerl.model.footprint import ModelShape  # noqa: F401  (the plan's import, before transformers warms up)
    from qerl.testing.random_models import LLAMA3, QWEN3, QWEN25, model_config

    sizes = []
    for name in (*QWEN25, *QWEN3, *LLAMA3):
        config = model_config(name)
        embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        layer = config.hidden_size * (2 * q + 2 * kv) + 3 * config.hidden_size * config.intermediate_size
        sizes.append((name, (embeddings + config.num_hidden_layers * layer) / 1e9))
    return sorted(sizes, key=lambda s: s[1])


@functools.cache
def recipe_settings(recipe: str, quantization: str):
    """The plan's settings of the gsm8k recipe of the shape ``recipe`` as ``train.py`` parses it (+ bf16.yaml for
    bf16), with gradient checkpointing on."""
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule
    from qerl.run.resolve import run_settings

    configs = ["configs/gpu.yaml", f"configs/recipes/{recipe}_gsm8k.yaml"]
    configs += ["configs/recipes/bf16.yaml"] if quantization == "bf16" else []
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                  args=[a for c in configs for a in ("--config", str(ROOT / c))] + ["--trainer.accelerator", "cpu"])
    return replace(run_settings(cli.config), gradient_checkpointing=True)


def plans() -> dict:
    """{(shape, format, card): the plan's summary, or None where it refuses}."""
    from qerl.model.footprint import GIB, ModelShape
    from qerl.run.memory_plan import MemoryPlanError, plan_memory
    from qerl.testing.random_models import model_config

    out = {}
    for name, _ in shapes():
        shape = ModelShape.from_config(model_config(name))
        for quantization in FORMATS:
            settings = recipe_settings(RECIPE_OF.get(name, name), quantization)
            for card, gib in CARDS.items():
                try:
                    plan = plan_memory(shape, settings, int(gib * GIB), micro_batch_tokens="auto",
                                       total_bytes=int(gib * GIB))
                    out[name, quantization, card] = plan.summary()
                except MemoryPlanError:
                    out[name, quantization, card] = None
    return out


def measured_rows(results_dir: Path) -> list[dict]:
    """The memory rows measured on a GPU, each with the card it stands for: an 80 GB H100, an H200 held to an 80 GB
    card's memory (``budget_gb``), a whole H200."""
    rows = []
    for path in sorted(results_dir.glob("memory_*.json")):
        result = json.loads(path.read_text())
        for r in result.get("rows", []):
            if "peak_rollout_gb" not in r or "device_gb" in r:  # another benchmark's, or planned for another size
                continue
            gib = r.get("budget_gb") or (78.6 if "H100" in result["device"] else 139.0)
            card = min(CARDS, key=lambda c: abs(CARDS[c] - gib))
            rows.append({**r, "card": card, "file": path.name, "device": result["device"]})
    return rows


def render(results_dir: Path = RESULTS) -> str:
    sizes = dict(shapes())
    planned = plans()
    lines = ["# Which model fits which GPU", "",
             "Written by `docs/make_model_sizes.py` from the memory plan (`qerl/run/memory_plan.py`) and the memory "
             "rows in `bench/results/`; do not edit by hand. Each model's gsm8k recipe (16 prompts x 8, 256-token "
             "prompts, 2,048 new tokens, LoRA r16 on every projection) with gradient checkpointing and "
             "`micro_batch_tokens: auto`, planned for the memory each card leaves PyTorch "
             f"({', '.join(f'{c} GB: {g} GiB' for c, g in CARDS.items())}): the plan decodes in waves of whole "
             "groups and sizes the update's micro-batches to fit. `--memory_budget_gb N` holds a run on a larger "
             "GPU to N GiB (plan and PyTorch's allocator), which is how a card's rows are measured on a larger one.",
             "", "## Largest model per card", "",
             "| card | NVFP4 + LoRA | bf16 + LoRA |", "| --- | --- | --- |"]
    for card in CARDS:
        cells = []
        for quantization in FORMATS:
            fits = [n for n in sizes if planned[n, quantization, card] is not None]
            best = max(fits, key=sizes.get) if fits else None
            plan = planned[best, quantization, card] if best else None
            cells.append(f"{best} ({sizes[best]:.1f}B; waves of {plan['wave_rows']} rows, peak "
                         f"{plan['peak_gb']:.1f} GiB)" if best else "none")
        lines.append(f"| {card} GB ({CARD_NAMES[card]}) | {cells[0]} | {cells[1]} |")
    lines += ["", "## Every shape", "",
              "Rows per wave the plan chooses (of 128), or `-` where the plan refuses (the weights and LoRA state "
              "alone, or one group's rollout or one row's update, do not fit).", "",
              "| model | params | " + " | ".join(f"{c} GB {q}" for c in CARDS for q in FORMATS) + " |",
              "| --- | --- | " + " | ".join("---" for _ in CARDS for _ in FORMATS) + " |"]
    for name, billions in sizes.items():
        cells = [str(planned[name, q, c]["wave_rows"]) if planned[name, q, c] else "-" for c in CARDS for q in FORMATS]
        lines.append(f"| {name} | {billions:.1f}B | " + " | ".join(cells) + " |")
    lines += ["", "## Measured", "",
              "Rows of `bench/bench_memory.py` (random weights of the real shape, the recipe's batch, lognormal "
              "lengths): GiB PyTorch allocated at each phase's peak, measured (planned), and the step time.", "",
              "| card | model | weights | rows x new tokens | run on | wave rows | resident GiB | rollout peak GiB | "
              "update peak GiB | step s | file |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(measured_rows(results_dir), key=lambda r: (r["card"], sizes.get(r["model"], 0))):
        both = lambda key: f"{r[key]:.1f} ({r['plan_' + key]:.1f})"  # noqa: E731
        held = f", held to {r['budget_gb']} GiB" if "budget_gb" in r else ""
        lines.append(f"| {r['card']} GB | {r['model']} | {r['quantization']} | {r['prompts'] * r['group_size']} x "
                     f"{r['new_tokens']} | {r['device']}{held} | {r['plan_wave_rows']} | {both('resident_gb')} | "
                     f"{both('peak_rollout_gb')} | {both('peak_update_gb')} | {r['step_s']:.1f} | `{r['file']}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the page is stale")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"out of date: {PAGE}; run python docs/make_model_sizes.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
