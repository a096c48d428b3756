"""``model.agent`` made concrete for a run: its tools loaded, its environment's factory, the tokenizer's call format,
checked against the chat template; ``run`` plays one batch's episodes; ``EpisodeEngine`` plays them for evaluation."""

from __future__ import annotations

import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import Episodes, run_episodes
from qerl.rollout.base import Rollout
from qerl.rollout.episodes import BoundEngine
from qerl.tools.chat_template import call_format, check_tool_support


class EpisodeRunner:
    """The episodes of a run.

    Args:
        config: ``model.agent``.
        tokenizer: the policy's tokenizer, with ``config.chat_template`` applied.
        model: the model's name, for error messages.
        template_kwargs: extra chat template variables (the data's ``chat_template_kwargs``).
    """

    def __init__(self, config: AgentConfig, tokenizer, model: str, template_kwargs: dict | None = None):
        self.config, self.tokenizer, self.template_kwargs = config, tokenizer, dict(template_kwargs or {})
        self.tools, self.environment = config.load()
        self.schemas = [t.schema for t in self.tools]
        if self.environment is not None:
            self.schemas += [t.schema for t in self.environment.slot(0)[1]]
        check_tool_support(tokenizer, self.schemas, model)
        self.call_format = call_format(tokenizer)

    def play(self, engine, policy, batch: dict, group_size: int, pad_id: int, eos_ids: list[int], spec) -> Episodes:
        """``group_size`` episodes of each prompt of ``batch`` (its ``prompt_ids`` rendered with the tools; its
        ``columns`` reset the environments), every turn sampled by ``engine`` with ``spec`` (its ``max_new_tokens``
        per turn), the engine's way (``play_episodes``)."""
        rows = batch.get("columns") or [{} for _ in batch["prompt_ids"]]
        return run_episodes(BoundEngine(engine, policy, pad_id, eos_ids, spec), batch["prompt_ids"], rows, group_size,
                            self.tokenizer, eos_ids, pad_id, self.config, self.tools, self.environment,
                            spec.max_new_tokens, self.call_format, self.schemas, self.template_kwargs)


class EpisodeEngine:
    """A rollout engine whose ``generate`` plays whole episodes of ``batch``'s prompts, each row's completion the
    model's last turn: evaluation scores an agent through the unchanged ``Evaluator``.

    Args:
        runner: the run's episodes.
        engine: the rollout engine that samples each turn.
        batch: the evaluation batch (its ``columns`` reset the environments).
    """

    def __init__(self, runner: EpisodeRunner, engine, batch: dict):
        self.runner, self.engine, self.batch = runner, engine, batch

    def generate(self, policy, prompt_ids, group_size: int, pad_id: int, eos_ids: list[int], spec) -> Rollout:
        episodes = self.runner.play(self.engine, policy, {**self.batch, "prompt_ids": prompt_ids}, group_size, pad_id,
                                    eos_ids, spec)
        r, turns = episodes.rollout, [t.last_turn for t in episodes.trajectories]
        ids = torch.full((len(turns), max(1, max(map(len, turns)))), pad_id, dtype=torch.long)
        for row, turn in enumerate(turns):
            ids[row, :len(turn)] = torch.tensor(turn, dtype=torch.long)
        ids = ids.to(r.completion_ids.device)
        mask = (torch.arange(ids.shape[1], device=ids.device)[None] < torch.tensor(
            [len(t) for t in turns], device=ids.device)[:, None]).long()
        return Rollout(r.prompt_ids, r.prompt_mask, ids, mask, torch.zeros(ids.shape, device=ids.device),
                       torch.zeros(ids.shape, device=ids.device), r.truncated)
