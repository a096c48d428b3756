"""A mixture-of-experts policy's routing over multi-turn episodes: every engine call of the episode loop is recorded
and laid out over the trajectories, each token with the experts the sampler chose for it, so that the update's
mismatch and router replay cover the model's tokens of every turn (not the single-turn layout of the first call)."""

import zlib

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.hub import load_tokenizer
from qerl.model.policy import build_policy
from qerl.model.routing import NOT_FED, routed, topk_differs
from qerl.modules.episode_routing import RecordingEngine, episode_choices
from qerl.modules.expert_routing import ExpertRouting
from qerl.modules.micro_batches import micro_batches
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.tiny_agents import GoOn, save_tiny_chat_model
from qerl.tools.environment import EnvironmentFactory

QUESTIONS = ["Say hi.", "Count to three."]


@pytest.fixture(scope="module")
def moe_chat(tmp_path_factory):
    path = save_tiny_chat_model(tmp_path_factory.mktemp("moe_chat"), "qwen3_moe", end_logit=11.0)
    policy = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32")
    with torch.no_grad():  # non-zero LoRA B so the adapters take part
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    tokenizer = load_tokenizer(str(path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    return policy, tokenizer, prompts


def play(moe_chat, noise: float):
    """(engine) -> Episodes: 3 episodes of each prompt, each answered twice by ``GoOn`` before it ends."""
    policy, tokenizer, prompts = moe_chat
    calls = iter(range(100))

    def over(engine):
        def sample(contexts, samples, max_new_tokens):
            spec = SamplingSpec(max_new_tokens=max_new_tokens, seed=3 + next(calls), noise_sigma=noise,
                                noise_generator=torch.Generator().manual_seed(1))
            return engine.generate(policy, contexts, samples, tokenizer.pad_token_id, [tokenizer.eos_token_id], spec)

        return run_episodes(sample, prompts, [{}, {}], 3, tokenizer, [tokenizer.eos_token_id],
                            tokenizer.pad_token_id, AgentConfig(max_turns=3), [], EnvironmentFactory(GoOn), 8, "qwen")
    return over


@pytest.mark.parametrize("engine", [BuiltinRollout, CUDAGraphRollout])
def test_every_turn_is_routed_as_a_full_forward_of_the_trajectory_routes_it(moe_chat, engine):
    policy, tokenizer, _ = moe_chat
    recording = RecordingEngine(engine())
    episodes = play(moe_chat, 0.0)(recording)
    trajectories = episodes.trajectories
    assert max(t.turns for t in trajectories) >= 2 and len(recording.calls) >= 2  # later turns were sampled
    sequences = [t.prompt + t.tokens for t in trajectories]
    choices = episode_choices(recording.calls, sequences, [t.turns for t in trajectories], episodes.rollout)
    r = episodes.rollout
    real = torch.cat((r.prompt_mask, r.completion_mask), dim=1).bool()
    model = policy.get_base_model()
    for i, sequence in enumerate(sequences):
        mine = choices[:, i, real[i]]  # [layers, T, k]
        fed = mine[..., 0] != NOT_FED
        # every token but the last is fed by some call (observations by the next turn's prefill)
        assert fed[:, :-1].all(), i
        with torch.no_grad(), routed(model) as own:
            model.get_decoder()(input_ids=torch.tensor([sequence]), use_cache=False)
        full = torch.stack(own)  # [layers, T, k]: one forward over the whole trajectory
        assert not (topk_differs(mine, full) & fed).any(), i
    # a call whose rows are not the trajectories the loop's order says is refused, never laid out wrongly
    with pytest.raises(RuntimeError, match="expert routing: episode call"):
        episode_choices(recording.calls, sequences, [1] * len(sequences), r)
    with pytest.raises(RuntimeError, match="is not trajectory"):
        episode_choices(recording.calls[:1], [s[::-1] for s in sequences], [1] * len(sequences), r)


def update_metrics(routing: ExpertRouting, policy, rollout) -> dict:
    """One forward of all rows, as the update runs it (the model's tokens the targets), and the mismatch it logs."""
    model = policy.get_base_model()
    (batch,) = micro_batches(rollout.prompt_ids, rollout.completion_ids, rollout.prompt_mask, rollout.completion_mask,
                             [list(range(rollout.prompt_ids.shape[0]))], 0, torch.device("cpu"), rollout.model_mask)
    with routing.update(policy), routing.forward(model, batch.rows, batch.ids):
        model.get_decoder()(input_ids=batch.ids, use_cache=False).last_hidden_state.sum().backward()
    policy.zero_grad(set_to_none=True)
    return routing.metrics()


@pytest.mark.parametrize("replay", [False, True], ids=["own-routing", "replay"])
def test_the_update_compares_and_replays_the_routing_of_every_turn(moe_chat, replay):
    policy = moe_chat[0]
    routing = ExpertRouting(replay=replay)
    clean = routing.play(play(moe_chat, 0.0), BuiltinRollout(), policy)
    assert max(t.turns for t in clean.trajectories) >= 2
    assert update_metrics(routing, policy, clean.rollout) == {"train/router_mismatch_frac": 0.0,
                                                              "train/router_mismatch_token_frac": 0.0}
    noisy = routing.play(play(moe_chat, 0.5), BuiltinRollout(), policy)  # AQN noise moves some tokens' experts
    metrics = update_metrics(routing, policy, noisy.rollout)
    assert 0 < metrics["train/router_mismatch_frac"] <= metrics["train/router_mismatch_token_frac"] <= 1


def test_an_agent_run_of_a_moe_policy_logs_the_routing_of_its_episodes(tmp_path, monkeypatch):
    """``train.py fit`` with an environment on the tiny Qwen3-MoE and router replay: the update replays and compares
    the episodes' recorded routing (the mismatch is logged), as it does single-turn."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qerl.cli import cli_main

    model = save_tiny_chat_model(tmp_path / "model", "qwen3_moe", end_logit=11.0)
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", str(root / "configs" / "debug.yaml"), "--model.policy.model", str(model),
                    "--model.agent.environment", str(Path(__file__).with_name("episode_envs.py")) + ":Echo",
                    "--model.agent.max_turns", "3", "--model.sampling.max_new_tokens", "8",
                    "--model.expert_routing.replay", "true", "--model.dapo.max_refill_rounds", "0",
                    "--data.max_prompt_tokens", "512", "--trainer.logger.init_args.save_dir", str(tmp_path)])
    acc = EventAccumulator(cli.trainer.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    assert max(e.value for e in acc.Scalars("agent/turns")) > 1  # later turns were sampled and routed
    assert len(acc.Scalars("train/router_mismatch_frac")) == 2
