"""The graph engine's captured decode steps: one CUDA graph per key, replayed while the layout it read holds, and the
memory pool they are captured into."""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphCache:
    """Captured decode steps keyed by (batch bucket, length bucket, the spec's temperature and greedy, the fused step's
    layout key or None): the sampling values are baked into a capture, so evaluation (greedy, another temperature) gets
    its own graphs and training's stay valid."""

    def __init__(self):
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.captured = 0  # captures over the engine's life (recaptures count)
        self._pool = None  # made with the buffers the graphs read (CUDA only)

    def get(self, key: tuple) -> torch.cuda.CUDAGraph | None:
        return self.graphs.get(key)

    def capture(self, key: tuple, step: Callable[[], None]) -> None:
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
        stale = [k for k in self.graphs if k[4] is not None and k[4] != layout_key(k[0])]
        for k in stale:
            del self.graphs[k]
        if stale and not self.graphs:
            self.clear()
