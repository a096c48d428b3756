"""Multi-turn episodes over any rollout engine.

    turn 1     the engine samples G completions per prompt (as single-turn RL does)
    between    each finished turn is read: tool calls run (every stopped row's at once), or the environment's
               ``step`` answers a plain reply; the results, rendered by the chat template, become the row's tokens
    turn k     the engine continues every live row after its observation, one sample each; the model's own tokens
               are kept as sampled, never re-tokenized
    end        a turn without a call (the answer), the environment's end, or a limit: the turn cut by
               max_new_tokens, ``max_turns``, ``max_tool_calls``, ``max_episode_tokens``

The engine owns the turn loop (``RolloutEngine.play_episodes``) and asks this module's ``_Turns`` (an
``EpisodeTurns``) what follows each finished turn. The CUDA-graph engine appends each observation to the row's KV
cache and decodes on while the other rows keep decoding (the prompt is prefilled once); the built-in and vLLM engines
resubmit the row's whole context each turn (vLLM's prefix cache reuses the shared part). ``run_episodes`` given a
plain ``Sampler`` (a generate) resubmits too.

The ``Rollout`` returned has one completion per trajectory: every turn and observation after the prompt, with
``generated_mask`` 1 on the model's tokens only; log-probs and entropies are the sampling policy's there, 0 on
observation tokens, which are context for the loss and never trained.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from qerl.agents.config import AgentConfig
from qerl.rollout.base import Rollout
from qerl.rollout.episodes import BoundEngine, Sampler, TurnEnd, resubmit_episodes
from qerl.tools.calls import ToolCall, parse_tool_calls
from qerl.tools.chat_template import observation_ids
from qerl.tools.environment import EnvironmentFactory, environment_step
from qerl.tools.execution import ToolResult, ToolRunner
from qerl.tools.loading import Tool

# why a trajectory ended; the first two are the model's own ends, the others limits
ENDS = ("answer", "environment", "length", "max_turns", "max_tool_calls", "max_episode_tokens")

STEP = "step"  # an environment's step runs as a call of its own: at once with the others, under the timeout
CUT = ("length", "max_episode_tokens")  # cut mid-turn or left without room: DAPO's truncated completions


@dataclass
class Trajectory:
    """One row's episode so far: its completion tokens (turns and observations) and what happened."""

    prompt: list[int]
    tools: dict[str, Callable]
    environment: object | None = None
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # 1: the model's token, 0: an observation's
    logprobs: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_seconds: float = 0.0
    errors: Counter = field(default_factory=Counter)
    end: str | None = None

    def add(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] = (), entropy: Sequence[float] = ()):
        self.tokens += ids
        self.generated += [int(model)] * len(ids)
        self.logprobs += list(logprobs) if model else [0.0] * len(ids)
        self.entropy += list(entropy) if model else [0.0] * len(ids)


class Episodes(NamedTuple):
    """G trajectories per prompt (rows grouped per prompt, N = B*G)."""

    rollout: Rollout  # completion = every turn and observation; generated_mask = the model's tokens
    answers: list[str]  # the model's last turn, as text: what the rewards score
    texts: list[str]  # the whole episode after the prompt, special tokens kept (TensorBoard's samples)
    environment_rewards: Tensor | None  # [N] the environments' get_reward(), None without one that scores
    trajectories: list[Trajectory]
    decode_s: float = 0.0  # wall time in the engine, not waiting for tools
    tool_s: float = 0.0  # wall time of the tools and environments (every stopped row's calls at once), beside decode


def run_episodes(sample: BoundEngine | Sampler, prompt_ids: Sequence[Sequence[int]], rows: Sequence[dict],
                 group_size: int,
                 tokenizer, eos_ids: list[int], pad_id: int, config: AgentConfig, tools: list[Tool],
                 environment: EnvironmentFactory | None, max_new_tokens: int, call_format: str,
                 tool_schemas: list[dict] | None = None, template_kwargs: dict | None = None) -> Episodes:
    """Run ``group_size`` episodes of each prompt to their ends (see the module docstring).

    Args:
        sample: the engine with the policy and its sampling settings bound: it plays the turns its own way
            (``play_episodes``); or a ``Sampler`` (a generate), every turn a resubmission of the live contexts.
        prompt_ids: B prompts, chat-formatted with the tools' schemas.
        rows: each prompt's dataset columns (an environment's ``reset(**row)``).
        group_size: G trajectories per prompt.
        tokenizer: decodes turns and renders observations with its chat template.
        eos_ids: the end-of-turn tokens.
        pad_id: padding of the returned rollout.
        config: the limits (``max_turns``, ``max_tool_calls``, ``max_episode_tokens``, tool timeout and output cap).
        tools: the run's tools; an environment's tool methods are added per trajectory.
        environment: one environment per trajectory slot (built once, reset per episode), or None.
        max_new_tokens: the engine's budget per turn.
        call_format: how tool calls are written (``qwen`` or ``llama3``).
        tool_schemas: the schemas the template renders (some templates show them again around tool results).
        template_kwargs: extra chat template variables (Qwen3's ``enable_thinking``).
    """
    turns = _Turns(trajectories_of(prompt_ids, rows, group_size, tools, environment), tokenizer, eos_ids, config,
                   ToolRunner(config.tool_timeout_s, config.tool_output_chars), max_new_tokens, call_format,
                   tool_schemas, template_kwargs)
    start, devices = time.perf_counter(), []

    def sample_on(contexts, samples, n):
        rollout = sample(contexts, samples, n)
        devices.append(rollout.logprobs.device)
        return rollout

    try:
        if isinstance(sample, BoundEngine):
            devices.append(sample.device)
            sample.play(prompt_ids, group_size, turns)
        else:
            resubmit_episodes(sample_on, prompt_ids, group_size, turns)
    finally:
        turns.close()
    device = devices[-1]
    trajectories = turns.trajectories
    episodes = finish(trajectories, tokenizer, pad_id, device)
    for k, t in enumerate(trajectories):
        if environment is not None and t.errors["timeout"]:  # its thread may still change it: a new one next time
            environment.discard(k)
    return episodes._replace(decode_s=time.perf_counter() - start - turns.wait_s, tool_s=turns.tool_s)


def trajectories_of(prompt_ids: Sequence[Sequence[int]], rows: Sequence[dict], group_size: int, tools: list[Tool],
                    environment: EnvironmentFactory | None) -> list[Trajectory]:
    """``group_size`` fresh trajectories per prompt, each with its tools and its slot's environment reset from the
    prompt's dataset row."""
    trajectories = []
    for prompt, row in zip(prompt_ids, rows):
        for _ in range(group_size):
            env, own = None, {t.name: t.fn for t in tools}
            if environment is not None:
                env, env_tools = environment.slot(len(trajectories))
                env.reset(**row)
                own.update({t.name: t.fn for t in env_tools})
            trajectories.append(Trajectory(list(prompt), own, env))
    return trajectories


class _Turns:
    """The episodes' side of the engine's turn loop (``qerl.rollout.episodes.EpisodeTurns``): each finished turn is
    recorded; in a background thread the turns are read, the tools of every row that stopped run at once and their
    observations are rendered, while the engine decodes the other rows."""

    def __init__(self, trajectories: list[Trajectory], tokenizer, eos_ids: list[int], config: AgentConfig,
                 runner: ToolRunner, max_new_tokens: int, call_format: str, tool_schemas, template_kwargs):
        self.trajectories, self.tokenizer, self.eos_ids, self.config = trajectories, tokenizer, eos_ids, config
        self.runner, self.max_new_tokens, self.call_format = runner, max_new_tokens, call_format
        self.tool_schemas, self.template_kwargs = tool_schemas, template_kwargs
        self.tool_s = 0.0  # running the tools and environments (in the background, beside the decode)
        self.wait_s = 0.0  # the engine waiting for them
        self._pool: ThreadPoolExecutor | None = None  # one job at a time: a batch of stopped rows' calls
        self._pending: list[Future] = []
        self.completion_budget = max((token_limit(t, config, max_new_tokens) - len(t.prompt) for t in trajectories),
                                     default=1)

    def budget(self, row: int) -> int:
        return max(1, min(self.max_new_tokens, room_left(self.trajectories[row], self.config, self.max_new_tokens)))

    def submit(self, turns: list[TurnEnd]) -> None:
        config = self.config
        for turn in turns:
            t = self.trajectories[turn.row]
            n, room = len(turn.tokens), room_left(t, config, self.max_new_tokens)
            t.last_turn = turn.tokens[:min(n, room)]
            t.add(t.last_turn, True, turn.logprobs[:len(t.last_turn)], turn.entropy[:len(t.last_turn)])
            t.turns += 1
            if n > room:
                t.end = "max_episode_tokens"
            elif turn.truncated:
                t.end = "length"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="qerl-episode-tools")
        self._pending.append(self._pool.submit(self._follow, [turn.row for turn in turns]))

    def collect(self) -> dict[int, list[int] | None]:
        start = time.perf_counter()
        observations = {}
        for job in self._pending:
            observations.update(job.result())
        self._pending = []
        self.wait_s += time.perf_counter() - start
        return observations

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def _follow(self, rows: list[int]) -> dict[int, list[int] | None]:
        """What follows the turns of ``rows`` (in the background: those trajectories are this job's until collected):
        the tool calls every row made, run at once, and their observations rendered; None where the episode ends."""
        config, tokenizer = self.config, self.tokenizer
        start = time.perf_counter()
        calls = {row: read_turn(self.trajectories[row], tokenizer, self.call_format, config) for row in rows
                 if self.trajectories[row].end is None}
        answers = run_calls(self.runner, calls, self.trajectories)
        self.tool_s += time.perf_counter() - start
        observations: dict[int, list[int] | None] = dict.fromkeys(rows)
        for i, messages in answers.items():
            t = self.trajectories[i]
            if t.end is not None:
                continue
            ids = observation_ids(tokenizer, messages, self.eos_ids, self.tool_schemas, self.template_kwargs)
            if len(t.prompt) + len(t.tokens) + len(ids) >= token_limit(t, config, self.max_new_tokens):
                t.end = "max_episode_tokens"  # no room left for the model to answer
                continue
            t.add(ids, False)
            observations[i] = list(ids)
        return observations


def token_limit(t: Trajectory, config: AgentConfig, max_new_tokens: int) -> int:
    """The trajectory's token budget, prompt included."""
    if config.max_episode_tokens is not None:
        return config.max_episode_tokens
    return len(t.prompt) + max_new_tokens * config.max_turns


def room_left(t: Trajectory, config: AgentConfig, max_new_tokens: int) -> int:
    """Tokens the trajectory may still add."""
    return max(0, token_limit(t, config, max_new_tokens) - len(t.prompt) - len(t.tokens))


def read_turn(t: Trajectory, tokenizer, call_format: str, config: AgentConfig) -> tuple[list[ToolCall], bool]:
    """What follows the model's finished turn: its tool calls, or (True) a call of the environment's ``step`` with
    the turn's text; sets ``t.end`` when the episode ends here."""
    text = tokenizer.decode(t.last_turn[:-1], skip_special_tokens=False)  # the end-of-turn token dropped
    calls, stepping = parse_tool_calls(text, call_format), False
    if not calls:
        if environment_step(t.environment) is None:
            t.end = "answer"
            return [], False
        calls, stepping = [ToolCall(STEP, {"message": tokenizer.decode(t.last_turn, skip_special_tokens=True)})], True
    if t.turns >= config.max_turns:
        t.end = "max_turns"
    elif not stepping and t.tool_calls + len(calls) > config.max_tool_calls:
        t.end = "max_tool_calls"
    return calls, stepping


def run_calls(runner: ToolRunner, calls: dict[int, tuple[list[ToolCall], bool]],
              trajectories: list[Trajectory]) -> dict[int, list[dict]]:
    """Every live row's tool calls and environment steps at once; each row's observation messages (tool results, or
    the environment's user message), its counts and ends updated."""
    jobs = []
    for i, (row, stepping) in calls.items():
        t = trajectories[i]
        if t.end is None:
            tools = {STEP: environment_step(t.environment)} if stepping else t.tools
            jobs += [(i, call, stepping, tools) for call in row]
    results: list[ToolResult] = runner.run_all([(call, tools) for _, call, _, tools in jobs])
    messages: dict[int, list[dict]] = {i: [] for i in calls}
    for (i, _, stepping, _), result in zip(jobs, results):
        t = trajectories[i]
        if result.error is not None:
            t.errors[result.error] += 1
        if stepping:  # the environment's reply is the next user message; None (or a failure) ends the episode
            if result.error is not None or result.value is None:
                t.end = "environment"
            else:
                messages[i].append({"role": "user", "content": result.content})
            continue
        t.tool_calls += 1
        t.tool_seconds += result.seconds
        messages[i].append(result.message())
    return messages


def finish(trajectories: list[Trajectory], tokenizer, pad_id: int, device) -> Episodes:
    """The trajectories as one ``Rollout`` (completions right-padded) with the texts the rewards and logs read."""
    n, width = len(trajectories), max(1, max(len(t.tokens) for t in trajectories))
    prompt_width = max(len(t.prompt) for t in trajectories)
    prompt_ids = torch.full((n, prompt_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, prompt_width), dtype=torch.long)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask, generated = torch.zeros((n, width), dtype=torch.long), torch.zeros((n, width), dtype=torch.long)
    logprobs, entropy = torch.zeros((n, width)), torch.zeros((n, width))
    for r, t in enumerate(trajectories):
        prompt_ids[r, prompt_width - len(t.prompt):] = torch.tensor(t.prompt)
        prompt_mask[r, prompt_width - len(t.prompt):] = 1
        k = len(t.tokens)
        ids[r, :k], mask[r, :k], generated[r, :k] = torch.tensor(t.tokens, dtype=torch.long), 1, torch.tensor(
            t.generated, dtype=torch.long)
        logprobs[r, :k], entropy[r, :k] = torch.tensor(t.logprobs), torch.tensor(t.entropy)
        t.end = t.end or "answer"
    truncated = torch.tensor([t.end in CUT for t in trajectories])
    rollout = Rollout(prompt_ids.to(device), prompt_mask.to(device), ids.to(device), mask.to(device),
                      logprobs.to(device), entropy.to(device), truncated.to(device), generated.to(device))
    scores = [getattr(t.environment, "get_reward", None) for t in trajectories]
    rewards = None
    if any(callable(s) for s in scores):
        rewards = torch.tensor([environment_reward(s, t) for s, t in zip(scores, trajectories)])
    return Episodes(rollout,
                    [tokenizer.decode(t.last_turn, skip_special_tokens=True) for t in trajectories],
                    [tokenizer.decode(t.tokens, skip_special_tokens=False) for t in trajectories],
                    rewards, trajectories)


def environment_reward(get_reward, trajectory: Trajectory) -> float:
    """The environment's score of ``trajectory`` (0 without ``get_reward``); a ``get_reward`` that raises or returns
    no finite number scores 0 and counts as the environment having raised: the step goes on."""
    if not callable(get_reward):
        return 0.0
    try:
        value = float(get_reward())
    except Exception:  # the user's code: whatever it raises, the batch is not lost
        value = float("nan")
    if not math.isfinite(value):
        trajectory.errors["raised"] += 1
        return 0.0
    return value
