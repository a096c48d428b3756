"""CPU checks of the graph engine's device-independent logic (the same step function runs eagerly on CPU)."""

import dataclasses
from dataclasses import replace

import pytest
import torch

from qerl.model.aqn import rms_norms
from qerl.model.policy import build_policy
from qerl.testing.rollouts import recompute
from qerl.testing.tiny_models import save_tiny_model
from qerl.rollout.builtin import position_ids
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.graph_cache import GraphCache, GraphKey
from qerl.testing.comparison_rollout import ComparisonRollout
from qerl.rollout.kv_cache import check_kv_cache_fits, kv_cache_bytes
from qerl.rollout.sampling_spec import SamplingSpec

PAD, EOS = 0, 7


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "llama3", "qwen3_moe"])
def policy(request, tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param, vocab_size=64, hidden_size=64)
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32")
    with torch.no_grad():  # non-zero LoRA B so the adapter changes the outputs
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(hash(name) % 1000))
    return policy


PROMPTS = [[5, 9, 11, 3, 4], [12, 13], [20, 21, 22]]


@pytest.fixture(params=[False, True], ids=["transformers-step", "fused-step"])
def fused(request):
    """Both decode steps: the transformers forward, and qerl's FusedDecoder (its torch twins on CPU)."""
    return request.param


def used_decoder(engine) -> bool:
    return engine._decoder is not None and engine._decoder[1] is not None and engine._state.decoder is not None


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_logprobs_equal_full_forward_recomputation(policy, top_p, fused):
    engine = CUDAGraphRollout(check_every=3, fused=fused)
    spec = SamplingSpec(max_new_tokens=12, temperature=0.7, top_p=top_p, seed=1, stream="separate")
    r = engine.generate(policy, PROMPTS, group_size=4, pad_id=PAD, eos_ids=[EOS, 9], spec=spec)
    assert used_decoder(engine) == fused
    assert r.completion_ids.shape == r.logprobs.shape == r.entropy.shape and r.prompt_ids.shape[0] == 12
    lp, entropy = recompute(policy, r, 0.7)
    if top_p == 1.0:
        torch.testing.assert_close(r.logprobs, lp, atol=2e-5, rtol=0)
        torch.testing.assert_close(r.entropy, entropy, atol=2e-5, rtol=0)
    else:  # nucleus: the kept tokens' log-probs are renormalised, never below the full distribution's
        assert (r.logprobs >= lp - 1e-5).all()
    # mask runs up to and including the first EOS; truncated rows have none
    is_eos = torch.isin(r.completion_ids, torch.tensor([EOS, 9])) & r.completion_mask.bool()
    assert (is_eos.sum(-1) <= 1).all()
    assert torch.equal(r.truncated, ~is_eos.any(-1))
    for row in range(12):
        n = int(r.lengths[row])
        assert r.completion_mask[row, :n].all() and not r.completion_mask[row, n:].any()
        assert r.truncated[row] or r.completion_ids[row, n - 1] in (EOS, 9)
        assert (r.completion_ids[row, n:] == PAD).all() and (r.logprobs[row, n:] == 0).all()


def test_compaction_and_early_stop_keep_rows_exact(policy, fused, monkeypatch):
    """Many EOS ids finish rows early: the batch shrinks into smaller buckets and stops before max_new_tokens."""
    from qerl.rollout.decode_state import DecodeState

    eos = list(range(40, 48))
    engine = CUDAGraphRollout(check_every=2, fused=fused)
    calls = []
    original = DecodeState.compact
    monkeypatch.setattr(DecodeState, "compact", lambda s, b, written: (calls.append(b), original(s, b, written))[1])
    spec = SamplingSpec(max_new_tokens=40, temperature=1.0, seed=3, stream="separate")
    r = engine.generate(policy, PROMPTS, group_size=5, pad_id=PAD, eos_ids=eos, spec=spec)
    assert calls, "no compaction happened"
    assert r.completion_ids.shape[1] == int(r.lengths.max())
    lp, entropy = recompute(policy, r, 1.0)
    torch.testing.assert_close(r.logprobs, lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.entropy, entropy, atol=2e-5, rtol=0)


def test_state_is_reused_and_lora_change_is_live(policy, fused):
    engine = CUDAGraphRollout(fused=fused)
    spec = SamplingSpec(max_new_tokens=6, seed=0, stream="separate")
    a = engine.generate(policy, PROMPTS, 2, PAD, [], spec)
    state = engine._state
    b = engine.generate(policy, PROMPTS[:2], 2, PAD, [], spec)  # smaller request: same buffers
    assert engine._state is state and a.truncated.all() and a.completion_ids.shape[1] == 6
    c = engine.generate(policy, PROMPTS, 2, PAD, [], spec)
    assert torch.equal(a.completion_ids, c.completion_ids) and torch.equal(a.logprobs, c.logprobs)
    lora_b = next(p for n, p in policy.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.add_(0.5)  # what an optimizer step does: same storage
    d = engine.generate(policy, PROMPTS, 2, PAD, [], spec)
    with torch.no_grad():
        lora_b.sub_(0.5)
    assert engine._state is state
    assert not torch.allclose(a.logprobs, d.logprobs)


def test_kv_cache_size_is_known_before_allocation_and_refused_when_too_big(policy):
    engine = CUDAGraphRollout()
    spec = SamplingSpec(max_new_tokens=6, seed=0, stream="separate")
    engine.generate(policy, PROMPTS, 2, PAD, [], spec)
    s, base = engine._state, policy.get_base_model()
    cache = s.cache
    allocated = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
    dtype = base.get_input_embeddings().weight.dtype
    assert kv_cache_bytes(base.config, s.rows, s.length, dtype) == allocated
    check_kv_cache_fits(allocated, allocated, s.rows, s.length, "cuda:0")  # exactly fits
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"max_new_tokens.*BuiltinRollout"):
        check_kv_cache_fits(80 * 2**30, 17 * 2**30, 256, 1280, "cuda:0")


def test_noise_applied_for_rollout_and_removed_exactly(policy, fused):
    clean = [m.weight.detach().clone() for m in rms_norms(policy)]
    engine = CUDAGraphRollout(fused=fused)
    spec = SamplingSpec(max_new_tokens=5, seed=0, stream="separate")
    a = engine.generate(policy, PROMPTS, 2, PAD, [], spec)
    noisy = replace(spec, noise_sigma=0.5, noise_generator=torch.Generator().manual_seed(0))
    b = engine.generate(policy, PROMPTS, 2, PAD, [], noisy)
    assert not torch.allclose(a.logprobs, b.logprobs)
    for m, w in zip(rms_norms(policy), clean):
        assert torch.equal(m.weight, w)


def test_random_nvfp4_builder_makes_a_working_policy():
    from qerl.nvfp4.linear import NVFP4Linear
    from qerl.testing.random_models import build_random_policy, qwen25_config

    config = qwen25_config("qwen2.5-7b", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    policy = build_random_policy(config, "nvfp4", lora_rank=4, device="cpu", kernel="torch")
    assert sum(isinstance(m, NVFP4Linear) for m in policy.modules()) == 14
    assert not any(p.device.type == "meta" for p in policy.parameters())
    r = CUDAGraphRollout().generate(policy, PROMPTS, 2, PAD, [], SamplingSpec(max_new_tokens=4))
    assert r.completion_ids.shape == (6, 4) and torch.isfinite(r.logprobs).all()


def grad_accumulator(p: torch.Tensor):
    """The autograd node that accumulates ``p``'s gradient (DDP hangs its all-reduce hooks there)."""
    return p.view_as(p).grad_fn.next_functions[0][0]


def test_fp32_adapter_runs_in_model_dtype_and_is_restored(tmp_path):
    """The rollout runs bf16 copies of the fp32 adapter and leaves the parameters as they were: the same storage, dtype
    and gradient accumulator (a dtype change through ``.data`` drops it: DDP's hooks would never fire again)."""
    path = save_tiny_model(tmp_path / "m", "qwen2", vocab_size=64, hidden_size=64)
    policy = build_policy(str(path), quantization="bf16", lora_rank=4, dtype="bfloat16")
    lora = [p for n, p in policy.named_parameters() if "lora_" in n]
    with torch.no_grad():
        for p in lora:
            p.data = p.data.float()  # peft's usual fp32 adapter on a bf16 model
            p.normal_(std=0.05)
    before = [(p.data_ptr(), p.dtype) for p in lora]
    accumulators = [grad_accumulator(p) for p in lora]
    engine = CUDAGraphRollout()
    spec = SamplingSpec(max_new_tokens=4, stream="separate")
    r = engine.generate(policy, PROMPTS, 2, PAD, [], spec)
    assert [(p.data_ptr(), p.dtype) for p in lora] == before and torch.isfinite(r.logprobs).all()
    assert all(grad_accumulator(p) is a for p, a in zip(lora, accumulators))
    assert all(p in set(policy.parameters()) for p in lora)  # the modules hold the parameters again
    shadows = engine._adapters.shadows
    assert all(copy.dtype == torch.bfloat16 for _, _, copy in shadows.values()) and len(shadows) == len(lora)
    # The next rollout reuses the copies (refreshed from the changed adapter) and again leaves the parameters alone.
    copies = [copy for _, _, copy in engine._adapters.shadows.values()]
    with torch.no_grad():
        lora[-1].add_(0.5)
    again = engine.generate(policy, PROMPTS, 2, PAD, [], spec)
    assert all(a is b for a, b in zip([copy for _, _, copy in engine._adapters.shadows.values()], copies))
    assert torch.equal(copies[-1], lora[-1].detach().to(torch.bfloat16))  # the copy follows the trained weight
    assert all(grad_accumulator(p) is a for p, a in zip(lora, accumulators)) and not torch.equal(again.logprobs, r.logprobs)


def test_fused_step_follows_the_adapter_state(policy):
    """With the adapter disabled (peft's context) the fused step samples the base model: LoRA off, original norms."""
    engine = CUDAGraphRollout(fused=True)
    spec = SamplingSpec(max_new_tokens=8, temperature=0.7, seed=3, stream="separate")
    with_adapter = engine.generate(policy, PROMPTS, group_size=2, pad_id=PAD, eos_ids=[], spec=spec)
    key = engine._state.decoder.key()
    with policy.disable_adapter():
        r = engine.generate(policy, PROMPTS, group_size=2, pad_id=PAD, eos_ids=[], spec=spec)
        lp, entropy = recompute(policy, r, 0.7)
    assert used_decoder(engine) and engine._state.decoder.key() != key
    torch.testing.assert_close(r.logprobs, lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.entropy, entropy, atol=2e-5, rtol=0)
    assert not torch.allclose(with_adapter.logprobs, r.logprobs)


def test_pdl_is_off_where_unsupported_and_refused_when_forced(policy):
    from qerl.kernels import pdl

    assert not pdl.supported("cpu") and pdl.options(False) == {} and pdl.options(True) == {"launch_pdl": True}
    base = policy.get_base_model()
    assert CUDAGraphRollout(fused=True)._fused_decoder(base, torch.device("cpu")).pdl is False  # auto: off on CPU
    forced = ComparisonRollout(fused=True, pdl=True)  # the benchmarks' comparison switch
    with pytest.raises(ValueError, match="compute capability >= 9.0"):
        forced._fused_decoder(base, torch.device("cpu"))


def test_wgmma_gemv_is_refused_where_unsupported_and_keys_the_graphs(policy):
    from qerl.nvfp4.kernels import gemv_layout, gemv_plan

    assert not gemv_plan.wgmma_supported(torch.device("cpu"))
    base = policy.get_base_model()
    forced, off_engine = ComparisonRollout(fused=True, wgmma=True), ComparisonRollout(fused=True, wgmma=False)
    with pytest.raises(ValueError, match="sm_90 GPU"):
        forced._fused_decoder(base, torch.device("cpu"))
    auto = CUDAGraphRollout(fused=True)._fused_decoder(base, torch.device("cpu"))
    off = off_engine._fused_decoder(base, torch.device("cpu"))
    assert auto.wgmma is None and off.wgmma is False
    assert all(g.gemm.wgmma is False for lyr in off.layers for g in lyr.groups())
    auto.prepare(torch.float32)
    off.prepare(torch.float32)
    assert auto.key(1) != off.key(1)  # graphs captured with one GEMV loop never replay for the other


def test_wide_batch_copy_is_asked_for_only_above_the_gemv_and_stale_graphs_go(policy):
    """The bf16 copy is for rollouts of more than 64 rows on CUDA (never on CPU or when turned off); graphs keyed on
    an older layout of what their step reads are dropped, the wide steps' keys carry the copy, the others not."""
    from qerl.nvfp4.kernels import gemv_layout, gemv_plan
    from qerl.rollout.footprint import wants_bf16_copy

    gib = 1 << 30
    assert wants_bf16_copy(None, 65, 13 * gib, 16 * gib) and not wants_bf16_copy(None, 64, 13 * gib, 80 * gib)
    assert not wants_bf16_copy(None, 128, 13 * gib, 14 * gib)  # fits, but not with 2 GiB to spare
    assert wants_bf16_copy(True, 128, 13 * gib, 1 * gib) and not wants_bf16_copy(False, 128, 13 * gib, 80 * gib)
    assert not wants_bf16_copy(True, 128, 0, 80 * gib) and not wants_bf16_copy(True, 128, 13 * gib, None)  # bf16 / CPU
    engine = CUDAGraphRollout(fused=True)
    spec = SamplingSpec(max_new_tokens=4, stream="separate")
    engine.generate(policy, PROMPTS, group_size=2, pad_id=PAD, eos_ids=[], spec=spec)
    decoder = engine._state.decoder
    assert not engine._wide_batch_bf16(decoder, 200, torch.bfloat16, torch.device("cpu"))
    narrow = decoder.key(1)
    assert decoder.key(gemv_plan.MAX_M) == narrow and decoder.key(gemv_plan.MAX_M + 1)[: len(narrow)] == narrow
    current, old = decoder.key(1), decoder.key(1) + ("an earlier layout",)
    graphs = {GraphKey(2, 256, 1.0, False, feeding, layout): f"{name} {feeding}" for feeding in (False, True)
              for name, layout in (("kept", current), ("stale", old), ("hf", None))}
    cache = GraphCache()
    cache.graphs.update(graphs)
    cache.drop_stale(decoder.key)  # an episode call's graphs (feeding) as a single-turn call's
    assert sorted(cache.graphs.values()) == ["hf False", "hf True", "kept False", "kept True"]


def test_unsupported_model_falls_back_with_a_warning(policy):
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels, Unsupported

    base = policy.get_base_model()
    old = base.config.hidden_act
    base.config.hidden_act = "gelu"
    try:
        with pytest.raises(Unsupported, match="hidden_act"):
            FusedDecoder(base, Kernels(fast=False))
        engine = CUDAGraphRollout(fused=True)
        with pytest.warns(UserWarning, match="fused decoding off"):
            engine._fused_decoder(base, torch.device("cpu"))
    finally:
        base.config.hidden_act = old


def test_dense_groups_are_laid_out_by_the_loader_and_the_decoder_moves_no_weight(tmp_path):
    """The loader lays frozen bf16 q|k|v and gate|up weights out in one buffer each (modules keep views: no extra
    memory, same outputs); the decoder multiplies a group with one GEMM on that buffer and re-points no parameter.
    A model laid out otherwise keeps its weights where they are and is multiplied module by module."""
    from transformers import AutoModelForCausalLM

    from qerl.model.projection_layout import lay_out_projections
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels

    path = save_tiny_model(tmp_path / "m", "qwen2", vocab_size=64, hidden_size=64)
    policy = build_policy(str(path), quantization="bf16", lora_rank=4, dtype="float32")
    base = policy.get_base_model()
    att = base.model.layers[0].self_attn
    w = [att.q_proj.base_layer.weight, att.k_proj.base_layer.weight, att.v_proj.base_layer.weight]
    assert len({t.untyped_storage().data_ptr() for t in w}) == 1
    pointers = {n: p.data_ptr() for n, p in policy.named_parameters()}
    decoder = FusedDecoder(base, Kernels(fast=True))
    assert {n: p.data_ptr() for n, p in policy.named_parameters()} == pointers
    stacked = decoder.layers[0].qkv.gemm.dense
    assert stacked.shape[0] == sum(t.shape[0] for t in w) and stacked.data_ptr() == w[0].data_ptr()
    x = torch.randn(3, 64)
    for y, t in zip(decoder.layers[0].qkv.gemm(x), w):
        torch.testing.assert_close(y, x @ t.t())

    plain = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    plain.requires_grad_(False)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = plain(input_ids=ids).logits
    pointers = {n: p.data_ptr() for n, p in plain.named_parameters()}
    assert FusedDecoder(plain, Kernels(fast=True)).layers[0].qkv.gemm.dense is None  # not laid out: left alone
    assert {n: p.data_ptr() for n, p in plain.named_parameters()} == pointers
    params = sum(p.numel() for p in plain.parameters())
    assert lay_out_projections(plain) == 2 * plain.config.num_hidden_layers
    assert sum(p.numel() for p in plain.parameters()) == params
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, before, rtol=0, atol=0)
    assert FusedDecoder(plain, Kernels(fast=True)).layers[0].qkv.gemm.dense is not None


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_fused_prefill_matches_the_transformers_prefill(tmp_path, model_type, dtype, quantization):
    """The prompts through the fused step's kernels (all B * P tokens at once): the same KV cache and next-token
    logits as transformers' forward (+ peft), left padding included."""
    from qerl.rollout.builtin import left_pad
    from qerl.rollout.kv_cache import SlotCache, as_cache, head_dim
    from qerl.rollout.fused_decoder import FusedDecoder, Kernels

    path = save_tiny_model(tmp_path / "m", model_type, vocab_size=64, hidden_size=64)
    policy = build_policy(str(path), quantization=quantization, lora_rank=4, dtype=dtype)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    dt = getattr(torch, dtype)
    base = policy.get_base_model()
    config = base.config
    ids, mask = left_pad([list(p) for p in PROMPTS], PAD, torch.device("cpu"))
    B, P = ids.shape
    m4 = torch.ones(P, P, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
    m4 = (m4 | torch.eye(P, dtype=torch.bool)[None])[:, None]
    caches = [SlotCache(config.num_hidden_layers, B + 1, config.num_key_value_heads, P + 3,
                        head_dim(config), dt, "cpu") for _ in range(2)]
    with torch.no_grad():
        ref = policy(input_ids=ids, attention_mask=m4, position_ids=position_ids(mask),
                     past_key_values=as_cache(caches[0]), use_cache=True, logits_to_keep=1).logits[:, -1]
        decoder = FusedDecoder(base, Kernels(fast=False))
        decoder.prepare(dt)
        got = decoder.prefill(ids, position_ids(mask), caches[1].keys, caches[1].values, m4)
    # bf16: the LoRA-B product is summed in another order than peft's (one rounding step of the outputs)
    tol = {"atol": 2e-5, "rtol": 0} if dtype == "float32" else {"atol": 1.6e-2, "rtol": 1.6e-2}  # 2 bf16 steps
    torch.testing.assert_close(got, ref, **tol)
    for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        torch.testing.assert_close(b, a, **tol)
        assert not b[B:].any() and not b[:, :, P:].any()  # nothing outside rows 0..B-1, columns 0..P-1
    assert caches[1].keys[0][:B, :, :P].abs().sum() > 0


def test_adapter_buffers_are_stacked_refreshed_in_place_and_kept_while_off(tmp_path):
    """The LoRA-A rows of every layer's group of a kind share one 16-row-aligned buffer and its GEMV fragments; a
    new adapter state is copied into the same storage (captured graphs stay valid) and a disabled adapter keeps it."""
    from qerl.nvfp4.kernels import gemv_layout, gemv_plan
    from qerl.rollout.fused_decoder import GROUPS, FusedDecoder, Kernels
    from qerl.rollout.gemm_group import takes_fragments

    path = save_tiny_model(tmp_path / "m", "qwen2", vocab_size=64, hidden_size=64)
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="bfloat16")  # q|k|v: 12 rows -> 16
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for i, p in enumerate(lora.values()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    decoder = FusedDecoder(policy.get_base_model(), Kernels(fast=True))  # fast on CPU: the fragments are plain torch

    def check():
        for layer in decoder.layers:
            for kind in GROUPS:
                g = getattr(layer, kind)
                a = torch.cat([m.lora_A["default"].weight for m in g.modules]).to(torch.bfloat16)
                assert g.adapter and torch.equal(g.a, a)
                assert takes_fragments(g.gemm, torch.bfloat16)
                assert torch.equal(gemv_layout.undense_fragments(g.a_frags, a.shape[0]), a)
                for m, b in zip(g.modules, g.b):
                    s = m.scaling["default"]
                    assert torch.equal(b, (m.lora_B["default"].weight.to(torch.bfloat16).float() * s).to(b.dtype))

    decoder.prepare(torch.bfloat16)
    check()
    qkv = [layer.qkv for layer in decoder.layers]
    assert qkv[1].a.data_ptr() == qkv[0].a.data_ptr() + 16 * qkv[0].a.shape[1] * 2  # one buffer, 16-row aligned
    key = decoder.key()
    with torch.no_grad():
        for p in lora.values():
            p.mul_(-0.5)
    decoder.prepare(torch.bfloat16)
    check()
    assert decoder.key() == key  # same storage: graphs captured before still read the live adapter
    before = decoder.layers
    with policy.disable_adapter():
        decoder.prepare(torch.bfloat16)
        assert not any(g.adapter for layer in decoder.layers for g in layer.groups()) and decoder.key() != key
    # each rollout gets new layer and group values; the earlier ones are left as they were (frozen)
    assert all(g.adapter for layer in before for g in layer.groups())
    with pytest.raises(dataclasses.FrozenInstanceError):
        before[0].qkv.a = None
    decoder.prepare(torch.bfloat16)
    check()
    assert decoder.key() == key


def test_training_mode_is_kept_and_does_not_change_the_rollout(policy, fused):
    """A policy in training mode (the LightningModule's) samples what it samples in eval mode (no dropout: the
    transformers step switches to eval and back, the fused step has none) and is left in training mode."""
    engine = CUDAGraphRollout(fused=fused)
    mode = policy.training
    try:
        policy.eval()
        spec = SamplingSpec(max_new_tokens=6, temperature=0.7, seed=5, stream="separate")
        ref = engine.generate(policy, PROMPTS, group_size=2, pad_id=PAD, eos_ids=[], spec=spec)
        policy.train()
        r = engine.generate(policy, PROMPTS, group_size=2, pad_id=PAD, eos_ids=[], spec=spec)
        assert policy.training and all(m.training for m in policy.modules())
        assert torch.equal(r.completion_ids, ref.completion_ids) and torch.equal(r.logprobs, ref.logprobs)
    finally:
        policy.train(mode)


def test_waves_and_compaction_sample_the_same_rows(policy, fused):
    """Each row's noise is a function of (rollout key, output row, step): decoding in waves of one or two groups, or
    compacting at other times, gives every row the same tokens, log-probs and entropies as one wave."""
    eos = list(range(40, 48))  # rows finish early, so compaction moves rows between slots

    def run(**options):
        engine = CUDAGraphRollout(fused=fused, **options)
        spec = SamplingSpec(max_new_tokens=24, temperature=1.0, seed=11, stream="separate")
        return engine.generate(policy, PROMPTS, group_size=3, pad_id=PAD, eos_ids=eos, spec=spec)

    one = run(check_every=4)
    assert not torch.equal(one.completion_ids[0], one.completion_ids[1])  # a group's rows differ
    for options in ({"wave_rows": 3, "check_every": 4}, {"wave_rows": 7, "check_every": 2}, {"check_every": 1}):
        other = run(**options)
        assert torch.equal(other.completion_ids, one.completion_ids), options
        assert torch.equal(other.completion_mask, one.completion_mask), options
        torch.testing.assert_close(other.logprobs, one.logprobs, atol=2e-5, rtol=0)  # other batch shapes, other sums
        torch.testing.assert_close(other.entropy, one.entropy, atol=2e-5, rtol=0)


def test_a_wave_holds_whole_groups_and_the_kv_cache_can_be_released(policy):
    engine = CUDAGraphRollout(wave_rows=2)
    with pytest.raises(ValueError, match=r"wave_rows=2 is smaller than one group \(model.sampling.group_size=3\)"):
        spec = SamplingSpec(max_new_tokens=5, seed=0, stream="separate")
        engine.generate(policy, PROMPTS, 3, PAD, [], spec)
    with pytest.raises(ValueError, match="wave_rows must be >= 1"):
        CUDAGraphRollout(wave_rows=0)
    kept = CUDAGraphRollout(wave_rows=4)
    freed = CUDAGraphRollout(wave_rows=4, keep_kv_cache=False)
    for _ in range(2):  # the second rollout allocates the released cache again
        spec2 = SamplingSpec(max_new_tokens=5, seed=4, stream="separate")
        a, b = kept.generate(policy, PROMPTS, 2, PAD, [], spec2), freed.generate(policy, PROMPTS, 2, PAD, [], spec2)
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert kept._state.cache.storage is not None and freed._state.cache.storage is None
    assert kept._state.rows == 4  # the cache holds one wave (two groups of 2), not the 6 rows


def test_fp8_kv_cache_samples_from_the_policy_over_an_e4m3_cache(policy, fused):
    """kv_cache_dtype fp8_e4m3: one byte per cache element, and the log-probs returned are those of the policy whose
    attention reads K and V rounded to e4m3 (a full forward through such a cache), not the unrounded policy's."""
    engine = CUDAGraphRollout(check_every=3, fused=fused, kv_cache_dtype="fp8_e4m3")
    spec = SamplingSpec(max_new_tokens=10, temperature=0.8, seed=2, stream="separate")
    r = engine.generate(policy, PROMPTS, group_size=4, pad_id=PAD, eos_ids=[EOS], spec=spec)
    assert used_decoder(engine) == fused
    cache = engine._state.cache
    assert cache.storage.dtype == torch.float8_e4m3fn and cache.storage.element_size() == 1
    lp, entropy = recompute(policy, r, 0.8, kv_cache_dtype=torch.float8_e4m3fn)
    exact, _ = recompute(policy, r, 0.8)
    m = r.completion_mask.bool()
    err, ent_err, gap = ((r.logprobs - lp).abs()[m], (r.entropy - entropy).abs()[m], (r.logprobs - exact).abs()[m])
    # the same e4m3 values, except where another order of fp32 sums tips a K/V element over a rounding boundary (one
    # e4m3 step, rare): the typical error is float noise, the mean far below the rounding's own effect
    assert err.median() < 2e-5 and ent_err.median() < 2e-5
    assert err.mean() < 0.05 * gap.mean() and ent_err.mean() < 0.05 * gap.mean()
    assert 1e-3 < gap.mean() < 0.1  # rounded K/V move the distribution, a little


def test_fp8_kv_cache_halves_the_cache_and_bad_values_are_refused(policy):
    from qerl.model.footprint import ModelShape
    from qerl.rollout.run_settings import RunSettings
    from qerl.rollout.footprint import wave_kv_cache_bytes as planned_kv_bytes

    config = policy.get_base_model().config
    assert kv_cache_bytes(config, 8, 64, torch.float8_e4m3fn) * 2 == kv_cache_bytes(config, 8, 64, torch.bfloat16)
    settings = RunSettings(prompts=2, group_size=4, max_prompt_tokens=100, max_new_tokens=156)
    shape = ModelShape.from_config(config)
    fp8 = RunSettings(**{**settings.__dict__, "kv_cache_dtype": "fp8_e4m3"})
    assert planned_kv_bytes(shape, fp8, 8) * 2 == planned_kv_bytes(shape, settings, 8)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*fp8_e4m3"):
        CUDAGraphRollout(kv_cache_dtype="fp8")


def test_a_moe_policy_samples_with_the_transformers_step_and_exact_logprobs(tmp_path):
    """A mixture-of-experts policy (tiny Qwen3-MoE: NVFP4 experts with LoRA each) through the transformers step
    (``fused=False``; the fused MoE step: tests/rollout/test_moe_step.py): log-probs (compaction and early stop
    included) equal a full forward's."""
    path = save_tiny_model(tmp_path / "m", "qwen3_moe", vocab_size=64, hidden_size=64)
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    engine = CUDAGraphRollout(check_every=3, fused=False)
    spec = SamplingSpec(max_new_tokens=12, temperature=0.7, seed=1, stream="separate")
    r = engine.generate(policy, PROMPTS, group_size=4, pad_id=PAD, eos_ids=[EOS, 9], spec=spec)
    assert not used_decoder(engine) and r.prompt_ids.shape[0] == 12
    lp, entropy = recompute(policy, r, 0.7)
    torch.testing.assert_close(r.logprobs, lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.entropy, entropy, atol=2e-5, rtol=0)
