"""The data module: the training stream and the evaluation sets as batches of prompts (``PromptStream`` makes them),
the stream's state in the checkpoint, and the prompts a refill draws in the middle of a step."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import lightning as L
from torch.utils.data import DataLoader

from qerl.data.prompt_format import FORMAT_INSTRUCTIONS
from qerl.data.prompt_stream import SKIPPED_COUNTERS, PromptStream, collate
from qerl.data.sources import ArithmeticSource, Mixture, PromptSource
from qerl.ranks import gather_rank_states


def refill_workers_error(num_workers: int) -> str:
    """The one ``data.num_workers`` rule of refills (checked when the command line is parsed and when the data module
    hands its prompts over)."""
    return (f"data.num_workers={num_workers}: refilling a batch (model.dapo.max_refill_rounds) draws prompts from the "
            "training stream in the main process: set data.num_workers: 0.")


class MathPromptDataModule(L.LightningDataModule):
    """Streams chat-formatted math prompts for RL: ``batch_size`` prompts per step (the trainer samples G completions
    of each). The training stream is endless and never ends an epoch: ``trainer.max_steps`` bounds training, and
    validation needs an integer ``val_check_interval`` with ``check_val_every_n_epoch: null``.

    Each batch is ``{"prompts": list[str], "prompt_ids": list[list[int]], "answers": list[str], "sources": list[str]}``
    plus ``questions``, ``levels``, ``subjects`` and ``columns`` (each row's own columns) (lists, ``None`` where a
    source has no level or subject); training batches also carry ``skipped``, the stream's counts of rows and prompts
    skipped so far per reason.
    The stream position is part of ``state_dict`` (saved in checkpoints), so ``fit --ckpt_path`` continues the stream.

    Args:
        sources: Training sources (default: the embedded ``ArithmeticSource``, a + b with a, b in 1..9).
        weights: Mixing weights, one per source (default: equal).
        tokenizer: Model name or path whose tokenizer and chat template format the prompts.
        batch_size: Prompts per training step.
        system_prompt: System message (``None``: the chat template's default).
        answer_format: How the final answer is asked for and checked (the reward follows this setting): ``none``
            (no instruction; any marked answer counts), ``gsm8k`` (end with ``#### <number>``),
            ``boxed`` (final answer in ``\\boxed{}``) or ``tags`` (``<think>...</think><answer>...</answer>``).
        max_prompt_tokens: Prompts longer than this, chat template included, are skipped and counted.
        shuffle_buffer: Size of the seeded shuffle buffer.
        seed: Seed of shuffling and mixing.
        num_workers: DataLoader worker processes (0: tokenize in the main process).
        val_sources: Evaluation sources, each read once in order (one validation dataloader each; ``test`` reads
            the same sources).
        val_batch_size: Prompts per validation batch (default: ``batch_size``).
        instruction: Text appended to each question instead of ``answer_format``'s standard instruction (e.g. one
            with an example, for a small model that does not follow the standard one yet); with ``{question}`` in it,
            the whole user message, the question in its place. A source's own ``instruction`` wins for its rows.
        chat_template_kwargs: Extra variables of the tokenizer's chat template, as TRL's option of that name: Qwen3's
            thinking mode is ``{enable_thinking: false}`` (off, as the Qwen3 recipes set it) or ``true``.
        tools: JSON schemas of the tools the prompts show (set from ``model.agent`` by the CLI).
        chat_template: the chat template replacing the tokenizer's (set from ``model.agent.chat_template``).
    """

    def __init__(
        self,
        sources: list[PromptSource] | None = None,
        weights: list[float] | None = None,
        tokenizer: str = "smollm2-135m-instruct",
        batch_size: int = 8,
        system_prompt: str | None = None,
        answer_format: Literal["none", "gsm8k", "boxed", "tags"] = "none",
        max_prompt_tokens: int = 256,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        num_workers: int = 0,
        val_sources: list[PromptSource] | None = None,
        val_batch_size: int | None = None,
        instruction: str | None = None,
        chat_template_kwargs: dict[str, bool | int | float | str] | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
    ):
        super().__init__()
        if answer_format not in FORMAT_INSTRUCTIONS:
            raise ValueError(f"data.answer_format={answer_format!r}: use one of {list(FORMAT_INSTRUCTIONS)}.")
        for option, value, low in [
            ("batch_size", batch_size, 1),
            ("max_prompt_tokens", max_prompt_tokens, 1),
            ("shuffle_buffer", shuffle_buffer, 0),
            ("num_workers", num_workers, 0),
            ("val_batch_size", val_batch_size or 1, 1),
        ]:
            if value < low:
                raise ValueError(f"data.{option}={value}: must be >= {low}.")
        sources = [ArithmeticSource(seed=seed)] if sources is None else list(sources)
        if not sources:
            raise ValueError("data.sources is empty: give at least one source, or leave it unset for the default.")
        if weights is not None and len(weights) != len(sources):
            raise ValueError(f"data.weights has {len(weights)} values for {len(sources)} sources: give one per source.")
        self.source = sources[0] if len(sources) == 1 else Mixture(sources, weights, seed)
        self.val_sources = list(val_sources or [])
        if any(s.infinite for s in self.val_sources):
            raise ValueError(
                "data.val_sources must be finite (each is read once): e.g. ArithmeticSource(num_rows=200)."
            )
        self.tokenizer_name, self.batch_size, self.val_batch_size = tokenizer, batch_size, val_batch_size or batch_size
        self.system_prompt, self.answer_format, self.max_prompt_tokens = system_prompt, answer_format, max_prompt_tokens
        self.shuffle_buffer, self.seed, self.num_workers = shuffle_buffer, seed, num_workers
        self.instruction, self.chat_template_kwargs = instruction, dict(chat_template_kwargs or {})
        self.tools, self.chat_template = tools, chat_template
        self.tokenizer = None
        self.train_stream: PromptStream | None = None
        self._pending_state: dict | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is None:
            from qerl.hub import load_tokenizer
            from qerl.tools.chat_template import with_chat_template

            self.tokenizer = with_chat_template(load_tokenizer(self.tokenizer_name), self.chat_template)
        if self.train_stream is None:
            trainer = self.trainer
            rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
            self.train_stream = self._stream(self.source, self.shuffle_buffer, endless=True, rank=rank, world=world)
            if self._pending_state is not None:
                self.train_stream.load_state_dict(self._pending_state)
                self._pending_state = None

    def _stream(self, source: PromptSource, shuffle_buffer: int, endless: bool, rank: int, world: int) -> PromptStream:
        return PromptStream(
            source,
            self.tokenizer,
            self.answer_format,
            self.system_prompt,
            self.max_prompt_tokens,
            shuffle_buffer,
            self.seed,
            endless,
            rank,
            world,
            self.instruction,
            {**self.chat_template_kwargs, "tools": self.tools} if self.tools else self.chat_template_kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(
            self.train_stream,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=partial(collate, with_state=True),
        )

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per ``val_sources`` entry, each read once in order (empty list: no validation)."""
        self.setup()
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return [
            DataLoader(
                self._stream(s, 0, endless=False, rank=rank, world=world),
                batch_size=self.val_batch_size,
                num_workers=self.num_workers,
                collate_fn=partial(collate, with_state=False),
            )
            for s in self.val_sources
        ]

    def test_dataloader(self) -> list[DataLoader]:
        """The ``val_sources`` again (``python train.py test``)."""
        return self.val_dataloader()

    def on_before_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        # Lightning calls this for the batch it is about to train on (after prefetching the next one), so committing
        # here saves exactly the consumed position.
        state = batch.pop("stream_state", None)
        if state is not None and self.train_stream is not None:
            self.train_stream.update(state)
            stats = self.train_stream.stats
            batch["skipped"] = {reason: stats.get(reason, 0) for reason in SKIPPED_COUNTERS}  # for the logger
        return batch

    def refill_prompts(self) -> Callable[[int], dict]:
        """Dynamic sampling's source of more prompts, handed to the module once: called with ``n``, the next ``n``
        training prompts of this rank's stream, right after the ones drawn so far, as a batch (without
        ``stream_state``). They count as consumed at once, so a checkpoint written after this step resumes past
        them."""
        if self.num_workers:
            raise ValueError(refill_workers_error(self.num_workers))
        return self._draw_prompts

    def _draw_prompts(self, n: int) -> dict:
        return collate(self.train_stream.take(n), with_state=False)

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the training stream (prompts, too_long, rows, missing_answer, filtered, epochs)."""
        return self.train_stream.stats if self.train_stream is not None else {}

    def state_dict(self) -> dict:
        if self.train_stream is None:
            return {"train_stream": self._pending_state} if self._pending_state else {}
        return {"train_stream": gather_rank_states(self.train_stream.state_dict())}  # a collective under DDP

    def load_state_dict(self, state_dict: dict) -> None:
        # Lightning restores the data module before `setup`; keep the state until the stream exists.
        state = state_dict.get("train_stream")
        if state is None:
            return
        if self.train_stream is None:
            self._pending_state = state
        else:
            self.train_stream.load_state_dict(state)
