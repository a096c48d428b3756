"""Where a CUDA-graph rollout's wall time goes: each ``generate`` call split into setup, adapter refresh, weight and
cache preparation, prefill, the decode replays of each batch bucket (with their length buckets), graph captures, the
host's checks (and the checks that compact the batch), teardown and the finish (``cut_at_eos`` and the outputs).

    --model.rollout.class_path rollout_phases.TimedForcedLengthRollout   (bench/ on the Python path)
    engine.phase_records   # one breakdown per generate call (``breakdown``)

The engine is marked where a phase or a segment starts: at its phase hook (``_phase``: prefill, decode, check,
capture, captured, done), at a step of another (batch bucket, length bucket) than the last (``_run_step``) and around
the adapter copies (``_adapter_copies``). On CUDA a mark is a CUDA event (no sync: one synchronize when the call
starts and one when it ends); on the CPU, where every step runs eagerly, it is the host clock. Each segment runs from
its mark to the next, so the parts sum to the call's time by construction and every step is counted once (a step that
captures a graph counts under the capture: it runs eagerly, then is captured). A check's segment is the GPU's time from
the end of the steps queued before it to the first step after it: the host's sync, its decision and any compaction.

``profile_steps`` (an engine option) profiles the second call's widest batch bucket: ``torch.profiler`` over that
many of its decode steps (after ``StepWindow.SKIP`` of them), the kernels a step runs and their time beside the
window's ms per step (CUDA events), in that call's record (``profile``), which ``summarize`` then leaves out (the
profiler slows the host).

Each record also says why the call captured what it did (``graph_facts``: the graphs held at its start and at its
first prefill, the engine's clears, and where the decode state was rebuilt, what of its key changed).

``short_context_model`` sets the measured replays beside a model of steps x a short-context ms per step (a decode
benchmark's, per batch bucket): what the replays take over the model is the cost of the longer contexts (attention over
the KV cache) and the rest of the call is what no decode step explains.
"""

from __future__ import annotations

import collections
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from forced_lengths import ForcedLengthRollout
from qerl.rollout.cuda_graph import CUDAGraphRollout

PARTS = ("setup", "adapter_refresh", "prepare", "prefill")  # the parts before the decode buckets, in call order
AFTER = ("captures", "checks", "compactions", "teardown", "finish", "other")  # the parts after them


@dataclass
class Segment:
    """A stretch of one call from its mark to the next one's."""

    kind: str  # setup, adapter_refresh, prepare, prefill, loop, decode, capture, check, teardown, finish, end
    batch: int | None = None  # the batch bucket (decode, capture, check)
    length: int | None = None  # the length bucket (decode, capture)
    steps: int = 0  # decode steps run in it
    clock: object = None  # its mark: a CUDA event, or the host clock's seconds
    seconds: float = 0.0  # to the next mark (set when the call ends)


class PhaseRecording:
    """The marks of one call (see the module docstring); ``close`` gives the segments with their seconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)  # the first event then stands at the host's start
        self.wall_start = time.perf_counter()
        self.segments: list[Segment] = []
        self.graphs: dict[str, int] = {}  # captured steps held at the call's start and at its first prefill
        self.clears = 0  # times the engine dropped all its graphs during the call
        self.state_keys: tuple | None = None  # (old, new) keys of a decode state rebuilt during the call
        self.mark("setup")

    def mark(self, kind: str, batch: int | None = None, length: int | None = None) -> None:
        self.segments.append(Segment(kind, batch, length, 0, _clock(self.cuda)))

    @property
    def last(self) -> Segment:
        return self.segments[-1]

    def step(self, batch: int, length: int) -> None:
        """A decode step of (batch, length) about to run."""
        if (self.last.kind, self.last.batch, self.last.length) != ("decode", batch, length):
            self.mark("decode", batch, length)
        self.last.steps += 1

    def capture(self) -> None:
        """The step just counted captures a graph: it counts under a capture segment."""
        step = self.last
        step.steps -= 1
        self.mark("capture", step.batch, step.length)
        self.last.steps = 1

    def resume(self) -> None:
        """The capture is done: the rest of its bucket's steps replay."""
        self.mark("decode", self.last.batch, self.last.length)

    def close(self) -> tuple[list[Segment], float]:
        """The segments with their seconds, and the call's host wall seconds."""
        self.mark("end")
        if self.cuda:
            self.last.clock.synchronize()
        wall = time.perf_counter() - self.wall_start
        for a, b in zip(self.segments, self.segments[1:]):
            a.seconds = a.clock.elapsed_time(b.clock) / 1e3 if self.cuda else b.clock - a.clock
        return self.segments[:-1], wall


class StepWindow:
    """``torch.profiler`` over ``steps`` decode steps of a call's first (widest) batch bucket, after ``SKIP`` of them
    (its captures): ``result`` holds the kernels per step (CUDA; on the CPU the operators) and the window's ms per
    step, so a slow bucket's kernels can be set beside a decode benchmark's. A bucket that ends first closes it."""

    SKIP = 8

    def __init__(self, steps: int, device: torch.device):
        self.steps, self.cuda = steps, device.type == "cuda"
        self.batch: int | None = None
        self.seen = 0
        self.profiler = self.start = self.result = None
        self.captures = 0  # steps of the window that captured a graph (they run eagerly too)

    def before(self, batch: int) -> None:
        if self.batch is None:
            self.batch = batch
        if batch != self.batch:
            self.close()
        if batch != self.batch or self.result is not None:
            return
        self.seen += 1
        if self.seen == self.SKIP + 1:
            activity = torch.profiler.ProfilerActivity.CUDA if self.cuda else torch.profiler.ProfilerActivity.CPU
            self.profiler = torch.profiler.profile(activities=[activity])
            self.profiler.__enter__()
            self.start = _clock(self.cuda)

    def after(self, batch: int) -> None:
        if self.profiler is not None and batch == self.batch and self.seen >= self.SKIP + self.steps:
            self.close()

    def close(self) -> None:
        """Stop the profiler (if it runs) and tabulate the steps it saw."""
        if self.profiler is None:
            return
        self.steps = max(1, min(self.steps, self.seen - self.SKIP))
        end = _clock(self.cuda)
        if self.cuda:
            end.synchronize()
        self.profiler.__exit__(None, None, None)
        seconds = self.start.elapsed_time(end) / 1e3 if self.cuda else end - self.start
        kind = "CUDA" if self.cuda else "CPU"
        per = collections.defaultdict(lambda: [0, 0.0])
        for e in self.profiler.events():
            if e.device_type.name == kind and (self.cuda or e.cpu_parent is None):  # (CPU: top-level operators)
                row = per[e.name[:90]]
                row[0] += 1
                row[1] += e.device_time if self.cuda else e.cpu_time_total
        rows = sorted(({"kernel": name, "per_step": n / self.steps, "us_per_step": us / self.steps}
                       for name, (n, us) in per.items()), key=lambda r: -r["us_per_step"])
        self.result = {"batch": self.batch, "steps": self.steps, "captures": self.captures,
                       "ms_per_step": 1e3 * seconds / self.steps, "kind": kind,
                       "kernel_ms_per_step": sum(r["us_per_step"] for r in rows) / 1e3, "top": rows[:30]}
        self.profiler = None


def _clock(cuda: bool):
    """A CUDA event recorded now (no sync), or the host clock where the steps run on the CPU."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class PhaseRecorder:
    """A CUDA-graph engine (the next base) whose ``generate`` calls are split into phases (see the module docstring);
    ``phase_records`` holds one ``breakdown`` per call. Multi-turn episode calls are not recorded.

    Args:
        profile_steps: profile this many decode steps of the second call's widest batch bucket (``StepWindow``; 0:
            none).
        **kwargs: the engine's arguments.
    """

    def __init__(self, profile_steps: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.profile_steps = profile_steps
        self.phase_records: list[dict] = []
        self._recording: PhaseRecording | None = None  # the current generate call's
        self._window: StepWindow | None = None  # the profiled call's

    @torch.no_grad()
    def generate(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec, routing=None):
        device = next(policy.parameters()).device
        recording = self._recording = PhaseRecording(device)
        recording.graphs["at_start"] = len(self._graph_cache.graphs)
        self._window = StepWindow(self.profile_steps, device) if self.profile_steps and len(
            self.phase_records) == 1 else None
        try:
            rollout = super().generate(policy, prompt_ids, group_size, pad_id, eos_ids, spec, routing=routing)
        finally:
            self._recording = None
            if self._window is not None:  # (a bucket shorter than the window: what it saw)
                self._window.close()
        try:
            record = breakdown(*recording.close(), check_every=self.check_every)
            record["graphs"] = graph_facts(recording.graphs, recording.clears, recording.state_keys,
                                           record["captures"])
        except Exception as e:  # noqa: BLE001  a record must never stop the training run it times
            record = {"error": repr(e)}
        if self._window is not None:
            record["profiled"] = True
            record["profile"] = self._window.result
            self._window = None
        self.phase_records.append(record)
        return rollout

    def _phase(self, name: str, decode_steps: int = 0) -> None:
        super()._phase(name, decode_steps)
        r = self._recording
        if r is None:
            return
        if name == "capture":
            r.capture()
            if self._window is not None and self._window.profiler is not None:
                self._window.captures += 1
        elif name == "captured":
            r.resume()
        elif name == "check":
            r.mark("check", r.last.batch)
        elif name in ("prefill", "done"):
            r.graphs.setdefault("at_first_prefill", len(self._graph_cache.graphs))
            r.mark("prefill" if name == "prefill" else "finish")
        elif name == "decode":
            r.mark("loop")  # (until the first step: the host entering the loop)

    def _clear_graphs(self) -> None:
        if self._recording is not None:
            self._recording.clears += 1
        super()._clear_graphs()

    def _ensure_state(self, *args, **kwargs):
        before = self._state
        state = super()._ensure_state(*args, **kwargs)
        if self._recording is not None and state is not before:
            self._recording.state_keys = (None if before is None else before.key, state.key)
        return state

    def _run_step(self, s, policy, b: int, length: int, spec) -> None:
        if self._recording is not None:
            self._recording.step(b, length)
        if self._window is not None:
            self._window.before(b)
        super()._run_step(s, policy, b, length, spec)
        if self._window is not None:
            self._window.after(b)

    @contextmanager
    def _adapter_copies(self, policy, params: list, dtype):
        r = self._recording
        if r is None:
            with super()._adapter_copies(policy, params, dtype):
                yield
            return
        r.mark("adapter_refresh")
        with super()._adapter_copies(policy, params, dtype):
            r.mark("prepare")  # the decoder's weights for this call (a bf16 copy of wide steps), the cache, the state
            try:
                yield
            finally:
                r.mark("teardown")


class TimedCUDAGraphRollout(PhaseRecorder, CUDAGraphRollout):
    """``CUDAGraphRollout`` with its calls split into phases (``phase_records``)."""


class TimedForcedLengthRollout(PhaseRecorder, ForcedLengthRollout):
    """``forced_lengths.ForcedLengthRollout`` with its calls split into phases (``phase_records``)."""


STATE_KEY = ("parameters", "top_p", "policy", "kv_dtype", "decoder")  # ``CUDAGraphRollout._ensure_state``'s key


def graph_facts(graphs: dict[str, int], clears: int, state_keys: tuple | None, captures: int) -> dict:
    """Why a call captured what it did: the captured steps held at its start and at its first prefill, the times the
    engine dropped them all (a new decode state, a KV cache at another address, ...), and where the decode state was
    rebuilt, what of its key changed (with the parameters whose storage moved: weights moved out and back between
    rollouts make every graph stale)."""
    facts = {**graphs, "clears": clears, "captures": captures, "state_rebuilt": state_keys is not None}
    if state_keys is not None and state_keys[0] is not None:
        old, new = state_keys
        facts["state_key_changed"] = [name for name, a, b in zip(STATE_KEY, old, new) if a != b]
        if len(old[0]) == len(new[0]):
            facts["parameters_moved"] = sum(a != b for a, b in zip(old[0], new[0]))
    return facts


def decode_part(batch: int) -> str:
    return f"decode b={batch}"


def breakdown(segments: list[Segment], wall_s: float, check_every: int) -> dict:
    """One call's parts (seconds, summing to ``total_s``), its decode per batch bucket and per (batch, length)
    bucket (replays only), and the counts of captures, checks and compactions. A check is a compaction where the step
    after it runs in a smaller batch bucket."""
    parts = dict.fromkeys(PARTS, 0.0)
    buckets: dict[int, dict] = {}
    cells: dict[tuple[int, int], dict] = {}
    counts = {"captures": 0, "checks": 0, "compactions": 0, "prefills": 0}
    capture_steps: dict[int, int] = {}
    for i, seg in enumerate(segments):
        nxt = segments[i + 1] if i + 1 < len(segments) else None
        stepping = nxt is not None and nxt.kind in ("decode", "capture")  # (a check before the wave's first step:
        batch = seg.batch if seg.batch is not None or not stepping else nxt.batch  # its batch is the first step's)
        if seg.kind in ("decode", "capture", "check") and batch is not None:
            bucket = buckets.setdefault(batch, {"batch": batch, "steps": 0, "seconds": 0.0, "captures": 0,
                                                "capture_s": 0.0, "checks": 0, "check_s": 0.0,
                                                "length_min": None, "length_max": None})
        if seg.kind == "decode":
            bucket["steps"] += seg.steps
            bucket["seconds"] += seg.seconds
            if seg.steps:
                lengths = [x for x in (bucket["length_min"], bucket["length_max"], seg.length) if x is not None]
                bucket["length_min"], bucket["length_max"] = min(lengths), max(lengths)
            cell = cells.setdefault((seg.batch, seg.length), {"batch": seg.batch, "length": seg.length, "steps": 0,
                                                              "seconds": 0.0})
            cell["steps"] += seg.steps
            cell["seconds"] += seg.seconds
            parts[decode_part(seg.batch)] = parts.get(decode_part(seg.batch), 0.0) + seg.seconds
        elif seg.kind == "capture":
            bucket["captures"] += 1
            bucket["capture_s"] += seg.seconds
            capture_steps[seg.batch] = capture_steps.get(seg.batch, 0) + seg.steps
            counts["captures"] += 1
            parts["captures"] = parts.get("captures", 0.0) + seg.seconds
        elif seg.kind == "check":
            name = "compactions" if stepping and batch is not None and nxt.batch < batch else "checks"
            counts[name] += 1
            parts[name] = parts.get(name, 0.0) + seg.seconds
            if batch is not None:
                bucket["checks"] += 1
                bucket["check_s"] += seg.seconds
        else:
            counts["prefills"] += seg.kind == "prefill"
            name = seg.kind if seg.kind in PARTS + AFTER else "other"
            parts[name] = parts.get(name, 0.0) + seg.seconds
    ordered = {k: parts[k] for k in PARTS}
    ordered.update({decode_part(b): parts[decode_part(b)] for b in sorted(buckets, reverse=True)
                    if decode_part(b) in parts})
    ordered.update({k: parts.get(k, 0.0) for k in AFTER})
    for bucket in buckets.values():
        bucket["capture_steps"] = capture_steps.get(bucket["batch"], 0)
        bucket["ms_per_step"] = 1e3 * bucket["seconds"] / bucket["steps"] if bucket["steps"] else None
    for cell in cells.values():
        cell["ms_per_step"] = 1e3 * cell["seconds"] / cell["steps"] if cell["steps"] else None
    steps = sum(b["steps"] + b["capture_steps"] for b in buckets.values())
    return {"total_s": sum(ordered.values()), "wall_s": wall_s, "parts": ordered, "decode_steps": steps,
            "check_every": check_every, **counts,
            "buckets": [buckets[b] for b in sorted(buckets, reverse=True)],
            "cells": [cells[k] for k in sorted(cells, key=lambda k: (-k[0], k[1])) if cells[k]["steps"]]}


def interpolated_ms(rows: int, table: dict[int, float]) -> float | None:
    """The ms per step at ``rows`` from a table measured at some row counts: linear between the nearest two, the
    nearest one's outside them (None from an empty table)."""
    known = sorted(table)
    if not known:
        return None
    if rows <= known[0]:
        return table[known[0]]
    if rows >= known[-1]:
        return table[known[-1]]
    hi = next(k for k in known if k >= rows)
    lo = max(k for k in known if k <= rows)
    if hi == lo:
        return table[lo]
    return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)


def own_short_context_table(record: dict) -> dict[int, float]:
    """Each batch bucket's ms per replayed step in its shortest length bucket of the call (a table for
    ``short_context_model`` where no decode benchmark measured the model)."""
    table = {}
    for cell in sorted(record["cells"], key=lambda c: c["length"]):
        table.setdefault(cell["batch"], cell["ms_per_step"])
    return table


def short_context_model(record: dict, table: dict[int, float]) -> dict:
    """The call's decode against steps x the short-context ms per step of ``table`` (rows -> ms, interpolated): per
    batch bucket the model of all its steps, of its replays, and the replays' seconds over their model (``context_s``:
    what the longer contexts cost); ``rest_s``: the call's time beyond the model and the context (prefill, captures
    over their steps' model, checks, setup, ...). ``model_s + context_s + rest_s == total_s``."""
    rows = []
    for bucket in record["buckets"]:
        ms = interpolated_ms(bucket["batch"], table) or 0.0  # (no replayed step anywhere to model from: 0)
        replay_model = bucket["steps"] * ms / 1e3
        rows.append({"batch": bucket["batch"], "short_ms": ms, "steps": bucket["steps"] + bucket["capture_steps"],
                     "model_s": (bucket["steps"] + bucket["capture_steps"]) * ms / 1e3, "replay_s": bucket["seconds"],
                     "context_s": bucket["seconds"] - replay_model})
    model = sum(r["model_s"] for r in rows)
    context = sum(r["context_s"] for r in rows)
    return {"buckets": rows, "model_s": model, "context_s": context, "rest_s": record["total_s"] - model - context}


def mean_parts(records: list[dict]) -> dict[str, float]:
    """The parts' seconds averaged over calls (a part a call lacks counts 0), then ``total_s`` and ``wall_s``."""
    names = list(dict.fromkeys(name for r in records for name in r["parts"]))
    n = max(len(records), 1)
    mean = {name: sum(r["parts"].get(name, 0.0) for r in records) / n for name in names}
    mean["total_s"] = sum(r["total_s"] for r in records) / n
    mean["wall_s"] = sum(r["wall_s"] for r in records) / n
    return mean


def decode_bench_table(report: dict, model: str, quantization: str) -> dict[int, float]:
    """Rows -> ms per step of the graph-replayed fused step in a decode benchmark's report (``bench_moe_decode.py``'s
    JSON: rows of model, quantization, rows, step, ms_step); empty where it has none of ``model`` in
    ``quantization``."""
    return {r["rows"]: r["ms_step"] for r in report.get("rows", []) if r.get("model") == model
            and r.get("quantization") == quantization and r.get("step") == "fused (graphs)"}


def summarize(records: list[dict], table: dict[int, float] | None = None) -> dict:
    """The calls' mean parts, and their mean decode per batch bucket against ``short_context_model`` (``table``: a
    decode benchmark's rows -> ms per step; empty or None: each call's own shortest length bucket per batch
    bucket)."""
    records = [r for r in records if "error" not in r and not r.get("profiled")]
    n = max(len(records), 1)
    models = [short_context_model(r, table or own_short_context_table(r)) for r in records]
    buckets: dict[int, dict] = {}
    for record, model in zip(records, models):
        for bucket, modelled in zip(record["buckets"], model["buckets"]):
            mean = buckets.setdefault(bucket["batch"], {"batch": bucket["batch"], "length_min": None,
                                                        "length_max": None})
            for key in ("steps", "seconds", "capture_steps", "captures", "capture_s", "checks", "check_s"):
                mean[key] = mean.get(key, 0.0) + bucket[key] / n
            for key in ("short_ms", "model_s", "context_s"):
                mean[key] = mean.get(key, 0.0) + modelled[key] / n
            lengths = [x for x in (mean["length_min"], mean["length_max"], bucket["length_min"],
                                   bucket["length_max"]) if x is not None]
            mean["length_min"], mean["length_max"] = (min(lengths), max(lengths)) if lengths else (None, None)
    for mean in buckets.values():
        mean["ms_per_step"] = 1e3 * mean["seconds"] / mean["steps"] if mean["steps"] else None
    return {"calls": len(records), "parts": mean_parts(records),
            **{key: sum(m[key] for m in models) / n for key in ("model_s", "context_s", "rest_s")},
            "short_ms_source": "decode benchmark" if table else "each batch bucket's shortest length bucket",
            "buckets": [buckets[b] for b in sorted(buckets, reverse=True)],
            "graphs": [r["graphs"] for r in records if "graphs" in r]}


def phase_table(summaries: dict[str, dict]) -> list[str]:
    """The lines of a side-by-side table of formats' summaries (``summarize``; an ``outside_generate_s`` key where
    the caller timed the rollout around ``generate``), with bf16 / nvfp4 per part where both are there."""
    formats = list(summaries)
    ratio = {"nvfp4", "bf16"} <= set(formats)
    lines = [f"{'rollout, s (mean of timed calls)':36}" + "".join(f"{q:>10}" for q in formats)
             + (f"{'bf16/nvfp4':>12}" if ratio else "")]
    names = list(dict.fromkeys(k for s in summaries.values() for k in s["parts"]))
    rows = [(k, {q: s["parts"].get(k, 0.0) for q, s in summaries.items()}) for k in names]
    rows += [(k, {q: s.get(k) for q, s in summaries.items()})
             for k in ("outside_generate_s", "model_s", "context_s", "rest_s")]
    for name, values in rows:
        if all(v is None for v in values.values()):
            continue
        line = f"{name:36}" + "".join(f"{v:10.3f}" if v is not None else f"{'':>10}" for v in values.values())
        if ratio and values.get("nvfp4") and values.get("bf16") is not None:
            line += f"{values['bf16'] / values['nvfp4']:12.2f}"
        lines.append(line)
    for q, s in summaries.items():
        for g in s.get("graphs", []):
            changed = (f" (changed: {', '.join(g['state_key_changed']) or 'sizes'}"
                       + (f"; {g['parameters_moved']} parameters moved" if g.get("parameters_moved") else "") + ")"
                       if "state_key_changed" in g else "")
            lines.append(f"{q}: graphs held {g.get('at_start')} at the start, {g.get('at_first_prefill')} at the first "
                         f"prefill; {g['clears']} clears, {g['captures']} captures"
                         + (f"; decode state rebuilt{changed}" if g["state_rebuilt"] else ""))
        lines.append(f"{q}: model = steps x short-context ms per step ({s['short_ms_source']}); per batch bucket:")
        for b in s["buckets"]:
            ms = f"{b['ms_per_step']:.2f}" if b["ms_per_step"] is not None else "-"
            lines.append(f"  b={b['batch']:<4} L {b['length_min']}-{b['length_max']}: {b['steps']:.0f} steps "
                         f"{b['seconds']:.3f} s ({ms} ms/step, short {b['short_ms']:.2f}; context "
                         f"{b['context_s']:+.3f} s), {b['captures']:.0f} captures {b['capture_s']:.3f} s, "
                         f"{b['checks']:.0f} checks {b['check_s']:.3f} s")
    return lines
