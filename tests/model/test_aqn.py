"""AQN: the stage schedule by hand, the channel noise of ``noisy_norms``, and proof that the noise is on during the
rollout and off during the loss."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from qerl.data.prompt_format import format_prompt
from qerl.model.aqn import AQNSchedule, aqn_noise, aqn_sigma, aqn_stage, noisy_norms, rms_norms
from qerl.modules.grpo_module import GRPOModule
from qerl.modules.options import DAPOOptions, OptimizerOptions, SamplingOptions, UpdateOptions
from qerl.model.policy import PolicyConfig, build_policy, trainable_parameters
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.sampling_spec import SamplingSpec

QUESTIONS = ("What is 2 + 3?", "Tom has 7 apples and eats 4. How many are left?")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16).clone()


def norm_weights(model) -> list[torch.Tensor]:
    return [m.weight.detach().clone() for m in rms_norms(model)]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(format_prompt(tokenizer, q), add_special_tokens=False)["input_ids"] for q in QUESTIONS]


@pytest.fixture
def policy(tiny_model_dirs):
    torch.manual_seed(0)
    return build_policy(str(tiny_model_dirs["qwen2"]), "nvfp4", lora_rank=4, lora_alpha=8, dtype="float32")


def rollout(policy, prompt_ids, sigma: float, noise_seed: int = 1, max_new_tokens: int = 6):
    spec = SamplingSpec(max_new_tokens=max_new_tokens, noise_sigma=sigma,
                        noise_generator=torch.Generator().manual_seed(noise_seed), seed=0, stream="separate")
    return BuiltinRollout().generate(policy, prompt_ids, 2, pad_id=2, eos_ids=[2], spec=spec)


# ---------------------------------------------------------------------------------------------------------------
# Schedule


def test_stage_zero_is_noise_free():
    for total, k in [(100, 10), (16, 4), (7, 3), (2, 2)]:
        first_stage = [s for s in range(total) if aqn_stage(s, total, k) == 0]
        assert first_stage and all(aqn_sigma(s, total, 1e-2, 1e-4, k) == 0.0 for s in first_stage)
        assert aqn_sigma(first_stage[-1] + 1, total, 1e-2, 1e-4, k) > 0


def test_recipe_schedule_by_hand():
    # K = 10 over 100 steps: stage k covers steps 10k..10k+9; stages 1..9 go geometrically 1e-2 -> 1e-4, i.e. the
    # exponent of 10 drops by 2/8 = 0.25 per stage.
    expected = [0.0] + [10 ** (-2 - 0.25 * (k - 1)) for k in range(1, 10)]
    assert [expected[1], expected[5], expected[9]] == pytest.approx([1e-2, 1e-3, 1e-4])
    for step in range(100):
        assert aqn_sigma(step, 100, 1e-2, 1e-4, 10) == pytest.approx(expected[step // 10], rel=1e-12)
    assert aqn_sigma(100, 100) == pytest.approx(1e-4)  # past the end stays in the last stage (defaults = recipe)
    assert aqn_sigma(1, 2, 0.05, 1e-4, 2) == 0.05  # K = 2: one noisy stage at sigma_start


@pytest.mark.parametrize("total,k", [(100, 10), (16, 4), (25, 10), (500, 10), (9, 3)])
def test_stages_have_equal_length(total, k):
    lengths = Counter(aqn_stage(s, total, k) for s in range(total))
    assert sorted(lengths) == list(range(k))
    assert max(lengths.values()) - min(lengths.values()) <= (0 if total % k == 0 else 1)
    stages = [aqn_stage(s, total, k) for s in range(total)]
    assert stages == sorted(stages)  # monotone: no stage comes back


@pytest.mark.parametrize("k", [1, 0, -3])
def test_fewer_than_two_stages_is_an_error(k):
    with pytest.raises(ValueError, match="num_stages"):
        aqn_sigma(5, 10, 1e-2, 1e-4, k)
    with pytest.raises(ValueError, match=r"aqn\.num_stages"):
        AQNSchedule(num_stages=k)


def test_schedule_follows_aqn_sigma_and_can_be_disabled():
    schedule = AQNSchedule(sigma_start=1e-2, sigma_end=1e-4, num_stages=10)
    assert [schedule.sigma(s, 100) for s in (0, 9, 10, 95)] == [aqn_sigma(s, 100) for s in (0, 9, 10, 95)]
    off = AQNSchedule(enabled=False)
    assert all(off.sigma(s, 100) == 0.0 for s in range(100))


# ---------------------------------------------------------------------------------------------------------------
# noisy_norms


class Norms(torch.nn.Module):
    def __init__(self, n: int = 8, width: int = 4096):
        super().__init__()
        self.norms = torch.nn.ModuleList(Qwen2RMSNorm(width) for _ in range(n))
        self.other = torch.nn.Linear(4, 4)  # not a norm: must not be touched
        with torch.no_grad():
            for i, m in enumerate(self.norms):
                m.weight.copy_(torch.linspace(0.5, 1.5, width) + i)


def test_noise_has_the_scheduled_std_one_value_per_channel():
    model, sigma = Norms(), 0.01
    clean = norm_weights(model)
    linear = model.other.weight.detach().clone()
    with noisy_norms(model, sigma, torch.Generator().manual_seed(0)) as noises:
        noisy = norm_weights(model)
        assert torch.equal(model.other.weight, linear)
    assert len(noises) == len(clean) == 8
    deltas = [n - c for n, c in zip(noisy, clean)]
    for delta, noise, weight in zip(deltas, noises, clean):
        assert noise.shape == weight.shape  # one value per channel
        torch.testing.assert_close(delta, noise, rtol=0, atol=1e-6)  # w' = w + z, nothing else
        assert noise.unique().numel() > 0.99 * noise.numel()  # independent per channel, not one shared value
    z = torch.cat(deltas)  # 32768 draws: the sample std is within ~0.4% of sigma (1 sd); allow 3%
    assert z.std().item() == pytest.approx(sigma, rel=0.03)
    assert abs(z.mean().item()) < 4 * sigma / z.numel() ** 0.5
    assert not torch.equal(deltas[0], deltas[1])  # fresh noise for each norm


def test_the_built_in_engines_draw_with_the_one_noise_helper():
    # every engine (the built-in ones through noisy_norms, vLLM's in its norm writes) draws with aqn_noise: the same
    # generator state gives the same noise, in the weight's dtype and on its device
    model = Norms(n=3, width=64).to(torch.bfloat16)
    with noisy_norms(model, 0.02, torch.Generator().manual_seed(5)) as noises:
        pass
    again = torch.Generator().manual_seed(5)
    expected = [aqn_noise(m.weight, 0.02, again) for m in rms_norms(model)]
    assert all(torch.equal(a, b) and a.dtype == torch.bfloat16 for a, b in zip(noises, expected))


def test_noise_is_fresh_each_time_and_zero_std_is_a_no_op():
    model = Norms(2, 64)
    g = torch.Generator().manual_seed(0)
    with noisy_norms(model, 0.1, g):
        first = norm_weights(model)
    with noisy_norms(model, 0.1, g):
        second = norm_weights(model)
    assert not torch.equal(first[0], second[0])
    clean = norm_weights(model)
    with noisy_norms(model, 0.0, g) as noises:
        assert noises == [] and all(torch.equal(a, b) for a, b in zip(norm_weights(model), clean))


def test_noise_is_removed_bitwise_even_on_error(policy):
    norms = rms_norms(policy)
    assert len(norms) == 2 * (2 * 2 + 1)  # 5 RMSNorms, each a frozen original plus its trainable copy
    clean = [bits(m.weight) for m in norms]
    with noisy_norms(policy, 0.3, torch.Generator().manual_seed(0)):
        assert all(not torch.equal(bits(m.weight), c) for m, c in zip(norms, clean))
    assert all(torch.equal(bits(m.weight), c) for m, c in zip(norms, clean))
    with pytest.raises(RuntimeError, match="boom"):
        with noisy_norms(policy, 0.3, torch.Generator().manual_seed(1)):
            raise RuntimeError("boom")
    assert all(torch.equal(bits(m.weight), c) for m, c in zip(norms, clean))


# ---------------------------------------------------------------------------------------------------------------
# The noise in the rollout, and not in the loss


def test_rollout_sees_the_noise_of_the_scheduled_std(policy, prompt_ids):
    clean = {id(m): m.weight.detach().clone() for m in rms_norms(policy)}
    seen = []

    def record(module, args):
        if module.training is False:  # the rollout runs in eval mode
            seen.append(module.weight.detach() - clean[id(module)])

    hooks = [m.register_forward_pre_hook(record) for m in rms_norms(policy)]
    try:
        rollout(policy, prompt_ids, sigma=0.05)
    finally:
        for h in hooks:
            h.remove()
    assert seen, "no RMSNorm ran during the rollout"
    z = torch.cat([d for d in seen if d.abs().sum() > 0])
    assert len(z) >= 5 * 64  # every norm the model uses was noisy when it ran
    assert z.std().item() == pytest.approx(0.05, rel=0.2)  # 5 norms x 64 channels (x 2 copies): a loose sample


def test_noisy_rollout_differs_from_clean_rollout_with_the_same_seed(policy, prompt_ids):
    clean_a = rollout(policy, prompt_ids, sigma=0.0)
    clean_b = rollout(policy, prompt_ids, sigma=0.0)
    noisy = rollout(policy, prompt_ids, sigma=0.05)
    # Same sampling seed, no noise: identical output.
    assert torch.equal(clean_a.completion_ids, clean_b.completion_ids)
    assert torch.equal(bits(clean_a.logprobs), bits(clean_b.logprobs))
    # Same sampling seed with noise: the policy sampled from is another one.
    mask = (clean_a.completion_mask * noisy.completion_mask).bool()
    assert (clean_a.logprobs - noisy.logprobs)[mask].abs().max() > 1e-3 or not torch.equal(
        clean_a.completion_ids, noisy.completion_ids
    )
    # And the policy is clean again: the next noise-free rollout equals the first.
    assert torch.equal(bits(rollout(policy, prompt_ids, sigma=0.0).logprobs), bits(clean_a.logprobs))


def test_trainable_norms_keep_their_gradient_path_after_a_noisy_rollout(policy, prompt_ids):
    params = trainable_parameters(policy)
    norm_params = [m.weight for m in rms_norms(policy) if m.weight.requires_grad]
    assert len(norm_params) == 5
    ro = rollout(policy, prompt_ids, sigma=0.1)
    assert [id(p) for p in trainable_parameters(policy)] == [id(p) for p in params]  # the optimizer's tensors
    assert all(p.is_leaf and p.requires_grad and p.grad is None for p in norm_params)
    ids = torch.cat((ro.prompt_ids, ro.completion_ids), 1)
    mask = torch.cat((ro.prompt_mask, ro.completion_mask), 1)
    policy(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in norm_params)


class _HashReward:
    """Deterministic rewards in [0, 1] from the completion text, so advantages (and gradients) are not all zero."""

    def __init__(self):
        self.last_stats = Counter()

    def __call__(self, completions, answers):
        self.last_stats = Counter(correct=0)
        return torch.tensor([sum(map(ord, c)) % 7 / 6 for c in completions])


def test_training_forward_sees_clean_weights(tiny_model_dirs, tokenizer, prompt_ids, monkeypatch):
    """Inside a real training_step with the schedule's sigma > 0 (its second stage: step 1 of 2): the module hands the
    engine that sigma, and the loss gets log-probs equal to a clean recomputation, while the sampling log-probs (noisy
    policy) are far from them."""
    torch.manual_seed(0)
    module = GRPOModule(
        policy=PolicyConfig(model=str(tiny_model_dirs["qwen2"]), dtype="float32", lora_rank=4, lora_alpha=8),
        reward=_HashReward(), rollout=BuiltinRollout(), sampling=SamplingOptions(group_size=2, max_new_tokens=4),
        aqn=AQNSchedule(sigma_start=0.05, sigma_end=0.05, num_stages=2), update=UpdateOptions(micro_batch_size=4),
        optimizer=OptimizerOptions(lr=0.0, max_grad_norm=0.0), dapo=DAPOOptions(mask_truncated=False),
        log_samples_every=0,
    )  # lr 0: the optimizer step leaves the weights as they were, so they can be compared after fit
    module.tokenizer = tokenizer
    module.configure_model()
    captured = {}
    from qerl.modules import policy_update

    generate, loss_forward, logprobs_of = module.rollout.generate, module.loss.forward, policy_update.policy_logprobs

    def spy_generate(*args, **kwargs):
        captured["sigma"] = args[-1].noise_sigma
        captured["rollout"] = generate(*args, **kwargs)
        return captured["rollout"]

    def spy_loss(logprobs, *args, **kwargs):
        captured["logprobs"] = logprobs.detach().clone()
        return loss_forward(logprobs, *args, **kwargs)

    def spy_logprobs(policy, rollout, batch, *args, **kwargs):
        captured["batch"] = batch  # the micro-batch, its rows in the order the loss sees them
        captured["settings"] = args[0]
        return logprobs_of(policy, rollout, batch, *args, **kwargs)

    module.rollout.generate, module.loss.forward = spy_generate, spy_loss
    monkeypatch.setattr(policy_update, "policy_logprobs", spy_logprobs)
    batch = {"prompts": list(QUESTIONS), "prompt_ids": prompt_ids, "answers": ["5", "3"]}
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=DataLoader([batch, batch], batch_size=None, collate_fn=lambda b: b))
    assert captured["sigma"] == 0.05  # the last step's

    ro = captured["rollout"]
    rows = captured["batch"].rows
    assert sorted(rows.tolist()) == list(range(ro.prompt_ids.shape[0]))  # one micro-batch of every row
    with torch.no_grad():
        clean = logprobs_of(module.policy, ro, captured["batch"], captured["settings"], with_entropy=False)[0]
    mask = ro.completion_mask[rows].bool()
    torch.testing.assert_close(captured["logprobs"][mask], clean[mask], rtol=0, atol=1e-6)
    assert (ro.logprobs[rows] - clean)[mask].abs().max() > 1e-3  # the rollout sampled from the noisy policy


def test_qwen3_per_head_qk_norms_take_no_noise(tiny_model_dirs):
    """Qwen3's q_norm / k_norm are left clean (qerl.model.aqn says why); every other norm gets fresh noise."""
    policy = build_policy(str(tiny_model_dirs["qwen3"]), "nvfp4", lora_rank=4, lora_alpha=8, dtype="float32")
    norms = {n: m for n, m in policy.named_modules() if type(m).__name__.endswith("RMSNorm")}
    qk = {n for n in norms if ".q_norm" in n or ".k_norm" in n}
    assert len(qk) == 2 * 2 * 2  # 2 layers x (q, k) x (peft's frozen original + trained copy)
    clean = {n: m.weight.detach().clone() for n, m in norms.items()}
    with noisy_norms(policy, 0.05, torch.Generator().manual_seed(0)):
        changed = {n for n, m in norms.items() if not torch.equal(m.weight, clean[n])}
    assert changed == set(norms) - qk
    assert all(torch.equal(m.weight, clean[n]) for n, m in norms.items())


def test_a_bf16_policy_takes_the_scheduled_noise_through_train_py(tiny_model_dirs, tmp_path, monkeypatch):
    """AQN is sampling noise for any policy: ``train.py fit`` with ``quantization: bf16`` (the AQN experiment's
    bf16_aqn arm, with its CUDA-graph engine) writes the scheduled noise into the bf16 policy's RMSNorms for the
    rollout, and the training forward sees them clean."""
    import qerl.rollout.cuda_graph as cuda_graph
    from qerl.cli import cli_main
    from qerl.nvfp4.linear import NVFP4Linear

    seen = []  # per rollout: (std asked for, the norms' realized change inside the block, clean again after)
    real = cuda_graph.noisy_norms

    @contextmanager
    def recording(model, std, generator=None):
        norms = rms_norms(model)
        clean = [m.weight.detach().clone() for m in norms]
        with real(model, std, generator) as noises:
            change = torch.cat([(m.weight.detach() - c).flatten() for m, c in zip(norms, clean)])
            yield noises
        seen.append((std, len(norms), change, all(torch.equal(m.weight, c) for m, c in zip(norms, clean))))

    monkeypatch.setattr(cuda_graph, "noisy_norms", recording)
    monkeypatch.chdir(tmp_path)
    cli = cli_main([
        "fit", "--config", str(Path(__file__).resolve().parents[2] / "configs" / "debug.yaml"),
        "--model.policy.model", str(tiny_model_dirs["qwen2"]), "--model.policy.quantization", "bf16",
        "--model.rollout", "qerl.rollout.cuda_graph.CUDAGraphRollout", "--aqn.enabled", "true",
        "--aqn.sigma_start", "0.05", "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
    ])
    assert not any(isinstance(m, NVFP4Linear) for m in cli.model.policy.modules())  # a bf16 policy
    (std0, _, change0, clean0), (std1, count, change1, clean1) = seen  # K = 2: step 0 noise-free, step 1 sigma_start
    assert std0 == 0.0 and change0.abs().max() == 0 and clean0
    assert std1 == pytest.approx(0.05) and count == 10  # 2 layers x 2 norms + the final norm, peft's two copies each
    assert (change1 != 0).all() and change1.std().item() == pytest.approx(0.05, rel=0.25)
    assert clean1  # restored bitwise after the rollout: the loss sees the clean norms
