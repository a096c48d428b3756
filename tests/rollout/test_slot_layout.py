"""At a check an episode wave moves few slots (each move copies a whole cache row) to put its next batch in front."""

import random

from qerl.rollout.episode_wave import slot_layout


def test_slot_layout_puts_the_batch_in_front_moving_few():
    rng = random.Random(1)
    for _ in range(200):
        slots = rng.randint(1, 12)
        active = rng.sample(range(slots), rng.randint(1, slots))
        resumed = rng.sample(active, rng.randint(0, len(active)))
        running = sorted(set(active) - set(resumed))
        bucket = rng.randint(len(active), slots)
        first, order = slot_layout(running, resumed, bucket, slots)
        assert sorted(order) == list(range(slots))
        assert order[first:first + len(resumed)] == resumed  # side by side, in order
        assert set(running) <= set(order[:bucket])
        moved = sum(order[k] != k for k in range(slots))
        outside = sum(k >= bucket for k in active)
        assert moved <= 2 * (len(resumed) + outside)
    # nothing moves where the batch is already in place
    assert slot_layout([0, 1, 3], [4, 5], 8, 8) == (4, list(range(8)))
