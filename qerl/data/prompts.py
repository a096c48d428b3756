"""The prompt stream and the data module: rows of a source -> chat-formatted, tokenized, sharded prompt batches.

Pipeline of ``PromptStream.__iter__`` (the same in every process, so every process sees the same global order):

    source rows (cycled when endless) -> seeded shuffle buffer -> global index i -> keep i % K == consumer
    -> chat template + tokenize -> drop prompts over max_prompt_tokens -> items -> batches (collate)

K = world_size x DataLoader workers; consumer = rank x workers + worker id. Lightning never shards an
IterableDataset, and each DataLoader worker would otherwise replay the full stream. Sharding by index means every
consumer reads (but does not tokenize) the whole stream; like ``datasets.distributed.split_dataset_by_node``.

Resuming: each training batch carries ``stream_state`` = (worker, next round, counters); the data module pops it in
``on_before_batch_transfer`` (so ``training_step`` never sees it) and commits it, so the saved state covers exactly
the batches training received (not those Lightning prefetched). The checkpoint holds every rank's state. A resumed
stream regenerates the global order and skips, without tokenizing, to where each of its workers stopped; on another
number of ranks or workers, every consumer starts at the first row that some saved consumer had not reached.

Refills (``take``, dynamic sampling): training may draw more prompts from the same stream in the middle of a step.
They come from the very iterator the DataLoader reads (in the main process: ``data.num_workers: 0``), right after the
batch Lightning already prefetched, and count as consumed at once. The prefetched batch then lies before the committed
position without having been trained on: the state keeps those items (``pending``) and a resumed stream yields them
first, so it continues exactly as the uninterrupted stream did.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Literal

import lightning as L
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from qerl.data.skips import SKIP_REASONS
from qerl.ranks import gather_rank_states
from qerl.data.sources import ArithmeticSource, Mixture, PromptSource, endless

# Instructions appended to the question. ``boxed`` is the Qwen2.5-Math / DeepSeek-R1 prompt; ``tags`` the
# DeepSeek-R1-Zero / open-r1 format that the reference recipes reward.
FORMAT_INSTRUCTIONS = {
    "none": "",
    "gsm8k": "Solve the problem step by step, then write the final number on its own line as `#### <number>`.",
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "tags": (
        "First think about the reasoning process, then give the answer. Enclose the reasoning in <think> </think> and "
        "the final answer in <answer> </answer> tags, i.e. <think> reasoning here </think><answer> answer here </answer>."
    ),
}
STREAM_COUNTERS = ("prompts", "too_long")  # counted per consumer over its share: summed across consumers
SKIPPED_COUNTERS = (*SKIP_REASONS, "too_long")  # rows and prompts training never sees, logged as data/skipped_*


def format_prompt(
    tokenizer, question: str | list[dict], answer_format: str = "none", system_prompt: str | None = None,
    instruction: str | None = None, chat_template_kwargs: dict | None = None,
) -> str:
    """The chat-formatted prompt text, ending with the assistant turn's opening (``add_generation_prompt``);
    ``instruction`` replaces the answer format's standard one. A conversation (a list of ``{"role", "content"}``
    messages) goes through the chat template as it is, the instruction appended to its last user message and
    ``system_prompt`` put first unless it opens with a system message of its own. An instruction that contains
    ``{question}`` is the whole user message instead, the question in its place (lighteval's prompts put the
    instruction first). ``chat_template_kwargs`` go to the template (Qwen3's ``enable_thinking``)."""
    instruction = FORMAT_INSTRUCTIONS[answer_format] if instruction is None else instruction
    messages = [dict(m) for m in question] if isinstance(question, list) else [{"role": "user", "content": question}]
    users = [m for m in messages if m["role"] == "user"]
    if instruction and users:
        text = users[-1]["content"]
        users[-1]["content"] = (instruction.replace("{question}", text) if "{question}" in instruction
                                else f"{text}\n{instruction}")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(chat_template_kwargs or {}))


def shuffled(rows: Iterator, buffer: int, rng: random.Random) -> Iterator:
    """A seeded shuffle buffer: each row leaves at a random time within ``buffer`` rows of its arrival."""
    if buffer <= 1:
        yield from rows
        return
    pool = []
    for row in rows:
        if len(pool) < buffer:
            pool.append(row)
            continue
        j = rng.randrange(buffer)
        yield pool[j]
        pool[j] = row
    rng.shuffle(pool)
    yield from pool


class PromptStream(IterableDataset):
    """Chat-formatted, tokenized prompts from a source, sharded by rank and DataLoader worker, resumable.

    Items are dicts with ``prompt``, ``prompt_ids``, ``answer``, ``source``, ``question`` (the raw text or messages),
    ``level`` and ``subject`` (``None`` when the source has none), ``columns`` (the record's own columns, for the
    reward functions) and ``stream_state``.

    Args:
        source: Where rows come from.
        tokenizer: A tokenizer with a chat template.
        answer_format: Instruction appended to each question: ``none``, ``gsm8k``, ``boxed`` or ``tags``.
        system_prompt: System message (``None``: the chat template's default).
        max_prompt_tokens: Prompts longer than this (chat template included) are skipped and counted.
        shuffle_buffer: Size of the seeded shuffle buffer (0 or 1: source order).
        seed: Seed of the shuffle.
        endless: Restart a finite source when it ends (training); ``False`` reads it once (evaluation).
        rank: Global rank of this process.
        world_size: Number of processes.
        instruction: Text appended to each question instead of ``answer_format``'s standard instruction.
        chat_template_kwargs: Extra variables of the chat template (e.g. ``{"enable_thinking": False}``).
    """

    def __init__(
        self,
        source: PromptSource,
        tokenizer,
        answer_format: str = "none",
        system_prompt: str | None = None,
        max_prompt_tokens: int = 256,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        endless: bool = True,
        rank: int = 0,
        world_size: int = 1,
        instruction: str | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        if answer_format not in FORMAT_INSTRUCTIONS:
            raise ValueError(f"answer_format={answer_format!r}: use one of {list(FORMAT_INSTRUCTIONS)}.")
        if max_prompt_tokens < 1 or shuffle_buffer < 0 or not 0 <= rank < world_size:
            raise ValueError("PromptStream needs max_prompt_tokens >= 1, shuffle_buffer >= 0, 0 <= rank < world_size.")
        if not endless and source.infinite:
            raise ValueError(
                f"{type(source).__name__} never ends, so it cannot be read once (evaluation): use a finite source, "
                "e.g. ArithmeticSource(num_rows=200, seed=1234)."
            )
        self.source, self.tokenizer = source, tokenizer
        self.answer_format, self.system_prompt, self.max_prompt_tokens = answer_format, system_prompt, max_prompt_tokens
        self.shuffle_buffer, self.seed, self.endless = shuffle_buffer, seed, endless
        self.rank, self.world_size, self.instruction = rank, world_size, instruction
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._rounds: dict[int, int] = {}  # local worker -> rounds of its share passed (committed by `update`)
        self._counters: dict[int, dict] = {}  # local worker -> its last counters
        self._layout: tuple[int, int] | None = None  # (world_size, workers) the rounds were counted with
        self._last_worker = -1  # the worker that built the last committed batch
        self._resume_index = 0  # first global index some consumer of a saved run had not reached (layout changes)
        self._live: Iterator[dict] | None = None  # the training iterator of this process (main process only): refills
        self._yielded: deque[dict] = deque()  # items it yielded that no commit covers yet (a prefetched batch)

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        resuming = (self.world_size, workers) == self._layout
        pending = self._untrained() if resuming else []
        items = self._items(workers, worker, resuming)
        if info is not None or not self.endless:
            return items
        # The main process's training stream: track what it yields, so `take` can draw from it and a checkpoint
        # can keep what was yielded (prefetched) but not trained on.
        self._yielded = deque()
        self._live = self._tracked(_chain(pending, items))
        return self._live

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_live": None}  # a running generator does not pickle (DataLoader workers, copies)

    def _tracked(self, items: Iterable[dict]) -> Iterator[dict]:
        for item in items:
            self._yielded.append(item)
            yield item

    def _untrained(self) -> list[dict]:
        """Items yielded before the committed position that no batch committed: a batch prefetched before a `take`."""
        return [item for item in self._yielded if _next_round(item) <= self._rounds.get(item["stream_state"][0], 0)]

    def take(self, n: int) -> list[dict]:
        """``n`` more items of this process's training stream, where it stands (after any prefetched batch), committed
        at once: a checkpoint after them resumes past them (dynamic sampling's refill)."""
        if self._live is None:
            raise RuntimeError(
                "Refilling a batch draws prompts from the training stream of the main process, which has not started "
                "(data.num_workers must be 0, and the training DataLoader must be iterating)."
            )
        items = []
        for _ in range(n):
            items.append(next(self._live))
            self._yielded.pop()  # consumed now, not pending
        if items:
            self._commit(items[-1]["stream_state"])
        return items

    def _items(self, workers: int, worker: int, resuming: bool) -> Iterator[dict]:
        if resuming:
            # The DataLoader asks its workers for batches in turn, starting with worker 0: let DataLoader worker 0
            # play the worker whose turn was next when the state was saved, so the order continues exactly.
            worker = (worker + self._last_worker + 1) % workers
        k, me = self.world_size * workers, self.rank * workers + worker
        start = self._start_round(me, k, worker, workers)
        saved = self._counters.get(worker, {}) if resuming else {}
        counts = Counter({key: saved.get(key, 0) for key in STREAM_COUNTERS})
        rows = endless(self.source) if self.endless and not self.source.infinite else iter(self.source)
        for i, row in enumerate(shuffled(rows, self.shuffle_buffer, random.Random(self.seed))):
            if i % k != me or i // k < start:  # another consumer's row, or one this consumer already passed
                continue
            prompt = format_prompt(self.tokenizer, row["question"], self.answer_format, self.system_prompt,
                                   row.get("instruction", self.instruction), self.chat_template_kwargs)
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]  # the template has the specials
            if len(ids) > self.max_prompt_tokens:
                counts["too_long"] += 1
                continue
            counts["prompts"] += 1
            state = (worker, workers, self.world_size, i // k + 1, {**self.source.stats, **counts})
            yield {
                "prompt": prompt,
                "prompt_ids": ids,
                "answer": row["answer"],
                "source": row["source"],
                "question": row["question"],
                "level": row.get("level"),
                "subject": row.get("subject"),
                "columns": row.get("columns") or {k: v for k, v in row.items() if k != "question"},
                "stream_state": state,
            }

    def _start_round(self, me: int, k: int, worker: int, workers: int) -> int:
        """First round of this consumer's share to read: where it stopped, or, if the layout changed (K differs) or
        this rank was not in the saved run, the first round at or past the saved run's earliest unread row, so no
        prompt is skipped and few repeat."""
        if self._layout == (self.world_size, workers):
            return self._rounds.get(worker, 0)
        return max(0, -(-(self._resume_index - me) // k))

    def update(self, stream_state: tuple) -> None:
        """Commit the position carried by a batch that training received."""
        while self._yielded and _next_round(self._yielded[0]) <= stream_state[3]:
            self._yielded.popleft()  # this batch's items: trained now
        self._commit(stream_state)

    def _commit(self, stream_state: tuple) -> None:
        worker, workers, world_size, next_round, counters = stream_state
        if self._layout != (world_size, workers):
            self._layout, self._rounds, self._counters = (world_size, workers), {}, {}
            self._resume_index = 0
        # a batch prefetched before a refill commits after the refill: the position never steps back
        if next_round >= self._rounds.get(worker, 0):
            self._rounds[worker] = next_round
            self._counters[worker] = counters
        self._last_worker = worker

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the committed stream: prompts yielded and skipped ``too_long`` (summed over workers), and the
        source's counters (rows, missing_answer, filtered, epochs; every worker reads the whole global stream, so
        these are those of the worker that read furthest)."""
        total: Counter = Counter()
        for counters in self._counters.values():
            for key, value in counters.items():
                total[key] = total[key] + value if key in STREAM_COUNTERS else max(total[key], value)
        return dict(total)

    def state_dict(self) -> dict:
        return {
            "rounds": dict(self._rounds),
            "counters": dict(self._counters),
            "layout": self._layout,
            "last_worker": self._last_worker,
            "pending": self._untrained(),
        }

    def load_state_dict(self, state: dict) -> None:
        """This rank's position from a checkpoint's stream state: every rank's (``{"ranks": [...]}``, what the data
        module saves) or a single one (a stream's own ``state_dict``; older checkpoints: rank 0's)."""
        states = state["ranks"] if set(state) == {"ranks"} else [state]
        own = states[self.rank] if self.rank < len(states) else None
        self._rounds = {int(w): r for w, r in own["rounds"].items()} if own else {}
        self._counters = {int(w): c for w, c in own["counters"].items()} if own else {}
        self._layout = tuple(own["layout"]) if own and own["layout"] is not None else None
        self._last_worker = own["last_worker"] if own else -1
        self._yielded = deque(own.get("pending", []) if own else [])  # yielded first when the stream resumes
        # Where a changed layout resumes: the earliest row some saved consumer (rank r, worker w: consumer
        # r * workers + w of K = world x workers) had not reached.
        unread = [(rank * saved["layout"][1] + int(w)) + rounds * saved["layout"][0] * saved["layout"][1]
                  for rank, saved in enumerate(states) if saved and saved["layout"] is not None
                  for w, rounds in saved["rounds"].items()]
        self._resume_index = min(unread, default=0)


def _next_round(item: dict) -> int:
    return item["stream_state"][3]


def _chain(first: list[dict], rest: Iterator[dict]) -> Iterator[dict]:
    yield from first
    yield from rest


def refill_workers_error(num_workers: int) -> str:
    """The one ``data.num_workers`` rule of refills (checked when the command line is parsed and when the data module
    hands its prompts over)."""
    return (f"data.num_workers={num_workers}: refilling a batch (model.dapo.max_refill_rounds) draws prompts from the "
            "training stream in the main process: set data.num_workers: 0.")


def collate(items: list[dict], with_state: bool = True) -> dict:
    """Items -> a batch: ``prompts`` (chat text), ``prompt_ids`` (ragged lists, unpadded), ``answers``, ``sources``,
    for evaluation breakdowns ``questions`` (raw text or messages), ``levels`` and ``subjects`` (``None`` entries if
    absent), and ``columns`` (each row's own columns, for the reward functions)."""
    batch = {
        "prompts": [x["prompt"] for x in items],
        "prompt_ids": [x["prompt_ids"] for x in items],
        "answers": [x["answer"] for x in items],
        "sources": [x["source"] for x in items],
        "questions": [x.get("question") for x in items],
        "levels": [x.get("level") for x in items],
        "subjects": [x.get("subject") for x in items],
        "columns": [x.get("columns") or {} for x in items],
    }
    if with_state:
        batch["stream_state"] = items[-1]["stream_state"]  # one worker builds a whole batch: its last position
    return batch


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
