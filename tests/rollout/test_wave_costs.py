"""The decode cost model counts, in closed form, what a step-by-step walk of the same stretch counts."""

import random

from qerl.rollout.wave_costs import WaveCosts


def walk(rows, lengths, contexts, decoded, starts=None, blocks=None, fed=None):
    """Step by step: a row idles its first ``starts[i]`` steps, then gets its ``blocks[i]`` observation columns, reads
    ``fed[i]`` fed tokens and decodes while its steps last, each step reading one more column of its own."""
    starts, blocks = starts or [0] * len(contexts), blocks or [0] * len(contexts)
    fed = fed or [0] * len(contexts)
    attended = needed = excess = tokens = reads = 0
    context = list(contexts)
    for j, length in enumerate(lengths):
        attended += (rows[j] if isinstance(rows, list) else rows) * length
        for i, d in enumerate(decoded):
            if j == starts[i]:
                context[i] += blocks[i]
            if starts[i] <= j < starts[i] + fed[i] + d:
                context[i] += 1
                needed += context[i]
                tokens += j >= starts[i] + fed[i]
                reads += j < starts[i] + fed[i]
        excess = max(excess, length - max(context))
    return (attended, needed, excess, tokens, reads) if any(fed) else (attended, needed, excess, tokens)


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


def test_rows_resumed_after_lead_steps_count_their_observation_from_their_start():
    rng = random.Random(1)
    for _ in range(50):
        n, steps = rng.randint(1, 9), rng.randint(2, 20)
        contexts = [rng.randint(1, 300) for _ in range(n)]
        starts = [rng.choice([0, rng.randint(1, steps - 1)]) for _ in range(n)]
        blocks = [rng.randint(1, 40) if a else 0 for a in starts]
        decoded = [rng.randint(0, steps - a) for a in starts]
        start = max(c + w for c, w in zip(contexts, blocks)) + rng.randint(0, 40)
        lengths = [start + j + 1 + rng.randint(0, 7) for j in range(steps)]
        costs = WaveCosts()
        costs.stretch(n, lengths, contexts, decoded, starts, blocks)
        assert (costs.attended, costs.needed, costs.excess, costs.decoded) == \
            walk(n, lengths, contexts, decoded, starts, blocks)


def test_fed_rows_count_their_fed_steps_as_context_and_no_tokens():
    rng = random.Random(2)
    for _ in range(50):
        n, steps = rng.randint(1, 9), rng.randint(2, 20)
        contexts = [rng.randint(1, 300) for _ in range(n)]
        fed = [rng.choice([0, rng.randint(1, steps)]) for _ in range(n)]
        fed[0] = max(fed[0], 1)
        decoded = [rng.randint(0, steps - f) for f in fed]
        start = max(contexts) + rng.randint(0, 40)
        lengths = [start + j + 1 + rng.randint(0, 7) for j in range(steps)]
        batches = [n + rng.randint(0, 3) for _ in range(steps)]  # (a check's lag steps ran in the last batch)
        costs = WaveCosts()
        costs.stretch(batches, lengths, contexts, decoded, fed=fed)
        assert (costs.attended, costs.needed, costs.excess, costs.decoded, costs.fed) == \
            walk(batches, lengths, contexts, decoded, fed=fed)
        assert costs.summary()["idle_row_share"] == 1 - (sum(decoded) + sum(fed)) / sum(batches)


def test_add_sums_counts_and_keeps_the_largest_excess():
    a, b = WaveCosts(attended=10, excess=7, packs=1), WaveCosts(attended=5, excess=3, packs=2)
    a.add(b)
    assert (a.attended, a.excess, a.packs) == (15, 7, 3)
    summary = WaveCosts(decoded=4, row_steps=8, attended=40, needed=20).summary()
    assert (summary["attended_per_token"], summary["attended_per_needed"], summary["idle_row_share"]) == (10, 2, 0.5)

