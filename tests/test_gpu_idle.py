"""bench/gpu_idle.py, the GPU's idle time charged to host ops (``update_profiler.py`` writes it): a hand-worked
timeline, and random nested timelines on an integer grid against a brute force over every unit instant."""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from gpu_idle import HostOp, idle_by_host_op, idle_intervals, launchers, top  # noqa: E402


def test_a_hand_worked_timeline():
    kernels = [(0, 10), (20, 30), (5, 8)]
    ops = [HostOp(0, 40, "step", 1), HostOp(12, 15, "add_", 1), HostOp(14, 18, "backward", 2)]
    assert idle_intervals(kernels, (0, 40)) == [(10, 20), (30, 40)]
    got = idle_by_host_op(kernels, ops)
    # 10-12 step, 12-14 add_ (thread 1's latest), 14-15 and 15-18 backward (thread 2 started its op last), 18-20 and
    # 30-40 step
    assert got["idle"] == 20 and got["gaps"] == 2 and got["no_host_op"] == 0
    assert got["innermost"] == {"step": 14, "add_": 2, "backward": 4}
    assert got["outermost"] == {"step": 16, "backward": 4}
    assert top(got["innermost"], 2) == [{"name": "step", "idle_s": 14e-6}, {"name": "backward", "idle_s": 4e-6}]


def test_no_op_and_no_kernel():
    assert idle_by_host_op([], []) == {"idle": 0.0, "gaps": 0, "innermost": {}, "outermost": {}, "no_host_op": 0.0}
    got = idle_by_host_op([(0, 4)], [HostOp(6, 8, "sync", 0)], window=(0, 10))
    assert got["idle"] == 6 and got["innermost"] == {"sync": 2} and got["no_host_op"] == 4


def nested_ops(rng: random.Random, thread: int, start: int, end: int, depth: int) -> list[HostOp]:
    """Ops tiling parts of ``[start, end)`` on one thread, each with children inside it (bounds may coincide)."""
    ops, t = [], start
    while t < end - 1:
        a = t + rng.randrange(0, 3)
        b = min(end, a + rng.randrange(1, 12))
        if a >= b:
            break
        ops.append(HostOp(a, b, f"t{thread}d{depth}n{rng.randrange(4)}", thread))
        if depth < 3 and b - a > 2:
            ops += nested_ops(rng, thread, a, b, depth + 1)
        t = b
    return ops


def brute_force(kernels, ops, window):
    idle, none = 0, 0
    inner, outer = defaultdict(float), defaultdict(float)
    for t in range(*window):
        mid = t + 0.5
        if any(a <= mid < b for a, b in kernels):
            continue
        idle += 1
        running = defaultdict(list)
        for i, op in enumerate(ops):  # (a child comes after its parent in the list)
            if op.start <= mid < op.end:
                running[op.thread].append((op.start, -op.end, i, op))
        if not running:
            none += 1
            continue
        # per thread: the innermost is the latest start (ties: the shorter, then the child), the outermost the earliest
        inners = {th: max(r)[-1] for th, r in running.items()}
        thread = max(inners, key=lambda th: inners[th].start)
        inner[inners[thread].name] += 1
        outer[min(running[thread])[-1].name] += 1
    return idle, none, dict(inner), dict(outer)


@pytest.mark.parametrize("seed", range(12))
def test_random_timelines_against_a_brute_force(seed):
    rng = random.Random(seed)
    kernels = [(a, a + rng.randrange(1, 15)) for a in (rng.randrange(0, 200) for _ in range(rng.randrange(0, 25)))]
    # the two threads' ops start on even / odd instants: which started last is never a tie
    ops = [op._replace(start=op.start * 2 + th, end=op.end * 2 + th)
           for th in (0, 1) for op in nested_ops(rng, th, 0, 100, 0)]
    window = (0, 202)
    idle, none, inner, outer = brute_force(kernels, ops, window)
    got = idle_by_host_op(kernels, ops, window)
    assert got["idle"] == idle and got["no_host_op"] == none
    assert got["innermost"] == pytest.approx(inner) and got["outermost"] == pytest.approx(outer)


def test_launchers_count_each_activity_by_its_launching_chain():
    launches = [("Memcpy DtoD", ("aten::copy_", "aten::clone", "AccumulateGrad"), 3.0)] * 5 + [
        ("add_kernel", ("aten::add_", "AccumulateGrad"), 2.0)] * 7 + [
        ("Memcpy DtoD", ("aten::copy_", "aten::pad"), 10.0)] * 5
    rows = launchers(launches, 2)
    assert rows == [{"device": "add_kernel", "launched_by": "aten::add_ < AccumulateGrad", "count": 7,
                     "device_s": 14e-6},
                    {"device": "Memcpy DtoD", "launched_by": "aten::copy_ < aten::pad", "count": 5, "device_s": 50e-6}]
