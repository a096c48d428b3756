"""A mixture-of-experts policy's routing across the RL step: the rollout's expert choices recorded, compared with the
training forward's (``train/router_mismatch_frac``), and optionally replayed in it (router replay).

One object, handed to ``GRPOModule`` (``model.expert_routing``), sits at the step's two seams: ``sample`` wraps the
engine's ``generate`` (an engine that can say where its tokens go records the choices), ``forward`` wraps each
training forward of a micro-batch (its own choices are compared with the rollout's, or replaced by them). A dense
policy, or an engine that cannot record (vLLM), leaves both as plain calls. ``play`` records multi-turn episodes:
every engine call of the episode loop, laid out over the trajectories (``qerl.modules.episode_routing``).

Mismatch: over the generated tokens the rollout fed through the model (every completion token but the last; in an
episode the model's own tokens, not the observations) and every MoE layer, the fraction of (token, layer) pairs whose top-k expert set differs between the sampler and the update's
forwards (``train/router_mismatch_frac``), and the fraction of those tokens with a difference in any layer
(``train/router_mismatch_token_frac``). With replay on, the update's own choice is still what is compared: the
metric says how far the replayed routing is from the one the trained policy would pick.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from qerl.model.experts import routers
from qerl.model.routing import NOT_FED, RoutingHooks, RoutingRecorder, topk_differs
from qerl.modules.episode_routing import RecordingEngine, episode_choices
from qerl.modules.micro_batches import right_align
from qerl.rollout.base import Rollout
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.sampling_spec import SamplingSpec


class ExpertRouting:
    """How the update treats a mixture-of-experts policy's routing (nothing to do for a dense policy).

    Args:
        replay: router replay: the training forward routes each prompt and generated token to the experts the rollout
            chose (weighted by the trained router's probabilities of them) instead of its own top-k. Off by default:
            on a tiny MoE (``docs/experiments/moe_router_replay.py``) the routing differs only where AQN's noise moves
            it, and replaying it closes a small part of the sampler / trainer log-prob gap that the loss's
            importance weights correct anyway, while training a routing the clean policy would not take.
    """

    def __init__(self, replay: bool = False):
        self.replay = replay
        self._choices: Tensor | None = None  # [layers, N, P + L, k] of this step's rollout
        self._masks: Tensor | None = None  # [N, P + L] its real tokens
        self._trained: Tensor | None = None  # [N, P + L] the tokens the policy sampled (the model's, in an episode)
        self._samples = 0  # rollouts since the last update (refills add some)
        # differing pairs, pairs, tokens differing in any layer, tokens compared: on the device until ``metrics``
        self._counts: Tensor | None = None
        self._hooks: RoutingHooks | None = None  # on the policy during an update with recorded choices
        self._moe: tuple[weakref.ref, bool] | None = None  # (policy, has routers): its module tree walked once

    def sample(self, engine, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int,
               eos_ids: list[int], spec: SamplingSpec) -> Rollout:
        """``engine.generate(...)``, recording the expert choices where the policy has routers and the engine can."""
        recorder = RoutingRecorder() if self._records(engine, policy) else None
        self._samples += 1
        if recorder is None:
            self._choices = None
            return engine.generate(policy, prompt_ids, group_size, pad_id, eos_ids, spec)
        with recorder.recording(policy):
            rollout = engine.generate(policy, prompt_ids, group_size, pad_id, eos_ids, spec, routing=recorder)
        rows, width = rollout.prompt_mask.shape[0], rollout.prompt_mask.shape[1] + rollout.completion_mask.shape[1]
        self._keep(rollout, recorder.choices(rows, width))
        return rollout

    def play(self, play: Callable, engine, policy):
        """``play(engine)``: an episode runner's whole episodes over ``engine`` (-> ``Episodes``), recording the expert
        choices of every turn where ``sample`` would. Each trajectory token gets the routing of the last engine call
        that fed it; a token no call fed keeps its own routing in a replay and is left out of the mismatch."""
        self._samples += 1
        if not self._records(engine, policy):
            self._choices = None
            return play(engine)
        recording = RecordingEngine(engine)
        episodes = play(recording)
        trajectories = episodes.trajectories
        self._keep(episodes.rollout, episode_choices(recording.calls, [t.prompt + t.tokens for t in trajectories],
                                                     [t.turns for t in trajectories], episodes.rollout))
        return episodes

    def _keep(self, rollout: Rollout, choices: Tensor | None) -> None:
        """This step's choices ``[layers, N, P + L, k]`` over ``rollout``'s columns, for the update."""
        self._choices = choices
        self._masks = torch.cat((rollout.prompt_mask, rollout.completion_mask), dim=1)
        self._trained = torch.cat((torch.zeros_like(rollout.prompt_mask), rollout.model_mask), dim=1).bool()

    @contextlib.contextmanager
    def update(self, model) -> Iterator[None]:
        """Around the update of the rollouts sampled since the last one (refills: their layouts differ, so their
        choices are dropped and a replay refused): the routers' hooks stay on ``model`` through every forward and
        backward (a checkpointed layer recomputed in the backward routes as in its forward)."""
        if self._samples > 1:
            if self.replay:
                raise ValueError("model.expert_routing.replay needs one rollout per step: set "
                                 "model.dapo.max_refill_rounds to 0 (refilled batches join rollouts of other layouts).")
            self._choices = None
        self._samples = 0
        self._counts = None
        self._hooks = RoutingHooks(model) if self._choices is not None else None
        try:
            yield
        finally:
            if self._hooks is not None:
                self._hooks.remove()
            self._hooks = None

    @contextlib.contextmanager
    def forward(self, model, rows: Tensor, ids: Tensor) -> Iterator[None]:
        """Around one training forward (inside ``update``) of the rollout rows ``rows [n]`` as the micro-batch
        ``ids [n, T]`` holds them (each row's real tokens moved to the front, ``qerl.modules.micro_batches``)."""
        hooks = self._hooks
        if hooks is None:
            yield
            return
        choices, completion = self._aligned(rows.to(self._choices.device), ids.shape[1])  # [layers, n, T, k], [n, T]
        hooks.replay = choices.flatten(1, 2) if self.replay else None  # kept for the backward's recomputation
        hooks.own.clear()
        hooks.collecting = True
        try:
            yield
        finally:
            hooks.collecting = False
        if torch.is_grad_enabled() and hooks.own:  # the policy-gradient forwards (not the old / reference log-probs)
            mine = torch.stack(hooks.own[: choices.shape[0]]).view_as(choices)
            compared = completion & (choices[..., 0] != NOT_FED)  # [n, T]: generated tokens the rollout fed
            differs = topk_differs(mine, choices) & compared  # [layers, n, T]
            counts = torch.stack([differs.sum(), compared.sum() * choices.shape[0], differs.any(0).sum(),
                                  compared.sum()])  # no host sync per micro-batch
            self._counts = counts if self._counts is None else self._counts + counts

    def metrics(self) -> dict[str, float]:
        """This step's mismatch fractions (empty when nothing was compared)."""
        if self._counts is None:
            return {}
        differing, pairs, tokens_differing, tokens = self._counts.tolist()
        if not pairs:
            return {}
        return {"train/router_mismatch_frac": differing / pairs,
                "train/router_mismatch_token_frac": tokens_differing / tokens}

    def _records(self, engine, policy) -> bool:
        """Whether this rollout's choices can be recorded: the policy has routers and the engine places its tokens
        (the built-in engines; the graph engine's fused MoE step writes them from its captured steps too)."""
        return (isinstance(engine, BuiltinRollout) or _is_graph_engine(engine)) and self._has_routers(policy)

    def _has_routers(self, policy) -> bool:
        """Whether ``policy`` is a MoE, found once per policy (not a module-tree walk every step)."""
        if self._moe is None or self._moe[0]() is not policy:
            self._moe = (weakref.ref(policy), bool(routers(policy)))
        return self._moe[1]

    def _aligned(self, rows: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """The rollout's choices of ``rows`` in the micro-batch's layout ``[layers, n, width, k]`` (``NOT_FED`` past
        each row's tokens), and which of those positions hold tokens the policy sampled ``[n, width]``."""
        masks = self._masks[rows.to(self._masks.device)]
        columns = torch.arange(masks.shape[1], device=masks.device).expand_as(masks)
        source, lengths = right_align(columns, masks, 0)  # [n, width]: each aligned position's rollout column
        if source.shape[1] != width:
            raise RuntimeError(f"router replay: the micro-batch is {width} tokens wide, the rollout's rows "
                               f"{source.shape[1]}.")
        inside = torch.arange(width, device=masks.device)[None] < lengths[:, None]
        source = source.to(self._choices.device)
        choices = self._choices[:, rows[:, None], source]  # [layers, n, width, k]
        choices = choices.masked_fill(~inside.to(choices.device)[None, ..., None], NOT_FED)
        trained = self._trained[rows.to(self._trained.device)].gather(1, source.to(self._trained.device))
        return choices, (inside & trained.to(inside.device)).to(choices.device)


def _is_graph_engine(engine) -> bool:
    from qerl.rollout.cuda_graph import CUDAGraphRollout

    return isinstance(engine, CUDAGraphRollout)
