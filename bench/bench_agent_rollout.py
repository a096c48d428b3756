"""Multi-turn episodes on one GPU: where a step's time goes (decode, tool time, update) with the Python tool, and the
decode throughput of a multi-turn step against a single-turn step of about the same generated tokens.

    python bench/bench_agent_rollout.py --tokenizer DIR --out bench/results [--size qwen2.5-7b] [--turns 4] \
        [--turn-median 200] [--steps 4] [--arms multi,single,resubmit,multi@max_hole_columns=256]

Random-init weights of the real shape (``bench_train_e2e.write_models``) never write a tool call, so every turn ends
at a drawn length (``forced_lengths.ForcedLengthRollout``: lognormal, median ``--turn-median``) and the environment
``agent_bench_env.PythonTurns`` answers it with a real run of the Python tool (a separate process per call, every
row's at once), for ``--turns`` turns. Each later turn continues in the engine's KV cache: the observation is
appended to the row's cache row at the next check while the other rows decode on (``CUDAGraphRollout.play_episodes``).

Arms, each ``train.py fit`` in a process of its own (NVFP4, ``--prompts`` x ``--group-size``, by default the recipe's
batch, 16 x 8):

    multi     model.agent with that environment; per turn ``--new-tokens`` at most
    resubmit  the same episodes, each later turn a new ``generate`` over the live rows' whole contexts (the engines'
              default ``play_episodes``: what the KV-cache path replaces; ``--arms`` adds it)
    single    one completion per sample, lengths drawn with median ``turns x turn-median``, at most
             ``turns x new-tokens``: about the same generated tokens per row

An arm may set the CUDA-graph engine's arguments (``multi@turn_check_every=8:max_hole_columns=256``): each multi arm
is compared with the single one. Beside the seconds each arm prints what its decode steps read and copied
(``qerl.rollout.wave_costs``: ``agent_wave_costs.py`` counts the same on the CPU).

Read back from TensorBoard (medians over the steps after the first): ``agent/decode_s``, ``agent/tool_s``,
``perf/rollout_s``, ``perf/train_s``, ``train/completion_length`` (the model's own tokens per row); decode
throughput = generated tokens / decode seconds, both summed over the steps after the first. Writes
``agent_rollout_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_e2e import in_own_process, write_models  # noqa: E402


def engine_options(arm: str) -> tuple[str, dict]:
    """``multi@turn_check_every=8:max_hole_columns=256`` -> ("multi", {"turn_check_every": 8, ...}): an arm and the
    CUDA-graph engine's arguments it sets (values as JSON; ``none`` is None)."""
    name, _, settings = arm.partition("@")
    options = {}
    for item in filter(None, settings.split(":")):
        key, _, value = item.partition("=")
        options[key] = None if value.lower() == "none" else json.loads(value)
    if name not in ("multi", "single", "resubmit"):
        raise ValueError(f"--arms: {arm!r} names no arm; use multi, single or resubmit, each with @option=value:...")
    return name, options


class CheckTimer:
    """Seconds of a multi-turn wave's checks (``EpisodeWave._between_turns``: the host's look, the hand-over, the
    slot moves, the packs, the lead steps and the observation prefills), less the waits for the tools inside them
    (``agent/tool_s``'s side), per ``play_episodes`` call. ``synced``: the GPU drained at both ends of each part so
    their device work counts (a diagnosis: it undoes the lead steps' overlap, so the arm's decode seconds are not the
    engine's); else the host's seconds."""

    def __init__(self, profile: int = 0, synced: bool = False):
        from qerl.agents import episode
        from qerl.rollout import cuda_graph, episode_wave, graph_cache

        self.calls: list[float] = []
        self.captured: list[int] = []  # the engine's captured graphs when each call starts
        self.parts: list[dict[str, float]] = []  # per call: seconds of the checks' parts
        self.waits = 0.0
        self.prefills: list[list] = []  # per observation prefill: [call, rows, width, column, seconds]
        self.profile, self.profiles = profile, []  # torch.profiler tables of the first ``profile`` prefills of call 3+
        between, collect, play = (episode_wave.EpisodeWave._between_turns, episode._Turns.collect,
                                  cuda_graph.CUDAGraphRollout.play_episodes)

        sync = torch.cuda.synchronize if torch.cuda.is_available() and (synced or profile) else (lambda: None)

        def timed_between(wave, *a):
            sync()
            start, waits = time.perf_counter(), self.waits
            try:
                return between(wave, *a)
            finally:
                sync()
                self.calls[-1] += time.perf_counter() - start - (self.waits - waits)

        def timed_collect(turns):
            start = time.perf_counter()
            try:
                return collect(turns)
            finally:
                self.waits += time.perf_counter() - start

        def counted_play(engine, *a, **k):
            self.calls.append(0.0)
            self.parts.append({})
            self.captured.append(engine.graphs_captured)
            return play(engine, *a, **k)

        def phase(name, fn):  # a part of the checks, its device work drained at both ends
            def timed(*a, **k):
                sync()
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    sync()
                    self.parts[-1][name] = self.parts[-1].get(name, 0.0) + time.perf_counter() - start
            return timed

        def each_prefill(fn):  # each prefill's shape and seconds; profiled from the third call on
            def timed(wave, first, blocks, budgets, column):
                profiled = len(self.calls) >= 3 and len(self.profiles) < self.profile
                sync()
                start = time.perf_counter()
                if profiled:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                        out = fn(wave, first, blocks, budgets, column)
                        sync()
                else:
                    out = fn(wave, first, blocks, budgets, column)
                    sync()
                seconds = time.perf_counter() - start
                self.prefills.append([len(self.calls), len(blocks), max(map(len, blocks)), column, seconds])
                if profiled:
                    self.profiles.append(f"prefill rows {len(blocks)} width {max(map(len, blocks))} column {column}: "
                                         f"{seconds:.4f} s\n" + prof.key_averages().table(
                                             sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
                return out
            return timed

        episode_wave.EpisodeWave._append = phase("prefill", each_prefill(episode_wave.EpisodeWave._append))
        episode_wave.EpisodeWave._turns_of = phase("hand_over", episode_wave.EpisodeWave._turns_of)
        episode_wave.DecodeState.defragment = phase("pack", episode_wave.DecodeState.defragment)
        episode_wave.DecodeState.move = phase("move", episode_wave.DecodeState.move)
        graph_cache.GraphCache.capture = phase("capture", graph_cache.GraphCache.capture)  # (in the decode, not a check)
        episode_wave.EpisodeWave._between_turns = timed_between
        episode._Turns.collect = timed_collect
        cuda_graph.CUDAGraphRollout.play_episodes = counted_play


def count_decode_steps() -> list[int]:
    """The decode steps of each rollout call (``generate`` / ``play_episodes``), from the engine's cost model: the
    seconds per decode step of a step compare arms whose longest rows differ."""
    from qerl.rollout import cuda_graph

    steps: list[int] = []

    def counted(call):
        def run(engine, *a, **k):
            before = engine.costs.decode_steps
            try:
                return call(engine, *a, **k)
            finally:
                steps.append(engine.costs.decode_steps - before)
        return run

    for name in ("generate", "play_episodes"):
        setattr(cuda_graph.CUDAGraphRollout, name, counted(getattr(cuda_graph.CUDAGraphRollout, name)))
    return steps


def fit(model_dir: Path, arm: str, args, log_root: Path) -> dict:
    from qerl.cli import cli_main

    rows = args.prompts * args.group_size
    name, options = engine_options(arm)
    decode_steps = count_decode_steps()
    checks = CheckTimer(args.profile_prefills, args.check_parts) if name == "multi" else None
    label = arm.replace("@", "_").replace(":", "_").replace("=", "")
    engine = "forced_lengths.ForcedLengthRollout"
    if name in ("multi", "resubmit"):
        engine = "forced_lengths.ResubmittingForcedLengthRollout" if name == "resubmit" else engine
        lengths = [f"--model.rollout.init_args.length_median={args.turn_median}"]
        arm_args = ["--model.agent.environment", json.dumps({"class_path": "agent_bench_env.PythonTurns",
                                                             "init_args": {"turns": args.turns}}),
                    "--model.agent.chat_template", "qwen2_5", "--model.agent.max_turns", str(args.turns),
                    "--model.agent.max_episode_tokens", str(args.max_prompt + args.turns * (args.new_tokens + 64)),
                    "--model.sampling.max_new_tokens", str(args.new_tokens), "--data.max_prompt_tokens", "512"]
    else:
        lengths = [f"--model.rollout.init_args.length_median={args.turns * args.turn_median}"]
        arm_args = ["--model.sampling.max_new_tokens", str(args.turns * args.new_tokens)]
    cli = cli_main([
        "fit", "--config", "configs/gpu.yaml", "--trainer.accelerator", "auto",
        "--model.policy.model", str(model_dir), "--model.policy.quantization", "nvfp4",
        "--model.rollout.class_path", engine, *lengths, *arm_args,
        *[f"--model.rollout.init_args.{key}={json.dumps(value)}" for key, value in options.items()],
        "--model.sampling.group_size", str(args.group_size), "--data.batch_size", str(args.prompts),
        "--model.dapo.mask_truncated", "false", "--model.dapo.dynamic_sampling", "false", "--model.log_samples_every", "0",
        "--trainer.max_steps", str(args.steps), "--trainer.logger.init_args.save_dir", str(log_root),
        "--trainer.logger.init_args.name", label, "--trainer.callbacks", "[]", "--trainer.enable_checkpointing",
        "false", *args.overrides,
    ])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(sorted(glob.glob(str(log_root / label / "*" / "events*")))[-1])
    events.Reload()
    series = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    steady = lambda tag: statistics.median(series[tag][1:] or series[tag])  # noqa: E731  first step warms up
    out = {"rollout_s": steady("perf/rollout_s"), "train_s": steady("perf/train_s"),
           "generated_per_row": steady("train/completion_length"), "steps": len(series["perf/rollout_s"])}
    out["decode_s"] = steady("agent/decode_s") if name != "single" else out["rollout_s"]
    out["decode_s_per_step"] = series["agent/decode_s" if name != "single" else "perf/rollout_s"]
    out["decode_steps_per_step"] = decode_steps
    out["ms_per_decode_step"] = [1e3 * t / max(n, 1) for t, n in zip(out["decode_s_per_step"], decode_steps)]
    out["tool_s"] = steady("agent/tool_s") if name != "single" else 0.0
    out["turns"] = steady("agent/turns") if name != "single" else 1.0
    # every step after the first, tokens over seconds (the steps' lengths are drawn: a median of each would pair the
    # tokens of one step with the seconds of another)
    lengths, seconds = series["train/completion_length"], out["decode_s_per_step"]
    out["decode_tok_s"] = sum(lengths[1:] or lengths) * rows / sum(seconds[1:] or seconds)
    out["costs"] = cli.model.rollout.costs.summary()  # every step's (qerl.rollout.wave_costs)
    out["check_s"] = statistics.median(checks.calls[1:] or checks.calls) if checks and checks.calls else None
    out["check_parts_s"] = (checks.parts[1:] or checks.parts)[0] if checks and checks.parts else None  # the 2nd call's
    out["check_parts_s_per_step"] = checks.parts if checks else None  # each call's: a cost that falls is a warm-up
    out["prefill_calls"] = checks.prefills if checks else None
    for table in checks.profiles if checks else ():
        print(table, flush=True)
    # graphs captured after the first step: their captures are in the reported decode seconds
    out["later_captures"] = cli.model.rollout.graphs_captured - checks.captured[1] if checks and checks.captured[1:] \
        else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True, help="a directory with the embedded model's tokenizer")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--size", default="qwen2.5-7b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (the recipe's: configs/gpu.yaml)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-median", type=int, default=200, help="median tokens of one turn")
    parser.add_argument("--new-tokens", type=int, default=1024, help="max tokens of one turn (the recipe's)")
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--work", default="/tmp/qerl_agent")
    parser.add_argument("--arms", default="multi,single",
                        help="comma-separated: multi, single, resubmit, each with engine arguments of its own "
                             "(multi@turn_check_every=8:max_hole_columns=256)")
    parser.add_argument("--profile-prefills", type=int, default=0,
                        help="print torch.profiler tables of this many observation prefills of the third step on "
                             "(drains the GPU around each check part, as --check-parts)")
    parser.add_argument("--check-parts", action="store_true",
                        help="time the checks' parts with the GPU drained at both ends (their device work counted; "
                             "the lead steps' overlap undone): a diagnosis, not the engine's throughput")
    parser.add_argument("overrides", nargs="*", help="more train.py options for both arms (after --)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    work = Path(args.work)
    model_dir = work / f"{args.size}-nvfp4"
    if not (model_dir / "config.json").exists():
        model_dir = write_models(args.size, args.tokenizer, work, len(AutoTokenizer.from_pretrained(args.tokenizer)),
                                 ("nvfp4",))["nvfp4"]
    arms = args.arms.split(",")
    for arm in arms:
        engine_options(arm)  # refused before any model loads
    results: dict = {}
    row = {"model": args.size, "prompts": args.prompts, "group_size": args.group_size, "turns": args.turns,
           "turn_median": args.turn_median, "new_tokens": args.new_tokens, "arms": results,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": datetime.date.today().isoformat()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"agent_rollout_{row['device'].lower().replace(' ', '_')}.json"
    for arm in arms:  # each arm's result is kept as it comes (a run cut short keeps the arms before)
        results[arm] = in_own_process(fit, model_dir, arm, args, work / "runs")
        print(f"{arm}: {json.dumps(results[arm])}", flush=True)
        path.write_text(json.dumps(row, indent=2) + "\n")
    single = next((results[arm] for arm in arms if engine_options(arm)[0] == "single"), None)
    resubmit = next((results[arm] for arm in arms if engine_options(arm)[0] == "resubmit"), None)
    for arm in arms:
        r, costs = results[arm], results[arm]["costs"]
        print(f"{arm}: decode {r['decode_s']:.1f} s ({r['decode_tok_s']:.0f} tok/s at {r['generated_per_row']:.0f} "
              f"tokens per row) + tools {r['tool_s']:.1f} s (rollout {r['rollout_s']:.1f} s), update "
              f"{r['train_s']:.1f} s, {r['turns']:.1f} turns; attended per token {costs['attended_per_token']:.0f} "
              f"({costs['attended_per_needed']:.2f} x needed), idle rows {costs['idle_row_share']:.1%} "
              f"(between turns {costs['waiting_row_share']:.1%}), "
              f"{costs['packs']:.0f} packs, copied per token {costs['copied_per_token']:.0f}, {costs['prefills']:.0f} "
              f"prefills" + (f"; checks {r['check_s']:.2f} s of the decode, {r['later_captures']} graphs captured after "
                             f"the first step; parts {r['check_parts_s']}" if r.get("check_s") is not None else ""))
        if engine_options(arm)[0] != "multi":
            continue
        if single is not None:
            r["decode_vs_single"] = r["decode_tok_s"] / single["decode_tok_s"]
            print(f"    decode throughput / single: {r['decode_vs_single']:.2f} (target >= 0.85)")
        if resubmit is not None:
            r["decode_vs_resubmit"] = r["decode_tok_s"] / resubmit["decode_tok_s"]
            print(f"    decode throughput / resubmitted contexts: {r['decode_vs_resubmit']:.2f}")
    path.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
