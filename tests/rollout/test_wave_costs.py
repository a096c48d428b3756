"""The decode cost model counts, in closed form, what a step-by-step walk of the same stretch counts."""

import random

from qerl.rollout.wave_costs import WaveCosts


def walk(rows, lengths, contexts, decoded):
    """Step by step: a row decodes while its steps last, each step feeding one more column of its own."""
    attended = needed = excess = tokens = 0
    context = list(contexts)
    for j, length in enumerate(lengths):
        attended += rows * length
        for i, d in enumerate(decoded):
            if j < d:
                context[i] += 1
                needed += context[i]
                tokens += 1
        excess = max(excess, length - max(context))
    return attended, needed, excess, tokens


def test_stretch_counts_what_a_step_walk_counts():
    rng = random.Random(0)
    for _ in range(50):
        n, steps = rng.randint(1, 9), rng.randint(1, 20)
        contexts = [rng.randint(1, 300) for _ in range(n)]
        decoded = [rng.randint(0, steps) for _ in range(n)]
        start = max(contexts) + rng.randint(0, 40)
        lengths = [start + j + 1 + rng.randint(0, 7) for j in range(steps)]
        rows = rng.randint(n, 2 * n)
        costs = WaveCosts()
        costs.stretch(rows, lengths, contexts, decoded)
        attended, needed, excess, tokens = walk(rows, lengths, contexts, decoded)
        assert (costs.attended, costs.needed, costs.excess, costs.decoded) == (attended, needed, excess, tokens)
        assert (costs.decode_steps, costs.row_steps) == (steps, rows * steps)


def test_add_sums_counts_and_keeps_the_largest_excess():
    a, b = WaveCosts(attended=10, excess=7, packs=1), WaveCosts(attended=5, excess=3, packs=2)
    a.add(b)
    assert (a.attended, a.excess, a.packs) == (15, 7, 3)
    summary = WaveCosts(decoded=4, row_steps=8, attended=40, needed=20).summary()
    assert (summary["attended_per_token"], summary["attended_per_needed"], summary["idle_row_share"]) == (10, 2, 0.5)

