"""The episode loop with tools: calls run and answered, failures answered and counted, every limit ends a trajectory.

The engine here replays scripted turns (its sampling is what the log-prob tests check on real engines); the
tokenizer, its chat template, the parser, the tools and the runner are the real ones."""

import time

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.rollout.base import Rollout
from qerl.rollout.builtin import left_pad
from qerl.tools.chat_template import with_chat_template
from qerl.tools.environment import EnvironmentFactory
from qerl.tools.loading import load_tools

CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123456 + 654321"}}\n</tool_call>'
SCRIPTS = {
    "uses the tool": [CALC, "The answer is 777777."],
    "fails to call": ["<tool_call>\n{not json}\n</tool_call>", '<tool_call>{"name": "abacus", "arguments": {}}'
                      '</tool_call><tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>', "42"],
    "keeps calling": [CALC, CALC, CALC, CALC],
    "rambles": ["and so on " * 20],
}
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def tokenizer():
    return with_chat_template(load_tokenizer(EMBEDDED_MODEL), "qwen2_5")


def scripted_sampler(tokenizer, calls):
    """Each context's next scripted turn (by its question and the turns it holds), cut at ``max_new_tokens``."""

    def sample(contexts, samples, max_new_tokens):
        turns = []
        for context in contexts:
            text = tokenizer.decode(context)
            question = next(q for q in SCRIPTS if q in text)
            ids = tokenizer(SCRIPTS[question][text.count("<|im_start|>assistant") - 1],
                            add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            turns += [ids[:max_new_tokens]] * samples
        calls.append(len(turns))
        prompts, prompt_mask = left_pad([c for c in contexts for _ in range(samples)], tokenizer.pad_token_id, "cpu")
        ids, mask = left_pad([t[::-1] for t in turns], tokenizer.pad_token_id, "cpu")
        ids, mask = ids.flip(1), mask.flip(1)  # right-padded
        ended = torch.tensor([t[-1] == tokenizer.eos_token_id for t in turns])
        return Rollout(prompts, prompt_mask, ids, mask, -0.5 * mask.float(), 0.1 * mask.float(), ~ended)

    return sample


def test_tool_calls_errors_and_limits(tokenizer):
    tools = load_tools(["qerl.tools.calculator:calculator"])
    questions = list(SCRIPTS)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tools=[t.schema for t in tools],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
                  for q in questions]
    calls = []
    episodes = run_episodes(scripted_sampler(tokenizer, calls), prompt_ids, [{}] * 4, 1, tokenizer,
                            [tokenizer.eos_token_id], tokenizer.pad_token_id,
                            AgentConfig(max_turns=3, max_episode_tokens=4096), tools, None,
                            MAX_NEW_TOKENS, "qwen", [t.schema for t in tools])
    used, failed, looping, rambling = episodes.trajectories
    assert [t.end for t in episodes.trajectories] == ["answer", "answer", "max_turns", "length"]
    assert calls == [4, 3, 2]  # later turns continue the live rows only

    assert used.turns == 2 and used.tool_calls == 1 and not used.errors
    assert episodes.answers[0] == "The answer is 777777."
    assert "<tool_response>\n777777\n</tool_response>" in episodes.texts[0]
    # the tool's answer is context: in the completion, not generated, log-prob 0
    r = episodes.rollout
    response = tokenizer("777777", add_special_tokens=False)["input_ids"]
    row = r.completion_ids[0].tolist()
    at = next(i for i in range(len(row)) if row[i:i + len(response)] == response)
    assert r.completion_mask[0, at] == 1 and r.generated_mask[0, at] == 0 and r.logprobs[0, at] == 0
    assert (r.logprobs[r.generated_mask.bool()] == -0.5).all()

    assert failed.errors == {"unparseable": 1, "unknown_tool": 1, "bad_arguments": 1} and failed.tool_calls == 0 + 3
    assert episodes.answers[1] == "42" and "Error: no tool named 'abacus'" in episodes.texts[1]
    assert looping.turns == 3 and looping.tool_calls == 2  # the third turn's call is never run
    assert rambling.turns == 1 and bool(r.truncated[3]) and not r.truncated[:3].any()


def test_token_and_call_budgets(tokenizer):
    tools = load_tools(["qerl.tools.calculator:calculator"])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "keeps calling"}],
                                           tools=[t.schema for t in tools], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    run = lambda config: run_episodes(scripted_sampler(tokenizer, []), [prompt], [{}], 2, tokenizer,  # noqa: E731
                                      [tokenizer.eos_token_id], tokenizer.pad_token_id, config, tools, None,
                                      MAX_NEW_TOKENS, "qwen")
    by_calls = run(AgentConfig(max_turns=8, max_tool_calls=2))
    assert [(t.end, t.tool_calls) for t in by_calls.trajectories] == [("max_tool_calls", 2)] * 2
    budget = len(prompt) + 60
    by_tokens = run(AgentConfig(max_turns=8, max_episode_tokens=budget))
    for t in by_tokens.trajectories:
        assert t.end == "max_episode_tokens" and len(t.prompt) + len(t.tokens) <= budget
    assert by_tokens.rollout.truncated.all()


class Broken:
    """An environment whose step fails: the episode ends there, the failure is counted, the run goes on."""

    def reset(self, **row) -> None:
        pass

    def step(self, message: str) -> str | None:
        raise RuntimeError("the game crashed")


def test_an_environment_step_that_raises_ends_its_episode(tokenizer):
    SCRIPTS["plain"] = ["Hello there."]
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "plain"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        episodes = run_episodes(scripted_sampler(tokenizer, []), [prompt], [{}], 2, tokenizer,
                                [tokenizer.eos_token_id], tokenizer.pad_token_id, AgentConfig(), [],
                                EnvironmentFactory(Broken), MAX_NEW_TOKENS, "qwen")
    finally:
        del SCRIPTS["plain"]
    assert [(t.end, t.turns, dict(t.errors)) for t in episodes.trajectories] == [("environment", 1, {"raised": 1})] * 2


class BrokenScore:
    """Ends at once and fails to score: a raising ``get_reward``, or one that returns no number."""

    def reset(self, answer: str = "raise", **row) -> None:
        self.kind = answer

    def step(self, message: str) -> str | None:
        return None

    def get_reward(self) -> float:
        if self.kind == "raise":
            raise RuntimeError("the scorer crashed")
        return {"nan": float("nan"), "none": None, "fine": 0.25}[self.kind]


def test_an_environment_reward_that_fails_scores_zero_and_is_counted(tokenizer):
    SCRIPTS["plain"] = ["Hello there."]
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "plain"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        rows = [{"answer": kind} for kind in ("raise", "nan", "none", "fine")]
        episodes = run_episodes(scripted_sampler(tokenizer, []), [prompt] * 4, rows, 1, tokenizer,
                                [tokenizer.eos_token_id], tokenizer.pad_token_id, AgentConfig(), [],
                                EnvironmentFactory(BrokenScore), MAX_NEW_TOKENS, "qwen")
    finally:
        del SCRIPTS["plain"]
    assert episodes.environment_rewards.tolist() == [0.0, 0.0, 0.0, 0.25]
    assert [dict(t.errors) for t in episodes.trajectories] == [{"raised": 1}] * 3 + [{}]


class Built:
    """Counts its constructions and resets (an environment that is costly to build: a sandbox, a browser)."""

    built = 0

    def __init__(self):
        Built.built += 1
        self.resets = 0

    def reset(self, **row) -> None:
        self.resets += 1


def test_environments_are_built_once_per_slot_and_reset_every_episode(tokenizer):
    SCRIPTS["plain"] = ["Hello there."]
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "plain"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        factory, Built.built = EnvironmentFactory(Built), 0
        for _ in range(3):  # three steps
            episodes = run_episodes(scripted_sampler(tokenizer, []), [prompt], [{}], 2, tokenizer,
                                    [tokenizer.eos_token_id], tokenizer.pad_token_id, AgentConfig(), [], factory,
                                    MAX_NEW_TOKENS, "qwen")
    finally:
        del SCRIPTS["plain"]
    assert Built.built == 2 and [t.environment.resets for t in episodes.trajectories] == [3, 3]


class Slow(Built):
    """An environment whose tool can outlive its timeout."""

    def wait(self, seconds: float) -> str:
        """
        Waits.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "waited"


def test_an_environment_whose_call_timed_out_is_built_anew(tokenizer):
    SCRIPTS["hangs"] = ['<tool_call>{"name": "wait", "arguments": {"seconds": 0.5}}</tool_call>', "Done."]
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hangs"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        factory, Built.built = EnvironmentFactory(Slow), 0
        for _ in range(2):
            episodes = run_episodes(scripted_sampler(tokenizer, []), [prompt], [{}], 2, tokenizer,
                                    [tokenizer.eos_token_id], tokenizer.pad_token_id, AgentConfig(tool_timeout_s=0.05),
                                    [], factory, MAX_NEW_TOKENS, "qwen")
    finally:
        del SCRIPTS["hangs"]
    assert [dict(t.errors) for t in episodes.trajectories] == [{"timeout": 1}] * 2
    assert Built.built == 4 and [t.environment.resets for t in episodes.trajectories] == [1, 1]
