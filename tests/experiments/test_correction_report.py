"""correction_report.py on hand-made experiment JSONs: the decision rule of issue 51 (written before the runs) as the
script applies it: a candidate replaces token TIS only with a paired difference whose 95% interval is above 0."""

from __future__ import annotations

import json

import pytest

from .conftest import load_script

report = load_script("correction_report")
STEPS = list(range(1, 11))


def seed_entry(seed: int, final: float, masked: float) -> dict:
    return {"seed": seed, "steps": STEPS, "reward": [0.1 + final * s / 10 for s in STEPS],
            "rollout_entropy": [2.0 - 0.05 * s for s in STEPS], "train_entropy": [2.1 - 0.05 * s for s in STEPS],
            "heldout": {"steps": [0, 5, 10], "expressions_acc_flexible": [0.05, final / 2, final],
                        "expressions_acc": [0.0, final / 3, final / 2]},
            "sampling_logp_diff_mean": [0.05] * 10, "sampling_logp_diff_max": [3.0] * 10,
            "is_raw_ratio_mean": [1.01] * 10, "is_masked_frac": [masked] * 10, "is_masked_seq_frac": [masked] * 10}


def experiment(finals: dict[str, list[float]], masked: dict[str, float] | None = None) -> dict:
    masked = masked or {}
    return {"arms": {arm: {"quantization": "nvfp4", "aqn": True, "lr": 2e-4,
                           "seeds": [seed_entry(s, f, masked.get(arm, 0.0)) for s, f in enumerate(values)]}
                     for arm, values in finals.items()},
            "base": {}, "steps": 10, "complete": True, "config": {"settings": {"aqn": {"num_stages": 10}}}}


TOKEN_TIS = [0.50, 0.55, 0.60, 0.52, 0.58]


def test_a_candidate_better_on_every_seed_becomes_the_default():
    data = experiment({"nvfp4_aqn": TOKEN_TIS,
                       "nvfp4_aqn_sequence_mask": [f + d for f, d in zip(TOKEN_TIS, (0.02, -0.03, 0.01, 0.0, -0.01))],
                       "nvfp4_aqn_icepop": [f + d for f, d in zip(TOKEN_TIS, (0.05, 0.06, 0.04, 0.05, 0.07))]})
    decision = report.decide(data)
    assert decision["choice"] == "nvfp4_aqn_icepop"
    assert decision["rows"]["nvfp4_aqn_icepop"]["difference"].mean == pytest.approx(0.054)
    assert "the default becomes `token_mask [0.5, 5] (IcePop)`" in report.render(decision)


def test_a_difference_within_noise_keeps_the_default_and_heavy_masking_is_named(tmp_path):
    data = experiment({"nvfp4_aqn": TOKEN_TIS,
                       "nvfp4_aqn_sequence_mask": [f + d for f, d in zip(TOKEN_TIS, (0.10, -0.08, 0.09, -0.07, 0.02))],
                       "nvfp4_aqn_icepop": TOKEN_TIS}, masked={"nvfp4_aqn_sequence_mask": 0.8})
    path = tmp_path / "correction.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "correction.md"
    decision = report.main([str(path), "--out", str(out)])
    assert decision["choice"] is None and decision["minority"] == ["nvfp4_aqn_sequence_mask"]
    text = out.read_text()
    assert "the default stays token-level truncated IS" in text and "| nvfp4_aqn_sequence_mask |" in text
    assert "0.8000" in text  # its mean fraction of tokens masked, beside the score
