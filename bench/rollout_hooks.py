"""The benchmarks' handles on ``CUDAGraphRollout``: its comparison switches (eager steps, the plain launch order, the
mma.sync GEMV, the torch sampling expression) and its timing, through ``qerl.testing.comparison_rollout``, the
engine's subclass that takes them when it is built (a timer too: build the ``PhaseTimer`` first and hand it over as
``phase_hook``); users never set these."""

from __future__ import annotations

import torch

from qerl.testing.comparison_rollout import ComparisonRollout


def engine(use_graphs: bool | None = None, pdl: bool | None = None, wgmma: bool | None = None,
           fused_sampling: bool = True, **options) -> ComparisonRollout:
    """A ``CUDAGraphRollout(**options)`` with the comparison switches set (None: the engine's own choice); without
    ``wide_batch_bf16`` the wide steps run on the bf16 copy where it fits."""
    return ComparisonRollout(use_graphs=use_graphs, pdl=pdl, wgmma=wgmma, fused_sampling=fused_sampling,
                             copy_if_fits=True, **options)


class PhaseTimer:
    """CUDA events at the phases of each call of the engine it is handed to (``engine(phase_hook=timer)``):
    :meth:`timing` of the last call gives prefill_ms, decode_ms, decode_steps, and the part of them spent in the steps
    that captured a graph (capture_ms, capture_steps: each also decodes its token, eagerly)."""

    def __init__(self):
        self.events: dict[str, torch.cuda.Event] = {}
        self.captures: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.decode_steps = 0

    def __call__(self, phase: str, decode_steps: int) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if phase == "prefill":
            self.events, self.captures = {}, []
        if phase == "capture":
            self.captures.append((event, event))
        elif phase == "captured":
            self.captures[-1] = (self.captures[-1][0], event)
        else:
            self.events[phase] = event
        if phase == "done":
            self.decode_steps = decode_steps

    def timing(self) -> dict[str, float]:
        self.events["done"].synchronize()
        e = self.events
        return {"prefill_ms": e["prefill"].elapsed_time(e["decode"]), "decode_ms": e["decode"].elapsed_time(e["done"]),
                "decode_steps": self.decode_steps,
                "capture_ms": sum(a.elapsed_time(b) for a, b in self.captures), "capture_steps": len(self.captures)}
