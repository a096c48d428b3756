"""The calibrated quantize path's own parts, without llmcompressor: the calibration prompts a config's data section
gives, the fused-global-scale check, and the command line's refusals (before any model loads).
``tests/test_llmcompressor.py`` runs llmcompressor itself in its own environment."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from qerl.calibration import calibration_prompts, read_data_section, unshared_global_scales
from qerl.data.sources import ArithmeticSource
from qerl.quantize import main

ROOT = Path(__file__).resolve().parents[1]
HAS_LLMCOMPRESSOR = importlib.util.find_spec("llmcompressor") is not None


def reference_ids(tokenizer, questions, instruction: str) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{q}\n{instruction}"}],
                                           add_generation_prompt=True, tokenize=False) for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_calibration_prompts_are_the_data_sections_first_training_prompts(tokenizer):
    data = {"seed": 5, "shuffle_buffer": 0, "answer_format": "boxed", "instruction": "Box it."}
    prompts = calibration_prompts(data, tokenizer, 7)
    questions = [row["question"] for row in itertools.islice(ArithmeticSource(seed=5), 7)]  # the default source
    assert prompts == reference_ids(tokenizer, questions, "Box it.")


def test_a_finite_source_gives_its_rows_once(tokenizer):
    data = {"shuffle_buffer": 0, "instruction": "Go.",
            "sources": [{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"seed": 2, "num_rows": 3}}]}
    questions = [row["question"] for row in ArithmeticSource(seed=2, num_rows=3)]
    assert calibration_prompts(data, tokenizer, 10) == reference_ids(tokenizer, questions, "Go.")


def test_data_sections_of_several_configs_merge_like_repeated_config_flags(tmp_path):
    (tmp_path / "a.yaml").write_text("data:\n  seed: 1\n  batch_size: 4\nmodel:\n  optimizer:\n    lr: 1.0\n")
    (tmp_path / "b.yaml").write_text("data:\n  seed: 2\n")
    assert read_data_section([tmp_path / "a.yaml", tmp_path / "b.yaml"]) == {"seed": 2, "batch_size": 4}
    with pytest.raises(FileNotFoundError, match="--calibration"):
        read_data_section([tmp_path / "missing.yaml"])


def scales(**groups) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, values in groups.items():
        for leaf, value in values.items():
            out[f"model.layers.{prefix}.{leaf}.weight_global_scale"] = torch.tensor([value])
            out[f"model.layers.{prefix}.{leaf}.weight_packed"] = torch.zeros(1, dtype=torch.uint8)
    return out


def test_unshared_global_scales_names_each_fused_group_that_differs():
    ok = scales(**{"0.self_attn": dict(q_proj=2.0, k_proj=2.0, v_proj=2.0, o_proj=5.0),
                   "0.mlp": dict(gate_proj=3.0, up_proj=3.0, down_proj=7.0)})
    assert unshared_global_scales(ok) == []
    bad = {**ok, **scales(**{"1.self_attn": dict(q_proj=2.0, k_proj=2.0, v_proj=2.5),
                             "1.mlp": dict(gate_proj=3.0, up_proj=3.5)})}
    assert unshared_global_scales(bad) == ["model.layers.1.mlp", "model.layers.1.self_attn"]


def test_rtn_refuses_calibration_and_calibrated_methods_need_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--output", "o", "--calibration", "configs/smoke.yaml"])
    assert exit_.value.code == 2 and "--calibration is for --method gptq or awq" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--output", "o", "--method", "gptq"])
    assert exit_.value.code == 2 and "pass --calibration" in capsys.readouterr().err


@pytest.mark.skipif(HAS_LLMCOMPRESSOR, reason="llmcompressor is installed here")
def test_calibrated_method_without_llmcompressor_is_one_error_naming_the_extra(capsys, tmp_path):
    status = main(["--model", "no-such-model", "--output", str(tmp_path / "o"), "--method", "gptq",
                   "--calibration", str(ROOT / "configs" / "smoke.yaml")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert 'qerl[llmcompressor]' in err and "own environment" in err
