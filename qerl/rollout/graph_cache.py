"""The graph engine's captured decode steps: one CUDA graph per key, replayed while the layout it read holds, and the
memory pool they are captured into."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class GraphKey(NamedTuple):
    """What a captured decode step is for: the sampling values are baked into a capture, so evaluation (greedy,
    another temperature) gets its own graphs and training's stay valid; an episode call's step takes fed tokens."""

    batch: int  # the batch bucket
    length: int  # the length bucket
    temperature: float
    greedy: bool
    feeding: bool  # an episode call's step (``DecodeState.start_feeding``)
    layout: tuple | None  # the fused step's layout key (``FusedDecoder.key``), None for the transformers step


class GraphCache:
    """Captured decode steps by :class:`GraphKey`."""

    def __init__(self):
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.captured = 0  # captures over the engine's life (recaptures count)
        self._pool = None  # made with the buffers the graphs read (CUDA only)

    def get(self, key: GraphKey) -> torch.cuda.CUDAGraph | None:
        return self.graphs.get(key)

    def capture(self, key: GraphKey, step: Callable[[], None]) -> None:
        """Capture ``step`` (already run once eagerly: the warm-up) as the graph of ``key``."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        self.graphs[key] = graph
        self.captured += 1

    def new_pool(self) -> None:
        """A fresh memory pool for the graphs of new buffers."""
        self._pool = torch.cuda.graph_pool_handle()

    def clear(self) -> None:
        """Drop every captured graph, and their memory pool with them: a pool whose graphs are all gone cannot be
        captured into again (the next capture gets a new one)."""
        self.graphs.clear()
        if self._pool is not None:
            self.new_pool()

    def drop_stale(self, layout_key: Callable[[int], tuple]) -> None:
        """Graphs of an earlier layout of what the step reads (this rollout's dense copy elsewhere, an adapter
        toggled, ...; ``layout_key(batch bucket)`` is today's) can never replay again: free them (their pool too when
        none is left)."""
        stale = [k for k in self.graphs if k.layout is not None and k.layout != layout_key(k.batch)]
        for k in stale:
            del self.graphs[k]
        if stale and not self.graphs:
            self.clear()
