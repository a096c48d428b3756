"""How an engine plays multi-turn episodes: the engine samples every turn, the caller (``qerl.agents``) says after each
turn what comes next.

    engine                                         caller (an ``EpisodeTurns``)
    turn 1 of every row, at most budget(row)  ->   submit([TurnEnd, ...]): the tools of the rows that stopped start
    (the other rows may decode on meanwhile)
    rows it answered continue from their own  <-   collect(): {row: observation tokens, or None: the episode ended}
    context + the observation

``resubmit_episodes`` is the plain way, every engine's default (``RolloutEngine.play_episodes``): each turn is one
``generate`` over the live rows' whole contexts (the prompt, every turn and observation so far). The CUDA-graph engine
overrides it and appends each observation to the row's KV cache instead (``qerl.rollout.cuda_graph``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

# (contexts, samples per context, max new tokens) -> the engine's ``Rollout`` of len(contexts) * samples rows (base.py
# imports this module for its default ``play_episodes``: the type is named, not imported)
Sampler = Callable[[list[list[int]], int, int], Any]


class TurnEnd(NamedTuple):
    """One row's finished turn: the tokens the policy sampled (its end-of-turn token included where it wrote one)."""

    row: int  # the trajectory: prompt index * group_size + sample
    tokens: list[int]
    logprobs: list[float]  # the sampling policy's log-prob of each token
    entropy: list[float]  # the sampling distribution's entropy at each token
    truncated: bool  # cut by the turn's budget before an end-of-turn token


class EpisodeTurns(Protocol):
    """The caller's side of an episode (``qerl.agents.episode``)."""

    completion_budget: int  # tokens an episode may add after its prompt (turns and observations), the longest row's

    def budget(self, row: int) -> int:
        """The most tokens ``row``'s next turn may sample (>= 1)."""

    def submit(self, turns: list[TurnEnd]) -> None:
        """Take finished turns; what follows them (their tools, the environment's reply) is worked out in the
        background while the engine decodes the other rows."""

    def collect(self) -> dict[int, list[int] | None]:
        """Wait for everything submitted so far; each of those rows' observation tokens, or None where its episode
        ended."""


def resubmit_episodes(sample: Sampler, prompt_ids: Sequence[Sequence[int]], group_size: int,
                      turns: EpisodeTurns) -> None:
    """Play the episodes with one ``sample`` call per turn over every live row's whole context (see the module
    docstring): one budget per call, the largest of the live rows' (the caller cuts each row's turn to its own)."""
    live = list(range(len(prompt_ids) * group_size))
    contexts, samples = [list(p) for p in prompt_ids], group_size
    so_far = {row: list(prompt_ids[row // group_size]) for row in live}
    while live:
        rollout = sample(contexts, samples, max(turns.budget(row) for row in live))
        lengths = rollout.completion_mask.sum(-1).tolist()
        ids, logprobs, entropy = (x.cpu() for x in (rollout.completion_ids, rollout.logprobs, rollout.entropy))
        truncated = rollout.truncated.tolist()
        ended = [TurnEnd(row, ids[k, :lengths[k]].tolist(), logprobs[k, :lengths[k]].tolist(),
                         entropy[k, :lengths[k]].tolist(), bool(truncated[k])) for k, row in enumerate(live)]
        turns.submit(ended)
        observations = turns.collect()
        for turn in ended:
            so_far[turn.row] += turn.tokens + (observations[turn.row] or [])
        live = [row for row in live if observations[row] is not None]
        contexts, samples = [so_far[row] for row in live], 1


class BoundEngine(NamedTuple):
    """An engine's ``play_episodes`` with the policy and how to sample bound (what ``qerl.agents`` plays with)."""

    engine: object  # a RolloutEngine
    policy: object
    pad_id: int
    eos_ids: list[int]
    spec: object  # a SamplingSpec: its max_new_tokens is each turn's

    def play(self, prompt_ids: Sequence[Sequence[int]], group_size: int, turns: EpisodeTurns) -> None:
        self.engine.play_episodes(self.policy, [list(p) for p in prompt_ids], group_size, self.pad_id, self.eos_ids,
                                  self.spec, turns)

    @property
    def device(self):
        return next(self.policy.parameters()).device
