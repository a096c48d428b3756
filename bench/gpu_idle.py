"""Where a GPU waits: the gaps between a profiled phase's kernels, each instant of them charged to what the host was
doing then (``update_profiler.py`` writes it beside the phase's kernel and operator tables); and which host ops
launch a phase's device activities (``launchers``: e.g. the thousands of small copies or adds of a step).

A phase whose kernels sum to less than its wall time waits on the host somewhere (launches, Python, a sync that
drained the queue). The tables by operator say where the host spends its time, not which of that time the GPU waits
through: a host op that runs while the queue still holds work costs nothing. Here only the instants no kernel runs
count, and each goes to the innermost host op running then on the thread that started its current op last (the
thread feeding the GPU: the autograd engine's in a backward, the caller's in a forward), and to that op's outermost
op on the same thread (the phase's part: an optimizer step, a backward, a module's forward).

Left out: streams (every device activity the profiler lists, kernels, copies and sets alike, on any stream, makes an
instant busy), and host threads other than the one chosen (a second thread's op running beside it is not charged).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple


class HostOp(NamedTuple):
    """One host operator's interval on one thread (ops of a thread nest: a child lies inside its parent)."""

    start: float
    end: float
    name: str
    thread: int


def idle_intervals(kernels: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The parts of ``window`` that no kernel interval ``[start, end)`` covers, in time order."""
    gaps, reach = [], window[0]
    for start, end in sorted(kernels):
        if start > reach:
            gaps.append((reach, min(start, window[1])))
        reach = max(reach, end)
        if reach >= window[1]:
            break
    if reach < window[1]:
        gaps.append((reach, window[1]))
    return [(a, b) for a, b in gaps if b > a]


def idle_by_host_op(kernels: list[tuple[float, float]], ops: list[HostOp], window: tuple[float, float] | None = None
                    ) -> dict:
    """The GPU's idle time in ``window`` (default: from the first to the last of the kernels and ops) charged to host
    ops: ``{"idle": s, "gaps": n, "innermost": {name: s}, "outermost": {name: s}, "no_host_op": s}`` (time units as
    given)."""
    starts = [k[0] for k in kernels] + [op.start for op in ops]
    ends = [k[1] for k in kernels] + [op.end for op in ops]
    if window is None:
        if not starts:
            return {"idle": 0.0, "gaps": 0, "innermost": {}, "outermost": {}, "no_host_op": 0.0}
        window = (min(starts), max(ends))
    gaps = idle_intervals(kernels, window)
    innermost, outermost = defaultdict(float), defaultdict(float)
    unattributed = 0.0
    # a sweep over the ops' boundaries and the gaps' bounds: per thread a stack of the ops running (they nest)
    opening, closing = defaultdict(list), defaultdict(list)
    ops = [op for op in ops if op.end > op.start]
    for op in sorted(ops, key=lambda op: (op.start, -op.end)):  # a parent before the children it contains
        opening[op.start].append(op)
        closing[op.end].append(op)
    bounds = sorted({t for op in ops for t in (op.start, op.end)} | {t for gap in gaps for t in gap})
    stacks: dict[int, list[HostOp]] = defaultdict(list)
    gap_index = 0
    for here, after in zip(bounds, bounds[1:]):
        for op in closing.get(here, ()):
            stack = stacks[op.thread]
            if op in stack:
                stack.remove(op)
        for op in opening.get(here, ()):
            stacks[op.thread].append(op)
        while gap_index < len(gaps) and gaps[gap_index][1] <= here:
            gap_index += 1
        if gap_index == len(gaps):
            break
        low, high = max(here, gaps[gap_index][0]), min(after, gaps[gap_index][1])
        if high <= low:
            continue
        live = [stack for stack in stacks.values() if stack]
        if not live:
            unattributed += high - low
            continue
        stack = max(live, key=lambda s: s[-1].start)  # the thread that started its current op last
        innermost[stack[-1].name] += high - low
        outermost[stack[0].name] += high - low
    return {"idle": sum(b - a for a, b in gaps), "gaps": len(gaps), "innermost": dict(innermost),
            "outermost": dict(outermost), "no_host_op": unattributed}


def top(charges: dict[str, float], rows: int) -> list[dict]:
    """The ``rows`` largest charges as ``[{"name", "idle_s"}]`` (microseconds in, seconds out)."""
    return [{"name": name, "idle_s": s / 1e6} for name, s in sorted(charges.items(), key=lambda kv: -kv[1])[:rows]]


def launchers(launches: list[tuple[str, tuple[str, ...], float]], rows: int) -> list[dict]:
    """``launches``: ``(device activity name, host op chain innermost first, duration)`` per device activity; the
    ``rows`` most frequent (activity, chain) pairs as ``[{"device", "launched_by", "count", "device_s"}]``
    (microseconds in, seconds out), the chain written ``inner < parent < ...``."""
    counts: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for name, chain, duration in launches:
        entry = counts[(name, " < ".join(chain))]
        entry[0] += 1
        entry[1] += duration
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:rows]
    return [{"device": name, "launched_by": chain, "count": n, "device_s": d / 1e6} for (name, chain), (n, d) in ranked]
