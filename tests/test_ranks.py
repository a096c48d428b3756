"""Per-rank seeds and per-rank checkpoint state (``qerl.ranks``) in one process; the two-rank behaviour is checked
end to end in ``tests/test_train.py`` (gloo)."""

from qerl.ranks import gather_rank_states, own_rank_state, rank_and_world_size, rank_seed


def test_rank_zero_keeps_the_seed_and_other_ranks_get_distinct_ones():
    assert rank_seed(7, 0) == rank_seed(7) == 7  # one process (rank 0 by default) draws what it always drew
    seeds = {rank_seed(s, r) for s in range(4) for r in range(1, 8)} | set(range(4))
    assert len(seeds) == 4 + 4 * 7  # no two (seed, rank) pairs share a stream
    assert all(0 <= x < 2**63 for x in seeds) and rank_seed(3, 2) == rank_seed(3, 2)


def test_gathered_state_of_one_process_and_older_single_states():
    assert rank_and_world_size() == (0, 1)
    saved = gather_rank_states({"generator": 5})
    assert saved == {"ranks": [{"generator": 5}]} and own_rank_state(saved) == {"generator": 5}
    assert own_rank_state({"generator": 5}) == {"generator": 5}  # a checkpoint written before per-rank states
    assert own_rank_state(None) is None
