"""The rollout breakdown of the e2e benchmark (bench/rollout_phases.py): on the CPU, where the graph engine runs its
steps eagerly, the parts of a forced-length rollout sum to its time, its steps fall in the batch and length buckets
its drawn lengths imply, each step once, and every check is counted; the summary and model are checked on
hand-built records."""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from rollout_phases import (  # noqa: E402
    Segment,
    StepWindow,
    TimedForcedLengthRollout,
    breakdown,
    interpolated_ms,
    phase_table,
    short_context_model,
    summarize,
)

from qerl.model.policy import build_policy  # noqa: E402
from qerl.model.routing import RoutingRecorder  # noqa: E402
from qerl.rollout.sampling_spec import SamplingSpec  # noqa: E402
from qerl.testing.tiny_models import save_tiny_model  # noqa: E402

PAD, EOS = 0, 7
PROMPTS = [[5, 9, 11], [12, 13], [3, 4, 5, 6]]


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"])
def policy(request, tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param, vocab_size=64, hidden_size=64)
    return build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32")


def expected_schedule(lengths: list[int], prompt_width: int, new: int, check_every: int, length_bucket: int,
                      min_bucket: int = 1) -> tuple[Counter, int, int]:
    """(batch bucket, length bucket) -> decode steps, the checks and the compactions of one wave whose rows end after
    ``lengths`` tokens (the first from the prefill), as the engine's docstring describes its schedule."""
    rows = len(lengths)
    buckets = sorted({rows} | {2**k for k in range(rows.bit_length()) if min_bucket <= 2**k < rows})
    cap = math.ceil((prompt_width + new) / length_bucket) * length_bucket
    cells, batch, t, checks, compactions = Counter(), rows, 1, 0, 0
    while t < new:
        if t % check_every == 0:  # after t tokens, the rows with more to sample are alive
            checks += 1
            alive = sum(n > t for n in lengths)
            if alive == 0:
                break
            smaller = next(b for b in buckets if b >= alive)
            compactions += smaller < batch
            batch = min(batch, smaller)
        cells[batch, min(cap, math.ceil((prompt_width + t) / length_bucket) * length_bucket)] += 1
        t += 1
    return cells, checks, compactions


@pytest.mark.parametrize("wave_rows", [None, 8])
def test_a_rollouts_parts_sum_to_its_time_and_its_steps_fall_where_its_lengths_say(policy, wave_rows):
    engine = TimedForcedLengthRollout(length_median=10, length_sigma=0.8, check_every=4, length_bucket=8,
                                      wave_rows=wave_rows, fused=True)
    spec = SamplingSpec(max_new_tokens=40, temperature=1.0, seed=1, stream="separate")
    routing = RoutingRecorder() if policy.get_base_model().config.model_type == "qwen3_moe" else None
    for _ in range(2):  # the second call reuses the state
        start = time.perf_counter()
        if routing is None:
            r = engine.generate(policy, PROMPTS, 4, PAD, [EOS], spec)
        else:
            with routing.recording(policy):
                r = engine.generate(policy, PROMPTS, 4, PAD, [EOS], spec, routing=routing)
        outside = time.perf_counter() - start
        record = engine.phase_records[-1]
        parts = record["parts"]
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(record["total_s"], rel=1e-12, abs=1e-12)
        assert record["total_s"] <= record["wall_s"] <= outside  # the marks lie inside the call
        assert {"setup", "adapter_refresh", "prepare", "prefill", "finish", "teardown"} <= set(parts)

        lengths = r.lengths.tolist()
        waves = [range(0, 12)] if wave_rows is None else [range(0, 8), range(8, 12)]  # whole groups of 4 rows
        schedules = [expected_schedule([lengths[i] for i in w], 4, 40, 4, 8) for w in waves]
        expected = sum((cells for cells, _, _ in schedules), Counter())
        assert {(c["batch"], c["length"]): c["steps"] for c in record["cells"]} == dict(expected)
        assert record["decode_steps"] == sum(expected.values())  # each step once
        assert record["prefills"] == len(waves)
        assert [b["batch"] for b in record["buckets"]] == sorted({b for b, _ in expected}, reverse=True)
        assert {name for name in parts if name.startswith("decode b=")} == {f"decode b={b}" for b, _ in expected}
        for bucket in record["buckets"]:
            cells = [length for b, length in expected if b == bucket["batch"]]
            assert (bucket["length_min"], bucket["length_max"]) == (min(cells), max(cells))
        # the engine tells its hook of every check
        assert record["checks"] + record["compactions"] == sum(checks for _, checks, _ in schedules)
        assert record["compactions"] == sum(compactions for _, _, compactions in schedules)
        assert record["captures"] == 0 and parts["captures"] == 0.0  # (eager on the CPU)


def segments(*spec) -> list[Segment]:
    return [Segment(kind, batch, length, steps, None, seconds) for kind, batch, length, steps, seconds in spec]


def test_a_capture_counts_its_step_once_and_a_check_before_a_smaller_bucket_is_a_compaction():
    record = breakdown(segments(("setup", None, None, 0, 0.5), ("prefill", None, None, 0, 1.0),
                                ("loop", None, None, 0, 0.25), ("decode", 8, 256, 0, 0.0),
                                ("capture", 8, 256, 1, 2.0), ("decode", 8, 256, 15, 3.0), ("check", 8, None, 0, 0.25),
                                ("decode", 8, 512, 16, 4.0), ("check", 8, None, 0, 0.5), ("capture", 2, 512, 1, 1.0),
                                ("decode", 2, 512, 3, 0.5), ("check", 2, None, 0, 0.125),
                                ("teardown", None, None, 0, 0.125), ("finish", None, None, 0, 0.25)), 13.6, 16)
    assert record["total_s"] == 13.5 and record["wall_s"] == 13.6
    assert record["parts"]["decode b=8"] == 7.0 and record["parts"]["decode b=2"] == 0.5
    assert record["parts"]["captures"] == 3.0 and record["captures"] == 2
    assert (record["checks"], record["parts"]["checks"]) == (2, 0.375)
    assert (record["compactions"], record["parts"]["compactions"]) == (1, 0.5)
    assert record["parts"]["other"] == 0.25 and record["decode_steps"] == 36
    b8, b2 = record["buckets"]
    assert (b8["steps"], b8["capture_steps"], b8["ms_per_step"], b8["length_min"], b8["length_max"]) == \
        (31, 1, 1e3 * 7.0 / 31, 256, 512)
    assert (b2["steps"], b2["capture_steps"], b2["checks"], b2["check_s"]) == (3, 1, 1, 0.125)
    assert [(c["batch"], c["length"], c["steps"]) for c in record["cells"]] == [(8, 256, 15), (8, 512, 16),
                                                                               (2, 512, 3)]

    model = short_context_model(record, {1: 0.1, 16: 0.4})  # 2 rows: 0.12 ms, 8 rows: 0.24 ms a step
    assert model["model_s"] == pytest.approx(32 * 0.24e-3 + 4 * 0.12e-3)
    assert model["buckets"][0]["context_s"] == pytest.approx(7.0 - 31 * 0.24e-3)
    assert model["model_s"] + model["context_s"] + model["rest_s"] == pytest.approx(record["total_s"])


def test_a_check_before_the_first_step_takes_that_steps_bucket():
    record = breakdown(segments(("loop", None, None, 0, 0.1), ("check", None, None, 0, 0.2),
                                ("decode", 4, 8, 1, 0.3), ("finish", None, None, 0, 0.1)), 0.7, 1)
    assert record["checks"] == 1 and record["buckets"][0]["checks"] == 1


def test_the_short_context_table_is_interpolated_in_rows():
    table = {1: 4.5, 16: 5.5, 64: 9.5, 128: 11.5}
    assert interpolated_ms(1, table) == 4.5 and interpolated_ms(128, table) == 11.5
    assert interpolated_ms(256, table) == 11.5  # (the nearest measured one outside them)
    assert interpolated_ms(32, table) == pytest.approx(5.5 + 4.0 * 16 / 48)
    assert interpolated_ms(96, table) == pytest.approx(10.5)
    assert interpolated_ms(8, {}) is None


def test_a_breakdown_that_fails_is_recorded_and_the_rollout_goes_on(policy, monkeypatch):
    def failing(*args, **kwargs):
        raise ZeroDivisionError("a bug in the breakdown")

    monkeypatch.setattr("rollout_phases.breakdown", failing)
    engine = TimedForcedLengthRollout(length_median=4, check_every=2, length_bucket=8)
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, seed=1, stream="separate")
    r = engine.generate(policy, PROMPTS[:1], 2, PAD, [EOS], spec)
    assert r.completion_ids.shape[0] == 2
    assert engine.phase_records == [{"error": "ZeroDivisionError('a bug in the breakdown')"}]
    assert summarize(engine.phase_records)["calls"] == 0  # left out of the summary


def record_of(decode_s: float, prefill_s: float) -> dict:
    return breakdown(segments(("setup", None, None, 0, 0.5), ("prefill", None, None, 0, prefill_s),
                              ("decode", 4, 8, 10, decode_s), ("finish", None, None, 0, 0.5)), 0.0, 16)


def test_the_summary_averages_calls_and_the_table_sets_formats_side_by_side(tmp_path):
    import bench_train_e2e

    nvfp4 = summarize([record_of(1.0, 0.25), record_of(3.0, 0.75)])
    assert nvfp4["parts"]["decode b=4"] == 2.0 and nvfp4["parts"]["total_s"] == 3.5
    assert nvfp4["buckets"][0]["steps"] == 10 and nvfp4["buckets"][0]["ms_per_step"] == 200.0
    report = {"device": "NVIDIA H200", "rows": [
        {"model": "m", "quantization": "bf16", "rows": 4, "step": "fused (graphs)", "ms_step": 50.0},
        {"model": "m", "quantization": "bf16", "rows": 4, "step": "transformers (eager)", "ms_step": 900.0}]}
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(report))
    results = {"nvfp4": {"rollout_s": 4.0, "rollout_phases": [record_of(2.0, 0.5)]},
               "bf16": {"rollout_s": 6.0, "rollout_phases": [record_of(4.0, 0.5)]}}
    summaries = bench_train_e2e.rollout_phases_summaries(results, str(path), "m", "NVIDIA H200")
    assert summaries["nvfp4"]["short_ms_source"] != "decode benchmark"  # none of nvfp4 in the report: its own
    assert summaries["nvfp4"]["context_s"] == 0.0 and summaries["nvfp4"]["outside_generate_s"] == 0.5
    assert summaries["bf16"]["short_ms_source"] == "decode benchmark"  # the graph-replayed row
    assert summaries["bf16"]["model_s"] == 0.5 and summaries["bf16"]["context_s"] == 3.5
    other = bench_train_e2e.rollout_phases_summaries(results, str(path), "m", "NVIDIA H100 80GB HBM3")
    assert other["bf16"]["short_ms_source"] != "decode benchmark"  # another device's figures are not used
    lines = phase_table(summaries)
    assert lines[0].split()[-3:] == ["nvfp4", "bf16", "bf16/nvfp4"]
    decode = next(line for line in lines if line.startswith("decode b=4"))
    assert decode.split()[-3:] == ["2.000", "4.000", "2.00"]
    assert any(line.startswith("  b=4") and "10 steps" in line for line in lines)


def test_the_e2e_command_builds_the_timed_engine_through_the_cli(no_model_loads, tmp_path, monkeypatch):
    import bench_train_e2e
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule
    from qerl.testing.random_models import qwen25_config

    monkeypatch.chdir(tmp_path)
    qwen25_config("qwen2.5-7b").save_pretrained(tmp_path / "model")
    for lengths in ("fixed", "lognormal"):
        engine = bench_train_e2e.ENGINES["cuda_graph"][lengths]
        cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[
            "--config", str(ROOT / "configs" / "gpu.yaml"), "--model.policy.model", str(tmp_path / "model"),
            "--trainer.accelerator", "cpu", "--memory_plan_device_gb", "79", "--model.rollout.class_path", engine,
            "--model.rollout.init_args.kv_cache_dtype", "auto"])
        assert type(cli.model.rollout).__name__ == engine.split(".")[-1]
        assert cli.model.rollout.phase_records == [] and cli.model.rollout.wave_rows is not None  # planned
    assert isinstance(cli.model.rollout, TimedForcedLengthRollout) and cli.model.rollout.length_median == 400.0


def test_the_e2e_wall_time_of_a_step_is_the_gap_before_its_log_from_the_first_timed_step():
    import bench_train_e2e

    assert bench_train_e2e.step_wall_s([0.0, 10.0, 13.0, 20.0], 1) == 7.0  # steps 1-3: 10, 3, 7
    assert bench_train_e2e.step_wall_s([0.0, 10.0, 13.0, 20.0], 2) == 5.0  # steps 2-3
    assert bench_train_e2e.step_wall_s([5.0], 1) is None


def test_a_fit_with_the_timed_engine_records_each_steps_rollout_inside_its_logged_time(tiny_model_dirs, tmp_path,
                                                                                       monkeypatch):
    """Through ``train.py fit`` as the e2e benchmark runs it (the tiny MoE's fused step, its expert choices recorded):
    one breakdown per step, each inside the step's ``perf/rollout_s`` (which also times the routing records and the
    detokenizing around ``generate``: the e2e's ``outside_generate_s``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qerl.cli import cli_main

    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--model.policy.model",
                    str(tiny_model_dirs["qwen3_moe"]), "--trainer.logger.init_args.save_dir", str(tmp_path),
                    "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
                    "--model.rollout.class_path", "rollout_phases.TimedForcedLengthRollout",
                    "--model.rollout.init_args.fused", "true", "--model.rollout.init_args.length_median", "4",
                    "--model.rollout.init_args.check_every", "2", "--model.sampling.max_new_tokens", "12"])
    events = EventAccumulator(str(cli.trainer.log_dir))
    events.Reload()
    rollout_s = [e.value for e in events.Scalars("perf/rollout_s")]
    records = cli.model.rollout.phase_records
    assert len(records) == len(rollout_s) == 2
    for record, logged in zip(records, rollout_s):
        assert 0 < record["total_s"] <= logged
        assert record["decode_steps"] >= 1 and record["prefills"] == 1
    # the e2e's wall time of the second step: from the first step's log to its own, so past its rollout and update
    import bench_train_e2e

    wall = bench_train_e2e.step_wall_s([e.wall_time for e in events.Scalars("perf/rollout_s")], 1)
    train_s = events.Scalars("perf/train_s")[1].value
    assert wall >= rollout_s[1] + train_s


def test_the_record_says_when_the_decode_state_was_rebuilt_and_what_of_its_key_changed(policy):
    engine = TimedForcedLengthRollout(length_median=4, check_every=2, length_bucket=8)
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, seed=1, stream="separate")
    engine.generate(policy, PROMPTS[:1], 2, PAD, [EOS], spec)
    first = engine.phase_records[-1]["graphs"]
    assert first["state_rebuilt"] and "state_key_changed" not in first and first["at_start"] == 0
    engine.generate(policy, PROMPTS[:1], 2, PAD, [EOS], spec)
    assert not engine.phase_records[-1]["graphs"]["state_rebuilt"]  # the same request: the state is kept
    engine.generate(policy, PROMPTS, 2, PAD, [EOS], spec)
    grown = engine.phase_records[-1]["graphs"]
    assert grown["state_rebuilt"] and grown["state_key_changed"] == [] and grown["clears"] >= 1  # more rows
    lora = next(p for name, p in policy.named_parameters() if "lora_A" in name)
    original = lora.data
    try:
        lora.data = original.clone()  # its storage moves (as weights moved out and back between rollouts)
        engine.generate(policy, PROMPTS, 2, PAD, [EOS], spec)
    finally:
        lora.data = original
    moved = engine.phase_records[-1]["graphs"]
    assert moved["state_key_changed"] == ["parameters"] and moved["parameters_moved"] == 1
    lines = phase_table({"nvfp4": summarize(engine.phase_records)})
    graphs = [line for line in lines if line.startswith("nvfp4: graphs held")]
    assert len(graphs) == 4 and graphs[0].endswith("; decode state rebuilt") and "rebuilt" not in graphs[1]
    assert graphs[2].endswith("decode state rebuilt (changed: sizes)")
    assert graphs[3].endswith("decode state rebuilt (changed: parameters; 1 parameters moved)")


def test_the_second_call_profiles_its_widest_buckets_steps_and_the_summary_leaves_it_out(policy):
    engine = TimedForcedLengthRollout(length_median=40, length_sigma=0.1, check_every=4, length_bucket=8,
                                      profile_steps=3)
    spec = SamplingSpec(max_new_tokens=24, seed=0)
    for _ in range(3):
        engine.generate(policy, PROMPTS, 2, PAD, [EOS], spec)
    first, second, third = engine.phase_records
    assert "profile" not in first and "profile" not in third and second["profiled"]
    window = second["profile"]
    assert window["batch"] == len(PROMPTS) * 2 and window["steps"] == 3 and window["kind"] == "CPU"
    assert window["ms_per_step"] > 0 and window["top"] and window["kernel_ms_per_step"] > 0
    assert summarize(engine.phase_records)["calls"] == 2
    # a bucket shorter than the window: it closes with what it saw, and the next calls run unprofiled
    short = TimedForcedLengthRollout(length_median=40, length_sigma=0.1, check_every=4, length_bucket=8,
                                     profile_steps=100)
    for _ in range(3):
        short.generate(policy, PROMPTS, 2, PAD, [EOS], spec)
    window = short.phase_records[1]["profile"]
    assert window["steps"] == 23 - StepWindow.SKIP  # the call's 23 decode steps, all in one bucket
    assert "profile" not in short.phase_records[2]


def test_a_profiled_e2e_run_needs_a_timed_step_after_the_profiled_one():
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train_e2e.py"), "--tokenizer", "unused",
                           "--steps", "2", "--profile-rollout-steps", "8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--steps 2" in done.stderr and "--steps 3 or more" in done.stderr


def test_a_parallel_e2e_run_needs_a_gpu_per_format():
    import subprocess

    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per format")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train_e2e.py"), "--tokenizer", "unused",
                           "--quantizations", "nvfp4,bf16", "--parallel"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--parallel: 2 formats need as many GPUs" in done.stderr, done.stderr[-500:]


def test_the_e2e_random_prompt_source_feeds_distinct_random_questions_through_the_cli(tiny_model_dirs, tmp_path,
                                                                                       monkeypatch):
    """``--prompt-source random``: the options it adds build the data module on ``bench/random_prompts.py``'s source
    alone, and a batch's prompts are distinct questions of random tokens without the chat template's shared text (not
    the embedded arithmetic ones)."""
    import bench_train_e2e
    from random_prompts import RandomTokenPrompts

    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule

    monkeypatch.chdir(tmp_path)
    model = str(tiny_model_dirs["qwen3_moe"])
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[
        "--config", str(ROOT / "configs" / "debug.yaml"), "--model.policy.model", model,
        "--data.max_prompt_tokens", "256", *bench_train_e2e.PROMPT_SOURCES["random"](model)])  # (gpu.yaml's)
    assert isinstance(cli.datamodule.source, RandomTokenPrompts)  # the one source
    cli.datamodule.setup("fit")
    batch = next(iter(cli.datamodule.train_dataloader()))
    assert len(set(batch["prompts"])) == len(batch["prompts"]) > 1
    assert not any("What is" in p or "<|im_start|>" in p for p in batch["prompts"])  # no shared text
    assert all(len(ids) > 100 for ids in batch["prompt_ids"])  # ~160 random tokens each, the template around them
    assert bench_train_e2e.PROMPT_SOURCES["arithmetic"](model) == []
