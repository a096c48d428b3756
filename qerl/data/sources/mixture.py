"""``Mixture``: weighted interleaving of sources."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

from qerl.data.sources.base import PromptSource, Row, endless


class Mixture(PromptSource):
    """Interleaves sources at random with the given weights, forever (finite sources restart when they end).

    Args:
        sources: The sources to mix.
        weights: Relative sampling weights, one per source (default: equal).
        seed: Seed of the choice of source.
    """

    infinite = True

    def __init__(self, sources: list[PromptSource], weights: list[float] | None = None, seed: int = 0):
        if not sources:
            raise ValueError("Mixture needs at least one source.")
        weights = [1.0] * len(sources) if weights is None else list(weights)
        if len(weights) != len(sources) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"Mixture weights {weights} must be one non-negative number per source, not all zero.")
        self.sources, self.weights, self.seed = list(sources), weights, seed

    @property
    def stats(self) -> Counter:
        return sum((s.stats for s in self.sources), Counter())

    def __iter__(self) -> Iterator[Row]:
        rng = random.Random(self.seed)
        streams = [endless(s) if not s.infinite else iter(s) for s in self.sources]
        while True:
            (stream,) = rng.choices(streams, weights=self.weights)
            yield next(stream)
