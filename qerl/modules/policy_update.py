"""The update of one RL step: ``num_iterations`` optimizer steps over the rows that carry loss, in micro-batches.

    rows with loss --token budget--> micro-batches of rows of similar length (inputs on the device up front)
    (num_iterations > 1: old log-probs first; beta > 0: the reference's, adapter disabled)
    per iteration: per micro-batch  clean log-probs (+ entropy, first iteration) -> loss -> backward
                   (the gradient all-reduce once, on the last micro-batch), clip, optimizer and scheduler step

The Lightning parts are handed in (``UpdateSteps``): the backward, the all-reduce of the token weights, the gradient
clip and the optimizer with its DDP sync toggle; this file knows the policy, the loss and the rollout only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from qerl.model.attention import SDPA_KERNELS
from qerl.model.policy import trainable_parameters
from qerl.modules.logprobs import token_logprobs
from qerl.modules.loss import LossStats, PolicyLoss, global_token_weights
from qerl.modules.micro_batches import MicroBatch, micro_batches, plan_micro_batches
from qerl.rollout.base import Rollout

# wraps the forward of one micro-batch: (model, rollout rows [n], ids [n, T]) -> a context manager
AroundForward = Callable[[Any, Tensor, Tensor], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class UpdateSettings:
    """How the update runs (the module's options): rows and tokens per micro-batch, optimizer steps per rollout,
    LM-head chunk, gradient-norm clip (0: none), the sampling temperature the log-probs are taken at, the pad id."""

    micro_batch_size: int
    micro_batch_tokens: int | None
    num_iterations: int
    logprob_chunk_size: int
    max_grad_norm: float
    temperature: float
    pad_id: int


class UpdateSteps(NamedTuple):
    """What the trainer does for the update: ``optimizer`` (with ``toggle_model(sync_grad=...)``, ``step``,
    ``zero_grad``), its ``scheduler``, ``backward(loss)``, ``all_reduce_sum(tensor)`` over the ranks,
    ``clip_gradients(max_norm)`` and the number of ranks."""

    optimizer: Any
    scheduler: Any
    backward: Callable[[Tensor], None]
    all_reduce_sum: Callable[[Tensor], Tensor]
    clip_gradients: Callable[[float], None]
    world_size: int


class UpdateResult(NamedTuple):
    stats: list[LossStats]  # the last iteration's, one per micro-batch
    entropy: Tensor  # [K] the clean policy's entropy at each completion token that carried loss (first iteration)
    tokens: int  # real tokens (prompt + completion) each iteration ran through the policy


def policy_update(policy, loss: PolicyLoss, rollout: Rollout, advantages: Tensor, loss_mask: Tensor,
                  settings: UpdateSettings, steps: UpdateSteps, around_forward: AroundForward | None = None
                  ) -> UpdateResult:
    """``settings.num_iterations`` optimizer steps of ``loss`` on the rows of ``rollout`` that carry loss;
    ``around_forward(model, rows, ids)`` wraps each forward of a micro-batch (a MoE's routing: ``ExpertRouting``)."""
    device = advantages.device
    rows = loss_mask.sum(-1).nonzero().squeeze(-1)  # rows with any loss token: the others cost nothing
    weights = torch.zeros_like(loss_mask, dtype=torch.float32)  # [N, L], over the whole accumulated batch
    weights[rows] = global_token_weights(loss, loss_mask[rows], steps.world_size,
                                         steps.all_reduce_sum)  # DDP: normalised over every rank's rows
    # Micro-batches of rows of similar length within the token budget (none when no row has loss: a forward
    # over zero rows fails), every one's inputs on the device before the first forward.
    lengths = (rollout.prompt_mask.sum(-1) + rollout.completion_mask.sum(-1))[rows].tolist()
    plan = plan_micro_batches(lengths, settings.micro_batch_tokens, settings.micro_batch_size)
    row_list = rows.tolist()
    chunks = micro_batches(rollout.prompt_ids, rollout.completion_ids, rollout.prompt_mask, rollout.completion_mask,
                           [[row_list[i] for i in batch] for batch in plan], settings.pad_id, device,
                           rollout.model_mask)  # targets: the model's own tokens (tool results stay input)
    old = logprobs_no_grad(policy, rollout, chunks, settings, around_forward) if settings.num_iterations > 1 else None
    ref = None
    if loss.beta > 0:
        with policy.disable_adapter():
            ref = logprobs_no_grad(policy, rollout, chunks, settings, around_forward)
    entropies, stats = [], []
    if not chunks and steps.world_size > 1:  # still join the other ranks' gradient all-reduce
        steps.backward(sum(p.sum() for p in trainable_parameters(policy)) * 0.0)
    for iteration in range(settings.num_iterations):
        stats = []
        for i, batch in enumerate(chunks):
            last, idx = i == len(chunks) - 1, batch.rows
            with steps.optimizer.toggle_model(sync_grad=last):  # one gradient all-reduce per step under DDP
                logprobs, entropy = policy_logprobs(policy, rollout, batch, settings, iteration == 0, around_forward)
                value, st = loss(
                    logprobs,
                    logprobs.detach() if old is None else old[idx],
                    advantages[idx],
                    loss_mask[idx],
                    weights[idx],
                    rollout_logprobs=rollout.logprobs[idx],
                    ref_logprobs=None if ref is None else ref[idx],
                )
                with sdpa_kernel(SDPA_KERNELS):  # checkpointed layers recompute the forward's attention
                    steps.backward(value)
            stats.append(st)
            if entropy is not None:
                entropies.append(entropy)
        if settings.max_grad_norm > 0:
            steps.clip_gradients(settings.max_grad_norm)
        steps.optimizer.step()
        steps.optimizer.zero_grad(set_to_none=True)
        steps.scheduler.step()
    if not rows.numel():
        stats = [LossStats(*(torch.zeros((), device=device) for _ in LossStats._fields))]
    entropy = torch.cat(entropies) if entropies else torch.zeros(0, device=device)
    return UpdateResult(stats, entropy, sum(lengths))


def policy_logprobs(policy, rollout: Rollout, batch: MicroBatch, settings: UpdateSettings, with_entropy: bool,
                    around_forward: AroundForward | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[n, L]`` (0 off the completions) of the completion tokens of the micro-batch's rows under the
    clean policy, and their entropy ``[K]`` (the K completion tokens, row by row) or None."""
    model = policy.get_base_model()  # the transformers model with the LoRA layers injected
    around = around_forward(model, batch.rows, batch.ids) if around_forward else contextlib.nullcontext()
    with forward_context(model), around:  # positions 0..len-1 and a causal mask, as in the rollout
        hidden = model.get_decoder()(input_ids=batch.ids, use_cache=False).last_hidden_state  # [n, T, H]
    logprobs, entropy = token_logprobs(
        hidden[batch.row, batch.position][None],  # [1, K, H]: the LM head sees no padding
        model.get_output_embeddings().weight,
        batch.targets[None],
        temperature=settings.temperature,
        chunk_size=settings.logprob_chunk_size,
        with_entropy=with_entropy,
    )
    out = logprobs.new_zeros(batch.rows.shape[0], rollout.completion_mask.shape[1])
    out = out.index_put((batch.row, batch.col), logprobs[0])  # [n, L]
    return out, None if entropy is None else entropy[0]


@torch.no_grad()
def logprobs_no_grad(policy, rollout: Rollout, chunks: list[MicroBatch], settings: UpdateSettings,
                     around_forward: AroundForward | None = None) -> Tensor:
    out = torch.zeros_like(rollout.logprobs)
    for batch in chunks:
        out[batch.rows] = policy_logprobs(policy, rollout, batch, settings, False, around_forward)[0]
    return out


def forward_context(model) -> contextlib.ExitStack:
    """The update's forward runs the LoRA matrices, trained in fp32 (peft upcasts them), in the model's 16-bit
    dtype, as the rollout runs them (else every adapter call upcasts its input and runs fp32 GEMMs and casts), and
    its attention on any SDPA kernel but cuDNN's: cuDNN builds an execution plan for every new shape (milliseconds
    of host time per call), and each step's micro-batches come in new shapes."""
    stack = contextlib.ExitStack()
    dtype = model.get_input_embeddings().weight.dtype
    if dtype in (torch.bfloat16, torch.float16):
        stack.enter_context(torch.autocast(model.device.type, dtype=dtype))
    stack.enter_context(sdpa_kernel(SDPA_KERNELS))
    return stack
