"""A benchmark's method check (bench/timing_method.py): a timing over a graph capture, a compile or a first
allocation, or repeats that disagree, is refused; the probe counts a torch.compile inside a call."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from timing_method import OneTimeWork, method_problems, timed, timed_twice  # noqa: E402


def call(seconds: float, **work) -> dict:
    return {"seconds": seconds, "captures": 0, "compiles": 0, "new_segments": 0, **work}


def test_a_clean_measurement_has_no_problems():
    record = {"short": [call(0.500), call(0.510)], "long": [call(1.200), call(1.190)]}
    assert method_problems(record, "long", "short") == []


def test_the_h200_case_a_capture_inside_the_short_call_is_refused():
    # the decode-peer run whose short call captured a graph: its step looked 3.6x faster than the graph replay
    record = {"short": [call(0.900, captures=1), call(0.500)], "long": [call(1.200), call(1.200)]}
    problems = method_problems(record, "long", "short")
    assert "the short call (repeat 1) ran 1 CUDA graph capture(s) inside its timing" in problems
    assert any("the short call took 0.9000, 0.5000 s" in p for p in problems)


def test_compiles_first_allocations_and_an_inverted_pair_are_refused():
    record = {"short": [call(0.5, compiles=2), call(0.5)], "long": [call(0.4, new_segments=3), call(0.4)]}
    problems = method_problems(record, "long", "short")
    assert any("2 torch.compile graph(s)" in p for p in problems)
    assert any("3 first allocation(s)" in p for p in problems)
    assert "the long call was not slower than the short call" in problems


def test_repeats_within_the_tolerance_pass_and_beyond_it_fail():
    assert method_problems({"a": [call(1.0), call(1.09)]}) == []
    assert method_problems({"a": [call(1.0), call(1.11)]}) != []


def test_the_probe_counts_a_compile_inside_a_call_and_none_after_it():
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    first = timed(lambda: fn(torch.ones(3)))
    again = timed(lambda: fn(torch.ones(3)))
    assert first["compiles"] == 1 and again["compiles"] == 0
    with OneTimeWork() as work:
        pass
    assert (work.captures, work.compiles, work.new_segments) == (0, 0, 0)


def test_timed_twice_warms_every_call_up_first():
    fn = torch.compile(lambda x: x - 1, backend="eager")
    record = timed_twice({"short": lambda: fn(torch.ones(2)), "long": lambda: fn(torch.ones(2, 2))})
    assert [len(v) for v in record.values()] == [2, 2]
    assert all(c["compiles"] == 0 for calls in record.values() for c in calls)  # compiled in the warm-up


def test_the_decode_peer_report_keeps_no_figure_timed_over_a_capture(tmp_path):
    import json

    from bench_decode_peer import merge

    settings = {"rows": [1, 16]}
    clean = {"short_s": 0.2, "long_s": 0.8, "ms_step": 2.5}
    refused = {"short_s": 0.6, "long_s": 0.8, "problems": ["the short call (repeat 1) ran 1 CUDA graph capture(s) "
                                                           "inside its timing"]}
    for arm, rows in (("qerl_nvfp4", {"1": refused, "16": clean}), ("vllm_nvfp4", {"1": clean, "16": clean})):
        (tmp_path / f"{arm}.json").write_text(json.dumps({"settings": settings, "rows": rows, "date": "d",
                                                          "device": "H200"}))
    report = merge(tmp_path, settings)
    one, sixteen = report["rows"]
    assert "ms_step_qerl_nvfp4" not in one and "vllm_nvfp4_over_qerl_nvfp4" not in one  # no ratio over a bad figure
    assert sixteen["vllm_nvfp4_over_qerl_nvfp4"] == 1.0
    assert "CUDA graph capture" in report["errors"]["qerl_nvfp4 rows 1"]
