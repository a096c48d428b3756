"""The prompt stream: rows of a source -> chat-formatted, tokenized, sharded prompt items, resumable.

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
from collections.abc import Iterable, Iterator

from torch.utils.data import IterableDataset, get_worker_info

from qerl.data.prompt_format import FORMAT_INSTRUCTIONS, format_prompt
from qerl.data.skips import SKIP_REASONS
from qerl.data.sources import PromptSource, endless

STREAM_COUNTERS = ("prompts", "too_long")  # counted per consumer over its share: summed across consumers
SKIPPED_COUNTERS = (*SKIP_REASONS, "too_long")  # rows and prompts training never sees, logged as data/skipped_*
TOO_LONG_AT_START = 1000  # prompts over max_prompt_tokens before a consumer's first fitting one: the limit is wrong



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
        too_long, shortest = 0, None  # prompts over the limit before this pass's first prompt, the shortest of them
        for i, row in enumerate(shuffled(rows, self.shuffle_buffer, random.Random(self.seed))):
            if i % k != me or i // k < start:  # another consumer's row, or one this consumer already passed
                continue
            prompt = format_prompt(self.tokenizer, row["question"], self.answer_format, self.system_prompt,
                                   row.get("instruction", self.instruction), self.chat_template_kwargs)
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]  # the template has the specials
            if len(ids) > self.max_prompt_tokens:
                counts["too_long"] += 1
                if too_long is not None:  # none yielded yet: an endless source would be read forever
                    too_long, shortest = too_long + 1, min(len(ids), shortest or len(ids))
                    if too_long == TOO_LONG_AT_START:
                        raise ValueError(
                            f"data.max_prompt_tokens={self.max_prompt_tokens}: the first {too_long} prompts were all "
                            f"longer (chat template included; the shortest {shortest} tokens). Fix: raise "
                            "data.max_prompt_tokens or give shorter prompts.")
                continue
            too_long = None  # a prompt fits: later runs of long ones are skipped and counted, never refused mid-run
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
