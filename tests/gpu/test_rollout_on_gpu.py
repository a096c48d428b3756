"""The CUDA-graph engine on a GPU (``pytest -m gpu``; skipped without CUDA): captured steps sample what eager steps
sample, the log-probs returned are those of one full forward of the policy, LoRA updates and AQN noise reach the
captured graphs without a recapture, and the noise is removed exactly afterwards.

The policy is a random-init Qwen2.5-shaped model, small enough for seconds per test, NVFP4 + LoRA in bf16: the fused
decoder's Triton kernels and the NVFP4 GEMV run as in a real rollout.
"""

from dataclasses import replace

import pytest
import torch

from qerl.model.aqn import rms_norms
from qerl.kernels import pdl
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.comparison_rollout import ComparisonRollout
from qerl.testing.random_models import build_random_policy, qwen25_config
from qerl.testing.rollouts import recompute

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# bf16 model: the fused step and the transformers forward round alike except for the order of fp32 sums
LOGPROB_ATOL = 0.03


@pytest.fixture(scope="module")
def policy():
    config = qwen25_config("qwen2.5-7b", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return build_random_policy(config, "nvfp4", lora_rank=8, lora_b_std=0.02)


def eager_engine(**options) -> CUDAGraphRollout:
    return ComparisonRollout(use_graphs=False, **options)  # the same steps, not captured


def max_logprob_error(policy, rollout) -> float:
    return float((rollout.logprobs - recompute(policy, rollout)[0]).abs().max())


def test_graph_replay_samples_the_eager_tokens(policy, prompts):
    graphs = CUDAGraphRollout(check_every=4)
    spec = SamplingSpec(max_new_tokens=24, seed=0, stream="separate")
    a = graphs.generate(policy, prompts, 4, 0, [], spec)
    e = eager_engine(check_every=4).generate(policy, prompts, 4, 0, [], spec)
    assert graphs.graphs_captured >= 1
    assert torch.equal(a.completion_ids, e.completion_ids)
    torch.testing.assert_close(a.logprobs, e.logprobs, atol=1e-5, rtol=0)
    again = graphs.generate(policy, prompts, 4, 0, [], spec)
    assert torch.equal(a.completion_ids, again.completion_ids) and torch.equal(a.logprobs, again.logprobs)


@pytest.mark.parametrize("wgmma", [None, False], ids=["default-gemv", "mma-sync-gemv"])
def test_logprobs_equal_a_full_recomputation(policy, prompts, wgmma):
    engine = ComparisonRollout(check_every=4, wgmma=wgmma)  # False: other GPUs' loop
    spec = SamplingSpec(max_new_tokens=24, seed=0, stream="separate")
    assert max_logprob_error(policy, engine.generate(policy, prompts, 4, 0, [], spec)) < LOGPROB_ATOL
    # prompts of 175 tokens in all: the fused prefill's GEMMs above 128 rows (each group dequantized into one stack)
    gen = torch.Generator().manual_seed(1)
    long = [[int(x) for x in torch.randint(0, 512, (n,), generator=gen)] for n in (60, 70, 45)]
    r = CUDAGraphRollout().generate(policy, long, 2, 0, [], SamplingSpec(max_new_tokens=16, seed=0))
    assert max_logprob_error(policy, r) < LOGPROB_ATOL


def test_fp8_kv_cache_rollout_is_the_policy_over_an_e4m3_cache(policy, prompts):
    """kv_cache_dtype fp8_e4m3 under graphs, waves of 64 and 96 rows (the bf16 copy above 64): the log-probs are those
    of a full forward whose attention reads the e4m3-rounded K/V; the unrounded policy's are further away."""
    for group in (4, 32):
        engine = CUDAGraphRollout(check_every=4, kv_cache_dtype="fp8_e4m3", wide_batch_bf16=True)
        spec = SamplingSpec(max_new_tokens=24, seed=0, stream="separate")
        r = engine.generate(policy, prompts, group, 0, [], spec)
        assert engine._state.cache.dtype == torch.float8_e4m3fn and engine.graphs_captured >= 1
        m = r.completion_mask.bool()
        err = (r.logprobs - recompute(policy, r, kv_cache_dtype=torch.float8_e4m3fn)[0]).abs()[m]
        gap = (r.logprobs - recompute(policy, r)[0]).abs()[m]
        assert float(err.max()) < LOGPROB_ATOL and err.mean() < gap.mean()


def test_compaction_keeps_logprobs_exact(policy, prompts):
    engine = CUDAGraphRollout(check_every=2)
    spec = SamplingSpec(max_new_tokens=64, seed=1, stream="separate")
    r = engine.generate(policy, prompts, 8, 0, list(range(100, 108)), spec)  # many EOS ids: rows finish early
    assert len({k[0] for k in engine._graph_cache.graphs}) > 1  # decoded in more than one batch bucket
    assert int(r.lengths.min()) < 64
    assert max_logprob_error(policy, r) < LOGPROB_ATOL


def test_wide_batches_on_the_bf16_copy_and_after_it_moved(policy, prompts):
    engine = CUDAGraphRollout(check_every=4, wide_batch_bf16=True)
    spec = SamplingSpec(max_new_tokens=24, seed=0, stream="separate")
    r = engine.generate(policy, prompts, 32, 0, [], spec)  # 96 rows: the steps above 64 rows use the rollout's bf16 copy
    assert max_logprob_error(policy, r) < LOGPROB_ATOL
    gemms = [g.gemm for layer in engine._decoder[1].layers for g in layer.groups()]
    assert all(g._dequantized is None for g in gemms)  # released after the rollout
    # the next rollout's copy lands elsewhere (what an update's allocations do): its graphs are recaptured, the stale
    # ones (all of them: 96 rows never compact below 64) freed
    junk = [torch.empty(g.dequantized_bytes(torch.bfloat16), dtype=torch.uint8, device="cuda") for g in gemms]
    before = engine.graphs_captured
    r2 = engine.generate(policy, prompts, 32, 0, [], spec)
    del junk
    assert engine.graphs_captured > before and len(engine._graph_cache.graphs) == engine.graphs_captured - before
    assert max_logprob_error(policy, r2) < LOGPROB_ATOL


def test_wide_steps_take_the_lora_a_product_from_the_dense_copy(policy, prompts):
    """Above 64 rows a group's bf16 copy holds its LoRA-A rows under the weights: one GEMM gives the base outputs and
    ``x @ A.T``, as the two products apart (bf16 roundings of another cuBLAS kernel)."""
    engine = CUDAGraphRollout(check_every=4, wide_batch_bf16=True)
    engine.generate(policy, prompts, 32, 0, [], SamplingSpec(max_new_tokens=4, seed=0))
    decoder = engine._decoder[1]
    decoder.prepare(torch.bfloat16, dequantize=True, rows=96)
    groups = [g for layer in decoder.layers for g in layer.groups() if g.gemm._dequantized is not None]
    try:
        assert groups and all(g.adapter for g in groups)  # (groups the wgmma GEMV serves faster keep no copy)
        for g in groups:
            x = torch.randn(96, g.gemm.layers[0].in_features, device="cuda").to(torch.bfloat16)
            assert g.gemm.with_lora_rows(x, g.a) is not None
            outs, u = g.project(x)
            assert u.untyped_storage().data_ptr() == outs[0].untyped_storage().data_ptr()  # one GEMM's output
            torch.testing.assert_close(u[0].float(), (x.float() @ g.a.float().t()), rtol=2e-2, atol=2e-2)
            for y, apart in zip(outs, g.gemm(x)):
                torch.testing.assert_close(y.float(), apart.float(), rtol=2e-2, atol=2e-2)
    finally:
        decoder.release()
    assert all(g.gemm.with_lora_rows(torch.zeros(96, g.gemm.layers[0].in_features, device="cuda",
                                                 dtype=torch.bfloat16), g.a) is None for g in groups)


def test_lora_updates_and_aqn_noise_reach_the_captured_graphs(policy, prompts):
    engine = CUDAGraphRollout(check_every=4)
    spec = SamplingSpec(max_new_tokens=24, seed=0, stream="separate")
    a = engine.generate(policy, prompts, 4, 0, [], spec)
    captured = engine.graphs_captured
    lora_b = next(p for n, p in policy.named_parameters() if "lora_B" in n)
    trained = lora_b.detach().clone()
    with torch.no_grad():
        lora_b.add_(0.5)  # what an optimizer step does: same storage
    d = engine.generate(policy, prompts, 4, 0, [], spec)
    with torch.no_grad():
        lora_b.copy_(trained)
    assert not torch.equal(a.logprobs, d.logprobs)
    clean = [m.weight.detach().clone() for m in rms_norms(policy)]
    noisy_spec = replace(spec, noise_sigma=0.1, noise_generator=torch.Generator().manual_seed(0))
    noisy = engine.generate(policy, prompts, 4, 0, [], noisy_spec)
    assert not torch.equal(a.logprobs, noisy.logprobs)  # applied inside the replayed graphs
    assert all(torch.equal(m.weight, w) for m, w in zip(rms_norms(policy), clean))  # and removed exactly
    assert engine.graphs_captured == captured  # neither needed a new capture
    b = engine.generate(policy, prompts, 4, 0, [], spec)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.skipif(not (torch.cuda.is_available() and pdl.supported("cuda")), reason="needs PDL (sm_90+)")
def test_a_fresh_policys_second_rollout_captures_nothing(prompts):
    # the first rollout on a fresh model builds the GEMV's repacked copies (the compressed tensors move to host
    # memory): the engine's state must be keyed on where they are after that, or the second rollout recaptures all
    config = qwen25_config("qwen2.5-7b", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    fresh = build_random_policy(config, "nvfp4", lora_rank=8, lora_b_std=0.02)
    engine = CUDAGraphRollout(check_every=4)
    spec = SamplingSpec(max_new_tokens=24, seed=0, stream="separate")
    first = engine.generate(fresh, prompts, 4, 0, [], spec)
    captured = engine.graphs_captured
    assert captured >= 1
    second = engine.generate(fresh, prompts, 4, 0, [], spec)
    assert engine.graphs_captured == captured
    assert torch.equal(first.completion_ids, second.completion_ids)


def test_pdl_changes_when_kernels_start_never_what_they_compute(policy, prompts):
    runs = {}
    for on in (False, True):
        engine = ComparisonRollout(check_every=4, pdl=on)  # the comparison switch
        spec = SamplingSpec(max_new_tokens=40, seed=2, stream="separate")
        runs[on] = engine.generate(policy, prompts, 8, 0, list(range(100, 104)), spec)
    assert torch.equal(runs[True].completion_ids, runs[False].completion_ids)
    assert torch.equal(runs[True].logprobs, runs[False].logprobs)


def test_row_noise_kernel_draws_the_torch_reference():
    from qerl.rollout.row_noise import exponentials_torch, row_exponentials, row_seeds

    key = torch.tensor([7, 2**32 - 3], device="cuda")
    rows, step = torch.arange(5, 70, device="cuda"), torch.tensor([41], device="cuda")
    triton_e = row_exponentials(key, rows, step, 50_001)
    torch_e = exponentials_torch(row_seeds(key, rows, step), 50_001)
    torch.testing.assert_close(triton_e, torch_e, rtol=1e-6, atol=0)  # same integers; logs within a few ulps
    torch.testing.assert_close(row_exponentials(key.cpu(), rows.cpu(), step.cpu(), 50_001), torch_e.cpu(), rtol=1e-6,
                               atol=0)  # the CPU's log rounds like the GPU's within an ulp


def test_waves_and_a_released_cache_keep_the_samples_under_graphs(policy, prompts):
    """Waves of two groups sample like one wave: the same noise per row (bf16 sums differ with the batch shape, so a
    near tie may flip a token and the rest of its row: most rows, not all, are equal); a released cache comes back
    and the same engine repeats itself exactly."""
    one = CUDAGraphRollout(check_every=4, keep_kv_cache=True)
    waves = CUDAGraphRollout(check_every=2, wave_rows=8, keep_kv_cache=False)
    eos = list(range(100, 108))
    spec = SamplingSpec(max_new_tokens=40, seed=5, stream="separate")
    a, b = one.generate(policy, prompts, 4, 0, eos, spec), waves.generate(policy, prompts, 4, 0, eos, spec)
    assert waves._state.cache.storage is None and waves._state.rows == 8
    first = (a.completion_ids[:, :8] == b.completion_ids[:, :8]).all(-1)
    assert int(first.sum()) >= 9, first  # 12 rows; keyed by slot instead of row, about none would agree
    assert max_logprob_error(policy, b) < LOGPROB_ATOL
    again = waves.generate(policy, prompts, 4, 0, eos, spec)  # the cache allocated again; graphs recaptured if it moved
    assert torch.equal(again.completion_ids, b.completion_ids) and torch.equal(again.logprobs, b.logprobs)


def test_evaluation_blocks_on_a_fresh_engine_capture_again(policy, prompts):
    """Validation without training: each batch samples greedily from a separate stream on an engine that has no
    training stream yet; the graphs (which never read the generator) are kept and replayed, not captured into a
    pool whose graphs were dropped."""
    engine = CUDAGraphRollout()
    results = []
    for _ in range(2):
        spec = SamplingSpec(max_new_tokens=12, greedy=True, seed=0, stream="separate")
        results.append(engine.generate(policy, prompts, 1, 0, [], spec))
    assert torch.equal(results[0].completion_ids, results[1].completion_ids)
    assert engine.graphs_captured >= 1 and len(engine._graph_cache.graphs) == engine.graphs_captured


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (128, 152064), (300, 1000)])
def test_fused_draw_matches_the_torch_expression_and_replays_from_a_graph(rows, vocab):
    from qerl.rollout.row_noise import row_exponentials
    from qerl.rollout.sampling import sample_fused, sample_gumbel

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16)
    key, step = torch.tensor([1, 2**31 + 5], device="cuda"), torch.tensor([3], device="cuda")
    ids = torch.arange(rows, device="cuda") + 7
    ref = sample_gumbel(logits, 0.9, 1.0, row_exponentials(key, ids, step, vocab))
    got = sample_fused(logits, 0.9, key, ids, step)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=5e-5)
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=5e-5)
    greedy = sample_fused(logits, 0.9, None, ids, step)
    top = logits == logits.max(-1, keepdim=True).values  # bf16: ties at the top happen; the lowest id wins
    assert torch.equal(greedy[0], torch.where(top, torch.arange(vocab, device="cuda"), vocab).min(-1).values)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = sample_fused(logits, 0.9, key, ids, step)
    step += 1  # the graph reads the step at replay: the next step's draw
    graph.replay()
    nxt = sample_gumbel(logits, 0.9, 1.0, row_exponentials(key, ids, step, vocab))
    assert torch.equal(out[0], nxt[0])
    assert rows == 1 or not torch.equal(out[0], ref[0])  # (one peaked row may well draw the same token again)
