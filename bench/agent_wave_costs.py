"""The cost model of ``bench_agent_rollout.py``'s multi-turn step, on the CPU: the same episode shape (prompts x group,
``--turns`` turns of drawn lengths, the Python tool's observation) played by the CUDA-graph engine's episode waves with
a tiny model, and what its decode steps read (``qerl.rollout.wave_costs``) for each engine setting.

    python bench/agent_wave_costs.py [--arms "multi,multi@max_hole_columns=256,single"] [--prompts 8] \
        [--group-size 8] [--turns 4] [--turn-median 200] [--new-tokens 1024]

The schedule follows the sampled tokens only, and the forced lengths fix those counts, so these numbers are the GPU
run's for the same shape (its seconds are not: ``bench_agent_rollout.py`` measures those). The environment answers
with the text the bench's Python tool prints (``agent_bench_env.PROGRAM``'s output, computed here once), so the
observations have the bench's token lengths without a process per call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_bench_env import PROGRAM, PythonTurns  # noqa: E402
from bench_agent_rollout import engine_options  # noqa: E402

QUESTION = ("A farmer has {n} sheep and buys 3 times as many goats as sheep. He sells half of the goats and a "
            "third of the sheep. Write a Python program that prints how many animals he has left, then explain it.")


class PrintedTurns(PythonTurns):
    """``agent_bench_env.PythonTurns`` with the tool's output computed once: the same observations, no processes."""

    printed = ""

    def output(self) -> str:
        return self.printed


def play(arm: str, args, policy, tokenizer) -> dict:
    from forced_lengths import ForcedLengthRollout

    from qerl.agents.config import AgentConfig
    from qerl.agents.episode import run_episodes
    from qerl.rollout.episodes import BoundEngine
    from qerl.rollout.sampling_spec import SamplingSpec
    from qerl.testing.tiny_agents import chat_prompts
    from qerl.tools.environment import EnvironmentFactory

    name, options = engine_options(arm)
    prompts = chat_prompts(tokenizer, [QUESTION.format(n=10 * k + 7) for k in range(args.prompts)])
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    multi = name == "multi"
    median = args.turn_median * (1 if multi else args.turns)
    new = args.new_tokens * (1 if multi else args.turns)
    engine = ForcedLengthRollout(length_median=median, **options)
    spec = SamplingSpec(max_new_tokens=new, temperature=1.0, seed=0)
    if multi:
        config = AgentConfig(max_turns=args.turns, max_episode_tokens=args.max_prompt + args.turns * (new + 64))
        run_episodes(BoundEngine(engine, policy, pad, eos, spec), prompts, [{}] * len(prompts), args.group_size,
                     tokenizer, eos, pad, config, [], EnvironmentFactory(PrintedTurns, {"turns": args.turns}), new,
                     "qwen")
    else:
        engine.generate(policy, prompts, args.group_size, pad, eos, spec)
    return engine.costs.summary()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arms", default="multi,single")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-median", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--out", default=None, help="a JSON file (bench/results/agent_wave_costs_cpu.json)")
    args = parser.parse_args()
    from qerl.model.policy import build_policy
    from qerl.hub import load_tokenizer
    from qerl.testing.tiny_agents import save_tiny_chat_model

    namespace: dict = {}
    exec(PROGRAM.replace("print(", "output = str("), namespace)  # the tool's own program, its printed line
    PrintedTurns.printed = namespace["output"] + "\n"
    with tempfile.TemporaryDirectory() as directory:
        path = save_tiny_chat_model(directory)
        policy = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32")
        tokenizer = load_tokenizer(str(path))
    results = {}
    for arm in args.arms.split(","):
        torch.manual_seed(0)
        results[arm] = costs = play(arm, args, policy, tokenizer)
        print(f"{arm:50s} attended/token {costs['attended_per_token']:7.0f}  attended/needed "
              f"{costs['attended_per_needed']:5.2f}  idle rows {costs['idle_row_share']:5.1%} (waiting "
              f"{costs['waiting_row_share']:5.1%})  steps {costs['decode_steps']:6.0f}  packs {costs['packs']:3.0f}  "
              f"copied/token {costs['copied_per_token']:6.0f}"
              f"  prefills {costs['prefills']:4.0f} (padding {costs['prefill_padding']:4.0%})", flush=True)
    if args.out:
        shape = {k: getattr(args, k) for k in ("prompts", "group_size", "turns", "turn_median", "new_tokens")}
        row = {"shape": shape, "rows": [{"arm": arm, **costs} for arm, costs in results.items()],
               "device": "cpu (a tiny model: the counts are the GPU run's)", "date": datetime.date.today().isoformat(),
               "command": "PYTHONPATH=. python bench/agent_wave_costs.py --arms " + args.arms + " --out " + args.out}
        Path(args.out).write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
