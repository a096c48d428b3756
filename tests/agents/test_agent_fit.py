"""``train.py fit`` with an agent on a tiny chat model: multi-turn episodes train, the agent's TensorBoard tags and
whole-episode samples are written, and a run resumed from a mid-run checkpoint ends with the straight run's weights;
with the built-in engine (contexts resubmitted each turn) and the CUDA-graph engine (episodes in its KV cache)."""

import json
from pathlib import Path

import pytest
import torch

from qerl.cli import cli_main
from qerl.testing.tiny_agents import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
ENV = str(Path(__file__).with_name("episode_envs.py")) + ":Echo"


def events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


ENGINES = {"builtin": [], "cuda_graph": ["--model.rollout.class_path", "qerl.rollout.cuda_graph.CUDAGraphRollout",
                                          "--model.rollout.init_args.check_every", "3"]}  # (episodes in its KV cache)


@pytest.fixture(scope="module", params=list(ENGINES))
def runs(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("agent_fit")
    model = save_tiny_chat_model(root / "model", "qwen2")

    def fit(version: str, *extra: str) -> dict:
        cli = cli_main([
            "fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--model.policy.model", str(model),
            "--model.agent.tools", "[qerl.tools.calculator:calculator]", "--model.agent.environment", ENV,
            "--model.agent.max_turns", "3", "--model.sampling.max_new_tokens", "8",
            "--trainer.max_steps", "3", "--data.max_prompt_tokens", "512",
            "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.version", version,
            *ENGINES[request.param], *extra])
        weights = {n: p.detach().clone() for n, p in cli.model.policy.named_parameters() if p.requires_grad}
        return {"log_dir": Path(cli.trainer.log_dir), "weights": weights}

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        straight = fit("S")
        resumed = fit("R", "--ckpt_path", str(straight["log_dir"] / "checkpoints" / "epoch=0-step=1.ckpt"))
    return straight, resumed


def test_agent_tags_and_whole_episodes_are_logged(runs):
    acc = events(runs[0]["log_dir"])
    tags = set(acc.Tags()["scalars"])
    assert {"agent/turns", "agent/tool_calls", "agent/tool_errors/unparseable", "agent/ended_with_answer",
            "agent/hit_limit", "agent/tool_s", "agent/decode_s", "train/rewards/Echo"} <= tags
    turns = [e.value for e in acc.Scalars("agent/turns")]
    assert len(turns) == 3 and max(turns) > 1  # second turns happened
    text = acc.Tensors("episodes/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "<|im_start|>assistant" in text and "Go on." in text and "ended:" in text
    assert max(e.value for e in acc.Scalars("agent/model_token_frac")) < 1  # observations are in the completions


def test_resumed_run_ends_with_the_weights_of_the_straight_run(runs):
    straight, resumed = runs
    assert straight["weights"].keys() == resumed["weights"].keys()
    for name, value in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=0, msg=name)


def test_validation_plays_whole_episodes_and_scores_the_last_turn(tmp_path, monkeypatch):
    import qerl.agents.runner

    model = save_tiny_chat_model(tmp_path / "model", "qwen2")
    monkeypatch.chdir(tmp_path)
    played, real = [], qerl.agents.runner.run_episodes
    monkeypatch.setattr(qerl.agents.runner, "run_episodes", lambda *a, **k: played.append(real(*a, **k)) or played[-1])
    val = '[{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"num_rows": 2, "seed": 3}}]'
    cli_main(["validate", "--config", str(ROOT / "configs" / "debug.yaml"), "--model.policy.model", str(model),
              "--model.agent.environment", ENV, "--model.agent.max_turns", "3", "--model.sampling.max_new_tokens", "8",
              "--model.evaluation.samples", "2", "--data.val_sources", val, "--data.max_prompt_tokens", "512",
              "--trainer.logger.init_args.save_dir", str(tmp_path)])
    records = [json.loads(line) for line in (tmp_path / "debug" / "version_0" / "eval" / "val_step0.jsonl").open()]
    assert len(records) == 2 * (1 + 2)  # greedy + 2 samples per question
    assert not any("Go on." in r["completion"] for r in records)  # the last turn, not the environment's messages
    turns = [t.turns for e in played for t in e.trajectories]
    assert len(turns) == 6 and max(turns) > 1
    last = [e.answers for e in played]  # what the reward read: each trajectory's last turn
    assert sorted(r["completion"] for r in records) == sorted(a for answers in last for a in answers)
