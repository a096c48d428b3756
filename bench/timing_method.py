"""A timed call must time only the work it names: a CUDA graph capture, a torch.compile or a first cudaMalloc that
falls inside it makes the figure wrong (a capture in the shorter of two calls whose difference is timed makes the
step look several times faster). ``OneTimeWork`` counts those inside a call; ``timed_twice`` times each call twice
after a warm-up; ``method_problems`` (a pure function of the record) says what is wrong with a measurement, and a
benchmark writes no figure for a measurement with problems.
"""

from __future__ import annotations

import time
from collections.abc import Callable

REPEAT_TOLERANCE = 0.1  # two timings of the same call may differ by this share; a one-time cost is far larger


class OneTimeWork:
    """Counts, between enter and exit: CUDA graph captures (``torch.cuda.CUDAGraph.capture_begin``, which vLLM's and
    qerl's graphs both go through), graphs compiled by torch.compile (dynamo's ``unique_graphs``) and cudaMalloc
    segments the caching allocator added (``segment.all.allocated``)."""

    def __enter__(self) -> OneTimeWork:
        import torch
        from torch._dynamo.utils import counters

        self.captures = 0
        graph_class = torch.cuda.graphs.CUDAGraph
        self._original = original = graph_class.capture_begin

        def counting(graph, *args, **kwargs):
            self.captures += 1
            return original(graph, *args, **kwargs)

        graph_class.capture_begin = counting
        self._graphs = counters["stats"]["unique_graphs"]
        self._segments = self._segment_count()
        return self

    def __exit__(self, *exc) -> None:
        import torch
        from torch._dynamo.utils import counters

        torch.cuda.graphs.CUDAGraph.capture_begin = self._original
        self.compiles = counters["stats"]["unique_graphs"] - self._graphs
        self.new_segments = self._segment_count() - self._segments

    @staticmethod
    def _segment_count() -> int:
        import torch

        return torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0


def timed(call: Callable[[], object]) -> dict:
    """One call's wall seconds (device work included) and the one-time work inside it."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with OneTimeWork() as work:
        start = time.perf_counter()
        call()
        sync()
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "captures": work.captures, "compiles": work.compiles,
            "new_segments": work.new_segments}


def timed_twice(calls: dict[str, Callable[[], object]]) -> dict[str, list[dict]]:
    """Each named call once untimed (warm-up: graphs, compiles, allocations), then each timed twice in turn."""
    for call in calls.values():
        call()
    record = {name: [] for name in calls}
    for _ in range(2):
        for name, call in calls.items():
            record[name].append(timed(call))
    return record


def method_problems(record: dict[str, list[dict]], longer: str | None = None, shorter: str | None = None,
                    tolerance: float = REPEAT_TOLERANCE) -> list[str]:
    """What makes a measurement wrong, one sentence each (none: the figure may be written).

    Args:
        record: per call name, its timed repeats (``timed``'s dicts).
        longer, shorter: two call names whose difference is the figure: the longer must take longer.
        tolerance: the share by which repeats of a call may differ.
    """
    problems = []
    for name, calls in record.items():
        for i, call in enumerate(calls, 1):
            for key, what in (("captures", "CUDA graph capture(s)"), ("compiles", "torch.compile graph(s)"),
                              ("new_segments", "first allocation(s) (new cudaMalloc segments)")):
                if call.get(key):
                    problems.append(f"the {name} call (repeat {i}) ran {call[key]} {what} inside its timing")
        seconds = [c["seconds"] for c in calls]
        if len(seconds) > 1 and max(seconds) > (1 + tolerance) * min(seconds):
            problems.append(f"the {name} call took {', '.join(f'{s:.4f}' for s in seconds)} s: more than "
                            f"{tolerance:.0%} apart, a one-time cost or another job fell inside one")
    if longer and shorter and min(c["seconds"] for c in record[longer]) <= min(c["seconds"] for c in record[shorter]):
        problems.append(f"the {longer} call was not slower than the {shorter} call")
    return problems


def fastest(record: dict[str, list[dict]], name: str) -> float:
    """The call's fastest repeat, in seconds."""
    return min(c["seconds"] for c in record[name])
