"""A mixture-of-experts policy's routing over multi-turn episodes: the expert choices the engine recorded in each of
an episode loop's calls, laid out over the trajectories the loop returned.

An episode is played by several engine calls: the first samples G turns per prompt, each later one continues the
live trajectories (in trajectory order) from their contexts. Each call's recorder places its tokens in that call's
own ``[context | turn]`` rows. Here every trajectory position takes the choice of the last call that fed it (a call
that prefills the whole context again routes the earlier tokens anew; one that appends to a kept KV cache feeds only
the new tokens). Positions no call fed keep ``NOT_FED``: the last token of the last turn, and any observation an
engine never fed. Router replay leaves those tokens to the trained router and the mismatch skips them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from qerl.model.routing import NOT_FED, RoutingRecorder
from qerl.rollout.base import Rollout, RolloutEngine


class EngineCall(NamedTuple):
    """One engine call of an episode loop: its rows' tokens and the experts its forwards chose."""

    ids: Tensor  # [n, W] long, [left-padded context | turn], on the host
    mask: Tensor  # [n, W] bool, the real tokens
    choices: Tensor | None  # [layers, n, W, k] long, NOT_FED where no token was fed; None: nothing was recorded


class RecordingEngine:
    """A rollout engine that records the expert choices of every ``generate`` call of the engine it wraps (what an
    episode runner calls each turn).

    Args:
        engine: an engine that takes a ``RoutingRecorder`` (``routing=``): the built-in and CUDA-graph engines.
    """

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[EngineCall] = []

    def generate(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, **kwargs) -> Rollout:
        recorder = RoutingRecorder()
        with recorder.recording(policy):
            rollout = self.engine.generate(policy, prompt_ids, group_size, pad_id, eos_ids, spec, routing=recorder,
                                           **kwargs)
        ids = torch.cat((rollout.prompt_ids, rollout.completion_ids), dim=1)
        mask = torch.cat((rollout.prompt_mask, rollout.completion_mask), dim=1).bool()
        self.calls.append(EngineCall(ids.cpu(), mask.cpu(), recorder.choices(*mask.shape)))
        return rollout

    def play_episodes(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, turns) -> None:
        """Every turn through :meth:`generate`, recorded: the resubmitting episodes of any engine (an engine that
        continues episodes in its cache does not record their routing)."""
        RolloutEngine.play_episodes(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, turns)


def episode_choices(calls: list[EngineCall], sequences: list[list[int]], turns: list[int], rollout: Rollout
                    ) -> Tensor | None:
    """The recorded choices in the layout of the episodes' ``rollout``: ``[layers, N, P + L, k]`` over its
    ``[left-padded prompt | turns and observations]`` columns; None when a call recorded nothing.

    Args:
        calls: the loop's engine calls in order.
        sequences: each trajectory's tokens, prompt + every turn and observation (the rollout's real tokens).
        turns: each trajectory's turn count: call ``c >= 1`` continued the trajectories with more than ``c`` turns.
        rollout: the episodes' rollout.

    Raises:
        RuntimeError: a call's rows are not the trajectories the loop's order says (their tokens differ).
    """
    if not calls or any(call.choices is None for call in calls):
        return None
    layers, k = calls[0].choices.shape[0], calls[0].choices.shape[-1]
    device = calls[0].choices.device
    per_row = [torch.full((layers, len(s), k), NOT_FED, dtype=torch.long, device=device) for s in sequences]
    for c, call in enumerate(calls):
        rows = list(range(len(sequences))) if c == 0 else [i for i, n in enumerate(turns) if n > c]
        if len(rows) != call.ids.shape[0]:
            raise RuntimeError(f"expert routing: episode call {c} sampled {call.ids.shape[0]} rows, the trajectories "
                               f"say {len(rows)}.")
        for r, i in enumerate(rows):
            fed = call.ids[r, call.mask[r]]
            n = min(fed.shape[0], len(sequences[i]))  # a turn cut by the episode's token budget is shorter
            if not torch.equal(fed[:n], torch.tensor(sequences[i][:n], dtype=fed.dtype)):
                raise RuntimeError(f"expert routing: episode call {c}'s row {r} is not trajectory {i}'s context.")
            got = call.choices[:, r, call.mask[r].to(device)][:, :n]  # [layers, n, k]
            per_row[i][:, :n] = torch.where(got[..., :1] >= 0, got, per_row[i][:, :n])
    mask = torch.cat((rollout.prompt_mask, rollout.completion_mask), dim=1).bool().to(device)
    out = torch.full((layers, *mask.shape, k), NOT_FED, dtype=torch.long, device=device)
    for i, choices in enumerate(per_row):
        out[:, i, mask[i]] = choices
    return out
