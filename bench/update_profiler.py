"""A callback for benchmarks: torch.profiler over one step's update phase only (``policy_update``, as the module's
step calls it).

    --trainer.callbacks+=update_profiler.UpdateProfiler --trainer.callbacks.out=DIR --trainer.callbacks.name=nvfp4
    (bench/ on the Python path)

Writes ``DIR/update_phase_<device>_<name>.txt`` (kernels by total CUDA time, then operators by host time, then the
GPU's idle time by host operator) and ``DIR/update_phase_<device>_<name>.json``: the phase's wall time, the GPU's busy
time (the union of its kernels' intervals: below the wall time the GPU waits on the host), the top kernels and
operators, ``gpu_idle``: the instants no kernel runs, charged to the host op running then (``gpu_idle.py``), and
``launchers``: the most frequent device activities by the host ops (and their parents) that launched them.

``host=False`` records the kernels alone (no host operators: no operator table, idle charges or launchers): recording
every host operator makes each one slower (tens of thousands of them in a MoE update: the host-bound parts grow), so
the wall time against the GPU's busy time is the phase's own only without them.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import lightning as L
import torch

from gpu_idle import HostOp, idle_by_host_op, launchers, top

LAUNCH_CHAIN = 3  # host ops named per launch: the launching op and its parents


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class UpdateProfiler(L.Callback):
    """Profile the update phase of step ``step`` (0-based batch index).

    Args:
        out: directory for the tables.
        name: file-name tag (e.g. the quantization).
        step: which batch's update to profile (not the first: compilation, autotuning, allocator warm-up).
        rows: rows per table.
        host: also record the host operators (False: the kernels alone, see the module docstring).
    """

    def __init__(self, out: str, name: str = "update", step: int = 1, rows: int = 40, host: bool = True):
        self.out, self.name, self.step, self.rows, self.host = Path(out), name, step, rows, host
        self.original = None  # the module file's own update, while this callback swaps it

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        # the module's step calls its file's ``policy_update``: that name is swapped for this step's batch only
        home = sys.modules[type(pl_module).__module__]
        self.original = self.original or home.policy_update
        if batch_idx != self.step:
            home.policy_update = self.original
            return
        original = self.original
        cuda = pl_module.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def profiled(*args, **kwargs):
            sync()
            host = self.host or not cuda  # (on the CPU the operators are all there is: recorded either way)
            activities = ([torch.profiler.ProfilerActivity.CPU] if host else []) + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=activities) as prof:
                start = time.perf_counter()
                result = original(*args, **kwargs)
                sync()
                wall = time.perf_counter() - start
            self._write(prof, wall, host)
            return result

        home.policy_update = profiled

    def on_train_end(self, trainer, pl_module) -> None:
        if self.original is not None:  # (the profiled step was the last: the process keeps the module's own update)
            sys.modules[type(pl_module).__module__].policy_update = self.original

    def _write(self, prof, wall: float, host: bool) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        averages = prof.key_averages()
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = busy_seconds([(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in kernels])
        idle = idle_by_host_op([(e.time_range.start, e.time_range.end) for e in kernels],
                               [HostOp(e.time_range.start, e.time_range.end, e.name, e.thread) for e in events
                                if e.device_type == torch.autograd.DeviceType.CPU]) if kernels else None
        launches = [(k.name, op_chain(e), k.duration) for e in events
                    if e.device_type == torch.autograd.DeviceType.CPU for k in e.kernels]
        by_cuda = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[: self.rows]
        by_cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[: self.rows] if host else []
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        summary = {
            "device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "name": self.name, "host_ops": host, "wall_s": wall,
            "gpu_busy_s": busy, "kernels": len(kernels),
            "top_cuda": [{"name": e.key, "count": e.count, "self_cuda_s": e.self_device_time_total / 1e6}
                         for e in by_cuda],
            "top_cpu": [{"name": e.key, "count": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6} for e in by_cpu],
            "gpu_idle": None if idle is None else {
                "idle_s": idle["idle"] / 1e6, "gaps": idle["gaps"], "no_host_op_s": idle["no_host_op"] / 1e6,
                "innermost": top(idle["innermost"], self.rows), "outermost": top(idle["outermost"], self.rows)},
            "launchers": launchers(launches, self.rows),
        }
        stem = f"update_phase_{device.split()[1].lower() if len(device.split()) > 1 else device}_{self.name}"
        (self.out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
        (self.out / f"{stem}.txt").write_text(
            f"update phase: wall {wall:.3f} s, GPU busy {busy:.3f} s, {len(kernels)} kernels\n\n"
            + averages.table(sort_by="self_device_time_total", row_limit=self.rows, max_name_column_width=90) + "\n\n"
            + (averages.table(sort_by="self_cpu_time_total", row_limit=self.rows, max_name_column_width=90) if host
               else "(host operators not recorded)")
            + ("" if idle is None else idle_table(summary["gpu_idle"]))
            + launcher_table(summary["launchers"]))
        print(f"update profile ({self.name}): wall {wall:.3f} s, GPU busy {busy:.3f} s", flush=True)


def idle_table(idle: dict) -> str:
    """The ``gpu_idle`` summary as text: the idle time, then its charges by innermost and by outermost host op."""
    lines = [f"\n\nGPU idle {idle['idle_s']:.3f} s in {idle['gaps']} gaps ({idle['no_host_op_s']:.3f} s with no "
             "host op running), charged to the host op running then:"]
    for part in ("innermost", "outermost"):
        lines.append(f"\n  by {part} op:")
        lines += [f"    {row['idle_s']:9.3f} s  {row['name'][:100]}" for row in idle[part]]
    return "\n".join(lines) + "\n"


def op_chain(event) -> tuple[str, ...]:
    """A host op's name and its parents', innermost first (:data:`LAUNCH_CHAIN` of them)."""
    chain = []
    while event is not None and len(chain) < LAUNCH_CHAIN:
        chain.append(event.name)
        event = event.cpu_parent
    return tuple(chain)


def launcher_table(rows: list[dict]) -> str:
    """The ``launchers`` rows as text: the most frequent device activities and the host ops that launched them."""
    if not rows:
        return ""
    lines = ["\n\nDevice activities by the host ops that launched them (most frequent first):"]
    lines += [f"  {row['count']:8d}  {row['device_s']:8.3f} s  {row['device'][:60]}  <-  {row['launched_by'][:140]}"
              for row in rows]
    return "\n".join(lines) + "\n"
