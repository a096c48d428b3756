"""Which experts a mixture-of-experts policy routes each token to: recorded while a rollout samples, compared with
(or imposed on) the training forward.

The sampler (NVFP4 + AQN noise, KV-cached decode steps) and the trained policy (clean norms, one forward over the whole
sequence) can route a token to different experts; the log-prob ratio of the loss then compares two different
networks for that token. Recording the rollout's top-k choices lets the update measure how often that happens, and
router replay (verl, slime and NeMo RL offer it) makes the training forward route each token as the rollout did: the
router still weighs the replayed experts with its own probabilities (renormalized over them where the model does), so
the weights stay a function of the trained policy.

Both work through forward hooks on the routers (transformers' top-k routers return ``(logits, top-k weights, top-k
indices)``): nothing in the model changes, and a dense model has no router to hook.

Layouts: a rollout's choices are ``[layers, N, P + L, k]`` (long) over its rows and the columns of ``[left-padded
prompt | completion]``, -1 where no token was fed (padding, the last sampled token, rows finished early).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch import Tensor

from qerl.model.experts import routers

NOT_FED = -1


def topk_differs(a: Tensor, b: Tensor) -> Tensor:
    """Whether the top-k expert sets ``a [..., k]`` and ``b [..., k]`` differ (order within a set does not count)."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


class RoutingRecorder:
    """Collects the top-k experts every router of a model chose for each token an engine fed through it.

    The engine calls ``place(rows, columns)`` before each forward, saying where that forward's tokens ``[b, c]`` sit in
    the rollout's layout: token ``(i, j)`` belongs to rollout rows ``rows[i]`` (several: a prompt's prefill serves its
    G samples) at column ``columns[j]``. Records are kept as placed and laid out by ``choices`` at the end.
    """

    def __init__(self):
        self._placement: tuple[Tensor, Tensor, Tensor | None] | None = None
        # per router: (rows [b, r], columns [c], choices [b, c, k]) of each hooked forward
        self._records: list[list[tuple[Tensor, Tensor, Tensor]]] = []
        # every router at once: (rows [b, r], columns [c], choices [layers, b, c, k]) of each fused step
        self._steps: list[tuple[Tensor, Tensor, Tensor]] = []

    def place(self, rows: Tensor, columns: Tensor, fed: Tensor | None = None) -> None:
        """The next forward's tokens ``[b, c]``: rollout rows ``rows`` (``[b]`` or ``[b, r]``), columns
        ``columns [c]``; ``fed [b]`` (bool, optional): False for rows whose token is not part of the rollout there
        (an idle row, its own column masked), recorded as ``NOT_FED``."""
        # copies: an engine moves its slots and advances its column in place
        self._placement = (rows.reshape(rows.shape[0], -1).clone(), columns.reshape(-1).clone(),
                           None if fed is None else fed.clone())

    @contextmanager
    def recording(self, model: nn.Module) -> Iterator[RoutingRecorder]:
        """Record every router of ``model`` inside the block (forward hooks, removed on exit)."""
        found = list(routers(model).values())
        self._records, self._steps = [[] for _ in found], []
        handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(found)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._placement = None

    def add(self, choices: Tensor) -> None:
        """Expert choices ``[layers, b * c, k]`` of the placed tokens from an engine's fused step (which routes
        without calling the router modules); copied, as the step overwrites its buffer."""
        if len(self._records) != choices.shape[0]:
            raise RuntimeError(f"RoutingRecorder: {choices.shape[0]} layers of choices for {len(self._records)} "
                               f"routers recorded (add() inside recording(model)).")
        # one copy of every layer's choices per step (a decode step's hot path: no per-layer work)
        rows, columns, index = self._placed(choices.view(choices.shape[0], -1, choices.shape[-1]), 1)
        self._steps.append((rows, columns, index))

    def _append(self, layer: int, index: Tensor) -> None:
        self._records[layer].append(self._placed(index, 0))

    def _placed(self, index: Tensor, row_dim: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(rows, columns, index)`` with the token axis of ``index`` (dim ``row_dim``) laid out as the placement's
        ``[b, c]``, unfed rows marked ``NOT_FED``: a new tensor, as engines overwrite their buffers."""
        if self._placement is None:
            raise RuntimeError("RoutingRecorder: a forward ran before the engine placed its tokens (place()).")
        rows, columns, fed = self._placement
        shape = (*index.shape[:row_dim], rows.shape[0], columns.shape[0], index.shape[-1])
        index = index.reshape(shape)
        if fed is None:
            return rows, columns, index.clone()
        return rows, columns, index.masked_fill(~fed.view(-1, 1, 1), NOT_FED)

    def _hook(self, layer: int):
        def hook(module, args, output):
            self._append(layer, output[2].detach())
        return hook

    def choices(self, rows: int, width: int) -> Tensor | None:
        """The recorded choices as ``[layers, rows, width, k]`` (``NOT_FED`` where no token was fed); None when the
        model has no router or nothing was recorded."""
        first = self._steps[0] if self._steps else self._records[0][0] if self._records and self._records[0] else None
        if first is None:
            return None
        k, device = first[2].shape[-1], first[2].device
        out = torch.full((len(self._records), rows, width, k), NOT_FED, dtype=torch.long, device=device)
        laid = [(out, *step) for step in self._steps]  # every layer at once
        laid += [(out[layer], *record) for layer, records in enumerate(self._records) for record in records]
        for target, target_rows, columns, index in laid:
            keep = columns < width  # the last sampled token's column may lie past a cut completion
            cols = columns[None, keep].to(device)
            for r in range(target_rows.shape[1]):
                target[..., target_rows[:, r, None].to(device), cols, :] = index[..., keep, :]
        return out


class RoutingHooks:
    """Forward hooks on every router of ``model`` until ``remove()``: each forward's own top-k choice ``[tokens, k]``
    is appended to ``own`` (layer after layer) while ``collecting``; with ``replay [layers, tokens, k]`` set (one
    forward's tokens, flattened as the routers see them), each token goes to its replayed experts instead where one is
    given (``NOT_FED`` rows keep their own), weighted by the router's probabilities of those experts.

    Installed across a forward and its backward, a decoder layer that gradient checkpointing recomputes in the
    backward routes as its forward did (with ``collecting`` off by then, its choices are not counted twice)."""

    def __init__(self, model: nn.Module):
        found = list(routers(model).values())
        self.layers = len(found)
        self.own: list[Tensor] = []
        self.collecting = True
        self.replay: Tensor | None = None
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(found)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, weights, index = output
            if self.collecting:
                self.own.append(index.detach())
            if self.replay is None:
                return None
            given = self.replay[layer].to(index.device)
            index = torch.where(given[:, :1] >= 0, given, index)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, index)  # [tokens, k]
            if getattr(module, "norm_topk_prob", False):
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(weights.dtype), index
        return hook


@contextmanager
def routed(model: nn.Module, replay: Tensor | None = None) -> Iterator[list[Tensor]]:
    """``RoutingHooks`` on ``model`` inside the block (``replay``: see there); yields the list of the routers' own
    choices."""
    hooks = RoutingHooks(model)
    if replay is not None and replay.shape[0] != hooks.layers:
        hooks.remove()
        raise ValueError(f"router replay: {replay.shape[0]} layers of choices for {hooks.layers} routers.")
    hooks.replay = replay
    try:
        yield hooks.own
    finally:
        hooks.remove()
