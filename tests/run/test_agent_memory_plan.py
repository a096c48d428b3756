"""The memory plan of multi-turn episodes: the update's rows are whole trajectories (prompt + every turn + every
observation, ``model.agent.max_episode_tokens``), a later turn hands the engine a trajectory's whole context as its
prompt, each row its own; checked against what the episode loop hands a real engine, and refusals name the episode's
budget."""

from dataclasses import replace

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.hub import load_tokenizer
from qerl.model.footprint import GIB, ModelShape
from qerl.rollout.run_settings import RunSettings
from qerl.model.policy import build_policy
from qerl.modules.footprint import micro_batch_span
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.kv_cache import SlotCache, head_dim
from qerl.rollout.episode_wave import episode_columns
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.run.memory_plan import MemoryPlanError, plan_memory
from qerl.testing.random_models import qwen25_config
from qerl.testing.tiny_agents import GoOn, save_tiny_chat_model
from qerl.testing.tiny_models import tiny_config
from qerl.tools.environment import EnvironmentFactory


def component(plan, prefix: str):
    (found,) = [c for c in plan.components if c.name.startswith(prefix)]
    return found


def test_an_episode_is_planned_as_whole_trajectories_and_whole_contexts():
    config = tiny_config("qwen2")
    shape = ModelShape.from_config(config)
    single = RunSettings(prompts=3, group_size=2, max_prompt_tokens=40, max_new_tokens=300, lora_rank=4,
                         engine="cuda_graph", length_bucket=1)
    agent = replace(single, episode_tokens=1000)
    assert (single.longest_row, agent.longest_row) == (340, 1000)  # the update's longest row: a whole trajectory
    assert micro_batch_span(agent, None) == agent.micro_batch_size * 1000
    plan = plan_memory(shape, agent, wave_rows=4)
    assert plan.notes[0] == ("multi-turn episodes: update rows of up to 1000 tokens (model.agent.max_episode_tokens); "
                             "a later turn's prompt of up to 999 tokens, each row its own")
    # the cuda_graph engine keeps an episode in its cache: the prompt and the wave's episode columns after it
    cache = SlotCache(config.num_hidden_layers, 4, config.num_key_value_heads, 40 + episode_columns(999, 16),
                      head_dim(config), torch.bfloat16, "cpu")
    assert component(plan, "KV cache, one wave (4 rows").nbytes == sum(t.nbytes for t in (*cache.keys, *cache.values))
    # a resubmitting engine's later-turn row: its context (all of the budget but the turn's first token) and one turn
    assert replace(agent, engine="builtin").engine_row == 999 + 300
    # each of a wave's rows prefills its own context (the first turn: one prompt per group)
    assert component(plan, "prefill activations").name == "prefill activations (4 prompts x 999 tokens)"
    assert component(plan_memory(shape, single, wave_rows=4), "prefill activations").name == \
        "prefill activations (2 prompts x 40 tokens)"


def test_the_plan_bounds_what_the_episode_loop_hands_a_real_engine(tmp_path):
    path = save_tiny_chat_model(tmp_path, "qwen2")
    policy, tokenizer = build_policy(str(path), quantization="nvfp4", lora_rank=4, dtype="float32"), \
        load_tokenizer(str(path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in ("Say hi.", "Count to 3.")]
    max_new, budget = 10, max(map(len, prompts)) + 24
    engine, widths = BuiltinRollout(), []

    def sample(contexts, samples, max_new_tokens):
        r = engine.generate(policy, contexts, samples, tokenizer.pad_token_id, [tokenizer.eos_token_id],
                            SamplingSpec(max_new_tokens=max_new_tokens, seed=5))
        widths.append(r.prompt_ids.shape[1] + max_new_tokens)  # the positions the engine's cache holds
        return r

    episodes = run_episodes(sample, prompts, [{}, {}], 4, tokenizer, [tokenizer.eos_token_id],
                            tokenizer.pad_token_id, AgentConfig(max_turns=4, max_episode_tokens=budget), [],
                            EnvironmentFactory(GoOn), max_new, "qwen")
    settings = RunSettings(prompts=2, group_size=4, max_prompt_tokens=max(map(len, prompts)),
                           max_new_tokens=max_new, episode_tokens=budget)
    rows = (episodes.rollout.prompt_mask.sum(1) + episodes.rollout.completion_mask.sum(1)).tolist()
    assert max(rows) <= settings.longest_row and max(widths) <= settings.engine_row
    single_turn = replace(settings, episode_tokens=None)
    assert max(rows) > single_turn.longest_row and max(widths) > single_turn.engine_row  # later turns ran past it


def test_a_refusal_names_the_episodes_budget():
    shape = ModelShape.from_config(qwen25_config("qwen2.5-32b"))
    settings = RunSettings(prompts=8, group_size=8, max_prompt_tokens=1024, max_new_tokens=1024,
                           gradient_checkpointing=True, episode_tokens=16384)
    with pytest.raises(MemoryPlanError) as error:
        plan_memory(shape, settings, 34 * GIB, micro_batch_tokens="auto")
    message = str(error.value)
    assert "model.agent.max_episode_tokens" in message and "data.max_prompt_tokens" not in message, message
    budget = int(message.split("max_episode_tokens to <= ")[1].split(" ")[0])
    plan_memory(shape, replace(settings, episode_tokens=budget), 34 * GIB, micro_batch_tokens="auto")  # fits
