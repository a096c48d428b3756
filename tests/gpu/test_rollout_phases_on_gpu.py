"""The e2e benchmark's rollout breakdown (bench/rollout_phases.py) on a GPU (``pytest -m gpu``): its CUDA events sum
to the call's time, a step that captures a graph counts once (under the capture), the steps fall in the buckets the
drawn lengths imply, and recording changes nothing the rollout samples."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]

from forced_lengths import ForcedLengthRollout  # noqa: E402
from rollout_phases import TimedForcedLengthRollout  # noqa: E402
from test_rollout_phases import expected_schedule  # noqa: E402

from qerl.model.routing import RoutingRecorder  # noqa: E402
from qerl.rollout.sampling_spec import SamplingSpec  # noqa: E402
from qerl.testing.random_models import build_random_policy, model_config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


WIDTHS = {"qwen2.5-7b": dict(intermediate_size=512), "qwen3-30b-a3b": dict(moe_intermediate_size=128)}


@pytest.fixture(scope="module", params=list(WIDTHS))
def policy(request):
    """A dense and a MoE shape cut to 2 layers of width 256: the fused dense step, and the fused MoE step recording
    its expert choices as in the e2e benchmark."""
    config = model_config(request.param, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, **WIDTHS[request.param])
    return build_random_policy(config, "nvfp4", lora_rank=8, lora_b_std=0.02)


def test_the_gpu_breakdown_sums_to_the_call_counts_captures_once_and_samples_the_same(policy):
    prompts = [[5, 9, 11, 3], [12, 13], [20, 21, 22], [7, 8]]
    options = dict(length_median=24, length_sigma=0.8, check_every=4, length_bucket=16)
    spec = SamplingSpec(max_new_tokens=96, temperature=1.0, seed=3, stream="separate")
    timed, plain = TimedForcedLengthRollout(**options), ForcedLengthRollout(**options)
    moe = getattr(policy.get_base_model().config, "num_experts", 0)
    for call in range(2):
        routing = RoutingRecorder() if moe else None
        if routing is None:
            r = timed.generate(policy, prompts, 4, 0, [1], spec)
        else:
            with routing.recording(policy):
                r = timed.generate(policy, prompts, 4, 0, [1], spec, routing=routing)
        assert "error" not in timed.phase_records[-1]
        record = timed.phase_records[-1]
        assert sum(record["parts"].values()) == pytest.approx(record["total_s"], rel=1e-9)
        assert record["total_s"] <= record["wall_s"] + 1e-3  # the events lie inside the host's timing
        assert all(v >= 0 for v in record["parts"].values())
        cells, checks, compactions = expected_schedule(r.lengths.tolist(), 4, 96, 4, 16)
        seen = Counter({(c["batch"], c["length"]): c["steps"] for c in record["cells"]})
        assert sum(b["capture_steps"] for b in record["buckets"]) == record["captures"]
        assert record["decode_steps"] == sum(cells.values())  # a captured step once: under its capture
        assert set(seen) <= set(cells) and all(seen[k] <= cells[k] for k in seen)
        assert (record["checks"] + record["compactions"], record["compactions"]) == (checks, compactions)
        graphs = record["graphs"]
        assert graphs["captures"] == record["captures"] and graphs["at_first_prefill"] <= timed.graphs_captured
        if call == 0:
            assert record["captures"] > 0 and record["parts"]["captures"] > 0 and graphs["at_start"] == 0
        expected = plain.generate(policy, prompts, 4, 0, [1], spec)
        assert torch.equal(r.completion_ids, expected.completion_ids)
