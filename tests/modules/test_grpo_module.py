"""GRPOModule's training_step with a real tiny policy under a real Trainer: where gradients go, gradient accumulation,
PPO epochs, masking; the LR schedule by hand; bad configuration failing before any weight is read."""

from __future__ import annotations

import math
import warnings
from collections import Counter

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from qerl.cli import cli_main
from qerl.modules import grpo_module, policy_update
from qerl.modules.grpo_module import GRPOModule
from qerl.modules.optimizer import warmup_cosine
from qerl.modules.options import DAPOOptions, OptimizerOptions, SamplingOptions, UpdateOptions
from qerl.model.policy import PolicyConfig, trainable_parameters
from qerl.rollout.builtin import BuiltinRollout

QUESTIONS = ("What is 2 + 3?", "Tom has 7 apples and eats 4. How many are left?", "Compute 6 times 7.",
             "What is 9 - 5?")


class HashReward:
    """Deterministic rewards in [0, 1] from the completion text: random completions get varied rewards."""

    def __init__(self):
        self.last_stats = Counter()

    def __call__(self, completions, answers):
        self.last_stats = Counter(correct=0)
        return torch.tensor([sum(map(ord, c)) % 7 / 6 for c in completions])


class ScriptedReward:
    """The same given rewards at every call, so a test picks which groups have zero variance."""

    def __init__(self, values):
        self.values, self.last_stats = values, Counter()

    def __call__(self, completions, answers):
        assert len(completions) == len(self.values)
        self.last_stats = Counter(correct=sum(v == 1 for v in self.values))
        return torch.tensor(self.values, dtype=torch.float32)


class GradRecorder(L.Callback):
    """Clones every gradient of the policy right before each optimizer step (after clipping)."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor | None]] = []

    def on_train_start(self, trainer, pl_module):
        def hook(optimizer, args, kwargs):
            self.steps.append({n: None if p.grad is None else p.grad.detach().clone()
                               for n, p in pl_module.policy.named_parameters()})

        trainer.optimizers[0].register_step_pre_hook(hook)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    # Bare questions, no chat template: short prompts keep each step cheap; lengths differ, so left padding is used.
    return [tokenizer(q)["input_ids"] for q in QUESTIONS]


def make_module(model_dir, tokenizer, reward=None, max_new_tokens=2, update=None, optimizer=None,
                dapo=None) -> GRPOModule:
    """A module with its policy built now (LoRA init from seed 0), trainable weights moved off their init so that
    every one of them gets a gradient (LoRA B starts at 0, which zeroes the gradient of A); ``update``, ``optimizer``
    and ``dapo``: options of those groups that differ from the test defaults."""
    torch.manual_seed(0)
    module = GRPOModule(
        policy=PolicyConfig(model=str(model_dir), dtype="float32", lora_rank=4, lora_alpha=8),
        reward=reward or HashReward(), rollout=BuiltinRollout(),
        sampling=SamplingOptions(group_size=2, max_new_tokens=max_new_tokens), log_samples_every=0,
        update=UpdateOptions(**(update or {})), optimizer=OptimizerOptions(**{"max_grad_norm": 0.0, **(optimizer or {})}),
        dapo=DAPOOptions(**{"mask_truncated": False, **(dapo or {})}),
    )
    module.tokenizer = tokenizer
    module.configure_model()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainable_parameters(module.policy):
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return module


def fit(module, prompt_ids, steps=1, n_prompts=2, callbacks=()) -> L.Trainer:
    batches = [{"prompts": list(QUESTIONS[:n_prompts]), "prompt_ids": prompt_ids[:n_prompts],
                "answers": ["0"] * n_prompts}] * steps
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return trainer


def spy(obj, name: str, record: list):
    """Wrap ``obj.name`` so each call appends (args, kwargs, result) to ``record``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        record.append((args, kwargs, out))
        return out

    setattr(obj, name, wrapper)


def spy_function(monkeypatch, module, name: str, record: list):
    """``spy`` on a module-level function, put back after the test."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        record.append((args, kwargs, out))
        return out

    monkeypatch.setattr(module, name, wrapper)


@pytest.fixture
def qwen2(tiny_model_dirs):
    return tiny_model_dirs["qwen2"]


# ---------------------------------------------------------------------------------------------------------------
# Gradients and updates


def test_gradients_reach_only_lora_and_norms_and_a_step_moves_the_adapter(qwen2, tokenizer, prompt_ids):
    module = make_module(qwen2, tokenizer, optimizer={"lr": 1e-2})
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    grads = GradRecorder()
    trainer = fit(module, prompt_ids, callbacks=[grads])

    (step,) = grads.steps
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n for n in trainable)
    assert {n for n, g in step.items() if g is not None} == trainable  # frozen weights get no gradient at all
    assert all(step[n].abs().sum() > 0 for n in trainable)  # every LoRA matrix and trained norm gets one
    after = dict(module.policy.named_parameters())
    assert all(not torch.equal(after[n], before[n]) for n in trainable)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in trainable)
    assert trainer.logged_metrics["train/ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)  # one epoch: on-policy


def test_micro_batch_size_does_not_change_the_accumulated_gradient(qwen2, tokenizer, prompt_ids, monkeypatch):
    grads, forwards, tokens = {}, {}, {}
    for mbs in (3, 8):  # 8 rows: one micro-batch, or three uneven ones (3 + 3 + 2)
        module = make_module(qwen2, tokenizer, update={"micro_batch_size": mbs})
        calls = []
        spy_function(monkeypatch, policy_update, "policy_logprobs", calls)
        recorder = GradRecorder()
        fit(module, prompt_ids, n_prompts=4, callbacks=[recorder])
        grads[mbs], forwards[mbs] = recorder.steps[0], len(calls)
        tokens[mbs] = sum(int(rollout.prompt_mask[idx].sum() + rollout.completion_mask[idx].sum())
                          for (_, rollout, batch, *_), _, _ in calls for idx in [batch.rows])  # real tokens
    assert forwards == {3: 3, 8: 1} and tokens[3] == tokens[8]
    reference = grads[8]
    assert all(reference[n].abs().sum() > 0 for n, g in reference.items() if g is not None)
    # Both runs sum the same float32 terms in another order (and the thread count changes the order inside each
    # matmul too). A rounding error of a sum of n terms grows like eps * sqrt(n) times their scale; each gradient
    # entry sums over the batch's tokens, each token's term over the LM head's vocabulary (the longest reductions on
    # the way). Taking the tensor's largest entry as the scale and 4 standard deviations of margin: bugs in the
    # accumulation (a micro-batch weighted wrong, a row dropped) move entries by percents, far above this.
    vocab = module.policy.get_base_model().config.vocab_size
    eps = torch.finfo(torch.float32).eps
    relative = 4 * eps * (math.sqrt(tokens[8]) + math.sqrt(vocab))
    for mbs in (3,):
        for name, g in grads[mbs].items():
            if g is None:
                assert reference[name] is None
                continue
            torch.testing.assert_close(g, reference[name], rtol=0, atol=relative * reference[name].abs().max().item())


def test_num_iterations_does_that_many_optimizer_steps_per_batch(qwen2, tokenizer, prompt_ids):
    module = make_module(qwen2, tokenizer, update={"num_iterations": 2}, optimizer={"lr": 1e-2})
    steps, recorder = [], GradRecorder()
    spy(module, "training_step", steps)
    trainer = fit(module, prompt_ids, steps=2, callbacks=[recorder])
    assert len(steps) == 1  # max_steps counts optimizer steps: one rollout batch gives two
    assert trainer.global_step == 2 and len(recorder.steps) == 2
    # The second epoch compares with the stored old log-probs: after one update the ratio is no longer 1.
    assert trainer.logged_metrics["train/ratio_mean"].item() != pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Masks


def test_dynamic_sampling_masks_zero_variance_groups(qwen2, tokenizer, prompt_ids, monkeypatch):
    # group 0 all correct (no signal), group 1 mixed, group 2 all wrong, group 3 mixed
    module = make_module(qwen2, tokenizer, reward=ScriptedReward([1, 1, 0, 1, 0, 0, 1, 0]),
                         dapo={"dynamic_sampling": True})
    rollouts, updates = [], []
    spy(module.rollout, "generate", rollouts)
    spy_function(monkeypatch, grpo_module, "policy_update", updates)
    trainer = fit(module, prompt_ids, n_prompts=4)
    completion_mask = rollouts[0][2].completion_mask
    loss_mask = updates[0][0][4]
    kept = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    assert torch.equal(loss_mask, completion_mask * kept[:, None])
    assert trainer.logged_metrics["train/zero_std_groups_frac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_truncated_completions_get_no_loss_when_masked(qwen2, tokenizer, prompt_ids, monkeypatch, mask_truncated):
    module = make_module(qwen2, tokenizer, dapo={"mask_truncated": mask_truncated})
    # A third of the vocabulary ends a completion, so 2 new tokens give both finished and truncated samples.
    module._eos_ids = lambda: list(range(0, tokenizer.vocab_size, 3))
    rollouts, updates = [], []
    spy(module.rollout, "generate", rollouts)
    spy_function(monkeypatch, grpo_module, "policy_update", updates)
    trainer = fit(module, prompt_ids, n_prompts=4)
    ro, loss_mask = rollouts[0][2], updates[0][0][4]
    assert 0 < ro.truncated.sum() < len(ro.truncated), "the seed should give both kinds"
    expected = ro.completion_mask * (~ro.truncated if mask_truncated else torch.ones_like(ro.truncated))[:, None]
    assert torch.equal(loss_mask, expected)
    assert trainer.logged_metrics["train/truncated_frac"].item() == pytest.approx(ro.truncated.float().mean().item())


def test_a_batch_without_any_loss_token_still_steps(qwen2, tokenizer, prompt_ids):
    """All completions truncated and masked: no forward, no gradient, but the step (and the schedules) advance."""
    module = make_module(qwen2, tokenizer, dapo={"mask_truncated": True})
    module._eos_ids = lambda: [tokenizer.vocab_size + 5]  # nothing ever stops
    trainer = fit(module, prompt_ids)
    assert trainer.global_step == 1
    assert trainer.logged_metrics["train/truncated_frac"].item() == 1.0


# ---------------------------------------------------------------------------------------------------------------
# LR schedule


def test_warmup_cosine_by_hand():
    # 10 steps, 2 of warmup: 1/2, 2/2, then cos over the 8 remaining steps
    assert [warmup_cosine(s, 10, 2) for s in (0, 1)] == [0.5, 1.0]
    assert warmup_cosine(2, 10, 2) == 1.0
    assert warmup_cosine(4, 10, 2) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert warmup_cosine(6, 10, 2) == pytest.approx(0.5)
    assert warmup_cosine(10, 10, 2) == pytest.approx(0.0, abs=1e-12)
    assert warmup_cosine(6, 10, 2, min_ratio=0.1) == pytest.approx(0.55)
    assert warmup_cosine(10, 10, 2, min_ratio=0.1) == pytest.approx(0.1)
    assert warmup_cosine(50, 10, 2, min_ratio=0.1) == pytest.approx(0.1)  # past the end: stays at the floor
    assert warmup_cosine(0, 4, 0) == 1.0  # no warmup: starts at the peak
    assert warmup_cosine(1, 4, 0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


# ---------------------------------------------------------------------------------------------------------------
# Bad configuration fails at instantiation, before any weight is read


@pytest.mark.parametrize(
    "override,option",
    [
        (["--model.sampling.group_size", "1"], "model.sampling.group_size"),
        (["--aqn.num_stages", "1"], "aqn.num_stages"),
        (["--model.policy.lora_targets", "[no_such_proj]"], "model.policy.lora_targets"),
        (["--model.policy.model", "/nonexistent/qwen"], "model.policy.model"),
        (["--model.dapo.max_refill_rounds", "2"], "model.dapo.max_refill_rounds"),  # without dynamic_sampling
        (["--model.advantage", "qerl.modules.advantages.RLOOAdvantage", "--model.advantage.init_args.scale_std",
          "false"], "scale_std"),
    ],
)
def test_bad_config_fails_before_any_model_loads(qwen2, tmp_path, no_model_loads, capsys, override, option):
    args = ["fit", "--config", "configs/debug.yaml", "--model.policy.model", str(qwen2),
            "--trainer.logger.init_args.save_dir", str(tmp_path), *override]
    with pytest.raises(SystemExit) as info:  # a user's mistake: one line and exit code 2, as argparse
        cli_main(args)
    assert info.value.code == 2 and option in capsys.readouterr().err


def test_unknown_loss_class_is_rejected_by_the_parser(qwen2, tmp_path, no_model_loads):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", "configs/debug.yaml", "--model.policy.model", str(qwen2),
                  "--model.loss", "qerl.modules.loss.NoSuchLoss"])


# ---------------------------------------------------------------------------------------------------------------
# Micro-batches by token budget


def _padded_logprobs(module, rollout):
    """The reference: every row left-padded to the longest prompt and right-padded to the longest completion, one
    forward with the padding mask and position ids counted over real tokens, as the rollout sees them."""
    from qerl.modules.logprobs import token_logprobs

    model = module.policy.get_base_model()
    ids = torch.cat((rollout.prompt_ids, rollout.completion_ids), dim=1)
    mask = torch.cat((rollout.prompt_mask, rollout.completion_mask), dim=1)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                                 use_cache=False).last_hidden_state
    P = rollout.prompt_ids.shape[1]
    logprobs, entropy = token_logprobs(hidden[:, P - 1 : -1], model.get_output_embeddings().weight,
                                       rollout.completion_ids, temperature=module.sampling.temperature)
    return logprobs * rollout.completion_mask, entropy[rollout.completion_mask.bool()]


@pytest.mark.parametrize("budget", [1, 30, 40, None])
def test_aligned_micro_batches_give_the_padded_log_probs_and_gradients(qwen2, tokenizer, prompt_ids, budget):
    from qerl.modules.micro_batches import micro_batches, plan_micro_batches

    module = make_module(qwen2, tokenizer, max_new_tokens=5,
                         update={"micro_batch_size": 3, "micro_batch_tokens": budget})
    with torch.no_grad():
        rollout = module.rollout.generate(module.policy, prompt_ids, 2, tokenizer.pad_token_id,
                                          [tokenizer.eos_token_id], module.sampling.training_spec(0.0, None))
    # completions of different lengths (EOS is rare in a random model): 5, 1, 3, 2, ... tokens
    lengths = torch.tensor([5, 1, 3, 2, 4, 5, 1, 2])
    completion_mask = (torch.arange(5)[None] < lengths[:, None]).long()
    rollout = rollout._replace(completion_mask=completion_mask,
                               completion_ids=rollout.completion_ids.masked_fill(completion_mask == 0,
                                                                                 tokenizer.pad_token_id))
    assert rollout.prompt_mask.eq(0).any()  # prompts of different lengths: left padding is in play
    weights = torch.randn(completion_mask.shape, generator=torch.Generator().manual_seed(1))
    params = trainable_parameters(module.policy)

    reference, reference_entropy = _padded_logprobs(module, rollout)
    reference_grads = torch.autograd.grad((reference * weights).sum(), params)

    real = (rollout.prompt_mask.sum(-1) + lengths).tolist()
    plan = plan_micro_batches(real, budget, 3)
    assert [len(b) for b in plan] == {1: [1] * 8, 30: [1, 1, 2, 2, 2], 40: [2, 3, 3], None: [3, 3, 2]}[budget]
    logprobs, entropies = torch.zeros_like(reference), []
    grads = [torch.zeros_like(p) for p in params]
    batches = micro_batches(rollout.prompt_ids, rollout.completion_ids, rollout.prompt_mask, rollout.completion_mask,
                            plan, tokenizer.pad_token_id, torch.device("cpu"))
    for batch in batches:
        idx = batch.rows
        out, entropy = policy_update.policy_logprobs(module.policy, rollout, batch, module._update_settings(),
                                                     with_entropy=True)
        for g, d in zip(grads, torch.autograd.grad((out * weights[idx]).sum(), params, allow_unused=True)):
            g += 0 if d is None else d
        logprobs[idx] = out.detach()
        entropies.append((idx, entropy))
    torch.testing.assert_close(logprobs, reference.detach(), rtol=0, atol=1e-5)
    # entropy comes back row by row over each micro-batch's completion tokens
    by_row = {int(i): e for idx, entropy in entropies
              for i, e in zip(idx, entropy.split(lengths[idx].tolist()))}
    torch.testing.assert_close(torch.cat([by_row[i] for i in range(8)]), reference_entropy, rtol=0, atol=1e-5)
    for g, r in zip(grads, reference_grads):
        # float32 sums in another order: a few ulps of the largest entry, times the rows summed
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * r.abs().max().item())


def test_token_budget_does_not_change_the_accumulated_gradient(qwen2, tokenizer, prompt_ids, monkeypatch):
    grads, forwards = {}, {}
    for budget in (None, 8):  # 8 tokens: every row alone (each prompt has more than 4 tokens)
        module = make_module(qwen2, tokenizer, update={"micro_batch_size": 8, "micro_batch_tokens": budget})
        calls = []
        spy_function(monkeypatch, policy_update, "policy_logprobs", calls)
        recorder = GradRecorder()
        fit(module, prompt_ids, n_prompts=4, callbacks=[recorder])
        grads[budget], forwards[budget] = recorder.steps[0], len(calls)
    assert forwards == {None: 1, 8: 8}
    for name, g in grads[8].items():
        r = grads[None][name]
        if g is None:
            assert r is None
            continue
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * r.abs().max().item())


# ---------------------------------------------------------------------------------------------------------------
# Warnings


def test_steps_without_any_learning_signal_warn_once(qwen2, tokenizer, prompt_ids):
    from qerl.modules.step_logging import NO_SIGNAL_STEPS

    flat = make_module(qwen2, tokenizer, reward=ScriptedReward([0.7] * 4))  # every group: equal rewards
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(flat, prompt_ids, steps=NO_SIGNAL_STEPS + 3)
    messages = [str(w.message) for w in caught if "No learning signal" in str(w.message)]
    assert len(messages) == 1 and f"for {NO_SIGNAL_STEPS} steps in a row" in messages[0]
    mixed = make_module(qwen2, tokenizer, reward=ScriptedReward([0.7, 0.7, 1.0, 0.0]))  # one group informative
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(mixed, prompt_ids, steps=NO_SIGNAL_STEPS + 1)
    assert not [w for w in caught if "No learning signal" in str(w.message)]


def test_the_update_forward_never_runs_cudnn_attention(qwen2, tokenizer, prompt_ids):
    """cuDNN's SDPA builds a plan per new shape and every step's micro-batches bring new shapes: the update's forward
    runs with it switched off (FlashAttention first), and only there."""
    from qerl.modules.micro_batches import micro_batches

    module = make_module(qwen2, tokenizer, max_new_tokens=3)
    with torch.no_grad():
        rollout = module.rollout.generate(module.policy, prompt_ids, 2, tokenizer.pad_token_id,
                                          [tokenizer.eos_token_id], module.sampling.training_spec(0.0, None))
    seen = []
    decoder = module.policy.get_base_model().get_decoder()
    hook = decoder.layers[0].self_attn.register_forward_pre_hook(lambda *_: seen.append(
        (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())))
    try:
        (batch,) = micro_batches(rollout.prompt_ids, rollout.completion_ids, rollout.prompt_mask,
                                 rollout.completion_mask, [list(range(len(rollout.prompt_ids)))],
                                 tokenizer.pad_token_id, torch.device("cpu"))
        policy_update.policy_logprobs(module.policy, rollout, batch, module._update_settings(), with_entropy=False)
    finally:
        hook.remove()
    assert seen == [(False, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the setting is the update's alone


def test_checkpointed_layers_recompute_attention_with_the_forwards_kernels(qwen2, tokenizer, prompt_ids):
    """With gradient checkpointing the backward runs each layer's forward again: its attention must see the same
    SDPA kernels as the forward (another kernel saves tensors of other shapes, which torch's checkpoint refuses)."""
    module = make_module(qwen2, tokenizer, max_new_tokens=3)
    module.policy.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen = []
    attention = module.policy.get_base_model().get_decoder().layers[0].self_attn
    hook = attention.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        fit(module, prompt_ids)
    finally:
        hook.remove()
    update_calls = 2  # the micro-batch's forward and its recomputation in the backward (the rollout's run eagerly)
    assert len(seen) >= update_calls and seen[-update_calls:] == [False] * update_calls
