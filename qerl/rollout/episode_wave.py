"""The CUDA-graph engine's multi-turn episodes: one wave of rows plays its episodes to their ends in its KV cache.

    prompts --prefill once--> slot cache rows; every row decodes its first turn (graph replays, as single-turn)
    a row that samples its end-of-turn token (or reaches its turn's budget) stops and idles like a finished row:
        the columns it writes meanwhile stay masked in its ``mask`` row
    every ``turn_check_every`` steps (the engine's only host syncs): the rows that stopped are handed to the caller
        (``EpisodeTurns.submit``: their tools start in the background, every row's at once) and the others decode on;
        at the next check (at once if no row is left running) the engine collects what follows them: the rows that
        continue get their turn's last token + the observation (the block) as their next context, and decode on
        with the others, which never stopped; position ids go on from each row's own. A block of at most the
        engine's ``feed_observation_tokens`` is fed through the next decode steps, a token per step, sampling
        nothing until its last token (``DecodeState.start_feeding``: no launch of its own, the row's columns as a
        decoding row's); longer blocks are appended at the next columns by one eager prefill batched over their
        rows (through the fused prefill where the model is fused), launched behind ``prefill_lead_steps`` decode
        steps of the running rows
    the wave ends when no row's episode goes on; then the next wave (a row's turns all happen in its wave)

The schedule depends on the sampled tokens only (never on how fast a tool returns), so the episodes are the same run
after run. Columns are shared by the rows of a step, so a row skips the columns of the steps it idled and of the other
rows' observations (masked holes), and every step attends the holes up to the step's column. At a check where the
columns in use exceed the longest row's context by more than ``max_hole_columns`` (the attention would read that many
holes of every row at every step), or where the next stretch would not fit, ``DecodeState.defragment`` packs each
row's columns to the front (one gather over the cache, costed in ``WaveCosts`` beside the holes it saves): every row
holds at most its prompt + its episode's budget, so ``episode_columns`` after the prompt always suffice. Both follow
the rows' contexts, which follow the sampled tokens. A row's sampling noise is keyed by its output row and its own
token count (``DecodeState.col``): fresh at every turn, whatever the waves, slots or the other rows' turns.
"""

from __future__ import annotations

import torch
from torch.nn.attention import sdpa_kernel

from qerl.kernels.host_copy import to_device
from qerl.model.attention import SDPA_KERNELS
from qerl.rollout.decode_state import DecodeState
from qerl.rollout.episodes import EpisodeTurns, TurnEnd
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.rollout.wave_costs import WaveCosts


def episode_columns(budget: int, check_every: int) -> int:
    """Cache columns after the prompt that a wave of episodes needs, ``budget`` tokens each (turns and observations):
    after a defragment the longest row holds at most prompt + ``budget``; then an observation block (at most
    ``budget`` + the turn's last token) and ``check_every`` decode steps must fit."""
    return 2 * budget + 1 + check_every


def slot_layout(running: list[int], resumed: list[int], bucket: int, slots: int) -> tuple[int, list[int]]:
    """Where the slots go at a check, moving few (a move copies a slot's whole cache row): the ``running`` slots and
    the ``resumed`` ones must lie in the first ``bucket`` slots (the next steps' batch), the resumed ones side by side
    in their order (one prefill appends their observations). Returns the resumed block's first slot and ``order``:
    slot k takes what slot ``order[k]`` holds (a permutation of ``slots``)."""
    n, run = len(resumed), set(running)
    # the window of the resumed block that displaces the fewest running slots and keeps the most resumed ones in place
    first = min(range(bucket - n + 1), key=lambda a: sum(k in run for k in range(a, a + n))
                + sum(not a <= k < a + n for k in resumed))
    order, at = list(range(slots)), list(range(slots))  # at[source]: the slot it goes to

    def put(source: int, slot: int) -> None:  # swap ``source`` into ``slot``
        other, was = order[slot], at[source]
        order[slot], order[was], at[source], at[other] = source, other, slot, was

    for i, k in enumerate(resumed):
        put(k, first + i)
    free = [k for k in range(bucket) if not first <= k < first + n and order[k] not in run]
    for k in running:
        if at[k] >= bucket:
            put(k, free.pop())
    return first, order


class EpisodeWave:
    """One wave's episodes (see the module docstring), output rows ``first_row`` on.

    Args:
        engine: the ``CUDAGraphRollout`` whose steps run (prefill, decode step, sampling).
        s: its decode state, sized for the wave.
        policy: the policy sampled.
        spec: how to sample (``max_new_tokens`` is each turn's at most).
        turns: the caller's side: each row's turn budget, what follows each finished turn.
        first_row: the output row of the wave's first row.
    """

    def __init__(self, engine, s: DecodeState, policy, spec: SamplingSpec, turns: EpisodeTurns, first_row: int):
        self.engine, self.s, self.policy, self.spec, self.turns, self.first_row = engine, s, policy, spec, turns, \
            first_row
        self.turn_start: list[int] = []  # per wave row: the output column where its current turn began
        self.live: set[int] = set()  # wave rows whose episode goes on
        self.waiting: set[int] = set()  # wave rows handed over at the last check, their tools running
        self.last_token: dict[int, int] = {}  # per wave row: its turn's last token (appended before the observation)
        self.rows = 0  # the wave's rows
        self.eos: set[int] = set()
        self.check_every = engine.turn_check_every
        self.costs = WaveCosts()
        self.context: list[int] = []  # per wave row: the cache columns its mask keeps (host copy, no sync)
        self.col_seen: list[int] = []  # per wave row: its output column at the last check
        self.appended: dict[int, tuple[int, int]] = {}  # wave rows prefilled at the last check: (lead steps, block)
        self.feeding: dict[int, tuple[int, int]] = {}  # wave rows being fed: (the step of the stretch their block
        # starts at, its tokens not yet read by a decode step)
        self._copies = None  # the side stream that reads stopped turns while the check's lag steps run (CUDA)
        self.lengths: list[int] = []  # the attended columns of each decode step since the last check's state
        self.batches: list[int] = []  # and its batch rows

    def run(self, ids: torch.Tensor, mask: torch.Tensor, group_size: int, pad_id: int, eos_ids: list[int]) -> None:
        """Play the episodes of the prompts ``ids`` [B, P] (``mask`` their padding), ``group_size`` rows each."""
        engine, s, spec = self.engine, self.s, self.spec
        N, column = ids.shape[0] * group_size, ids.shape[1]
        buckets, logits = engine._start_wave(s, self.policy, ids, mask, group_size, pad_id, eos_ids, self.first_row,
                                             spec)
        step = engine.turn_bucket_rows
        if step is not None:  # rows end their episodes one by one: batches closer to the rows still playing
            buckets = sorted({x for x in buckets if x < step} | {x for x in range(step, N, step)
                                                                 if x >= engine.min_bucket} | {N})
        budgets = [self.turns.budget(self.first_row + r) for r in range(N)]
        s.limit[:N] = torch.tensor(budgets, device=ids.device)
        engine._record(s, logits, N, spec)
        del logits
        self.turn_start, self.live, self.eos, self.pad, self.rows = [0] * N, set(range(N)), set(eos_ids), pad_id, N
        self.context = mask.sum(-1).repeat_interleave(group_size).tolist()
        self.col_seen = [1] * N  # each row's first token came from the prompts' prefill
        engine._phase("decode")
        b, steps = N, 1
        while True:
            if steps % self.check_every == 0:
                state = self._read_state()
                for _ in range(engine.check_lag_steps):  # run on the GPU while the host does the check's work
                    column = self._decode_step(b, column)
                b, column, lead = self._between_turns(b, column, buckets, state)
                if b == 0:
                    return
                steps += engine.check_lag_steps + lead  # (fewer than check_every: the interval's first steps)
            column = self._decode_step(b, column)
            steps += 1

    def _decode_step(self, b: int, column: int) -> int:
        """One decode step of slots 0..b-1 at cache column ``column``; returns the next column."""
        self.lengths.append(self.engine._attended(self.s, column + 1))
        self.batches.append(b)
        self.engine._run_step(self.s, self.policy, b, self.lengths[-1], self.spec)
        return column + 1

    def _read_state(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The slots' ``finished``, ``col`` and ``slot_row`` as the steps launched so far leave them: a copy to the
        host queued behind those steps, and the event that marks it done (None off CUDA: the copy is done)."""
        s, N = self.s, self.rows
        state = torch.stack([s.finished[:N].long(), s.col[:N], s.slot_row[:N]])
        if state.device.type != "cuda":
            return state, None
        host = torch.empty(state.shape, dtype=state.dtype, pin_memory=True)
        host.copy_(state, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _between_turns(self, b: int, column: int, buckets: list[int],
                       state: tuple[torch.Tensor, torch.cuda.Event | None]) -> tuple[int, int, int]:
        """At a check, from the slots' ``state`` read before the engine's lag steps: take what follows the turns
        handed over at the last check (their tools ran meanwhile), hand over the rows that stopped since, move the
        rows to resume and the running ones into the next batch (``slot_layout``), let the running ones take the
        engine's lead steps, then append the observations that came back. Returns the next batch bucket (0: the
        wave is over), the next column and the lead steps taken."""
        s, N, lag = self.s, self.rows, self.engine.check_lag_steps
        # the state first: the steps queued run meanwhile either way, and what the caller then waits for the tools
        # (its ``collect``) is time the GPU had nothing to decode, not time it decoded the steps queued before
        host, done = state
        if done is not None:
            done.synchronize()
        finished, col, slot_row = host.tolist()
        ready = self.turns.collect() if self.waiting else {}
        collected, self.waiting = self.waiting, set()
        self._count_stretch(b, col, slot_row, lag)
        stopped = [k for k in range(b) if finished[k] and slot_row[k] in self.live and slot_row[k] not in collected]
        turns = self._turns_of(stopped, col, slot_row, done)
        if turns:
            self.turns.submit(list(turns.values()))
            self.waiting = {slot_row[k] for k in stopped}
            self.last_token.update({slot_row[k]: turns[k].tokens[-1] for k in stopped})
        running = [k for k in range(b) if not finished[k]]
        if not running and not any(obs is not None for obs in ready.values()) and self.waiting:
            ready.update(self.turns.collect())  # nothing else to decode: wait for the turns just handed over
            collected, self.waiting = collected | self.waiting, set()
        observations = {row - self.first_row: obs for row, obs in ready.items()}
        self.live -= {row for row in collected if observations[row] is None}
        resumed = [k for k in range(N) if slot_row[k] in collected and observations[slot_row[k]] is not None]
        if not running and not resumed:
            for rows, length in zip(self.batches, self.lengths):  # the lag steps after the state: no row ran
                self.costs.step(rows, length)
            return 0, column, 0
        block_of = {k: [self.last_token[slot_row[k]]] + list(observations[slot_row[k]]) for k in resumed}
        fed = [k for k in resumed if len(block_of[k]) <= self.engine.feed_observation_tokens]
        prefilled = [k for k in resumed if len(block_of[k]) > self.engine.feed_observation_tokens]
        blocks = [block_of[k] for k in prefilled]
        width = max(map(len, blocks), default=0)
        holes = column - max(self.context)
        if column + width + self.check_every > s.length or (self.engine.max_hole_columns is not None
                                                             and holes > self.engine.max_hole_columns):
            self.costs.packs += 1
            self.costs.packed_columns += N * column
            column = s.defragment(N, column)
            s.cache.position.fill_(column)
            if column + width + self.check_every > s.length:
                raise RuntimeError(f"CUDAGraphRollout: an episode outgrew its KV cache ({s.length} columns); the "
                                   f"episodes' completion_budget is {self.turns.completion_budget} tokens.")
        bucket = next(x for x in buckets if x >= len(running) + len(resumed))
        first, order = slot_layout(running + fed, prefilled, bucket, N)  # (fed rows need no block of slots)
        moving = [k for k in range(N) if order[k] != k]
        if moving:
            s.move([order[k] for k in moving], moving, column)
            self.costs.moved_columns += len(moving) * column
        for k in resumed:
            self.turn_start[slot_row[k]] = col[k]
        if fed:
            slot_of = {source: k for k, source in enumerate(order)}
            s.start_feeding([slot_of[k] for k in fed], [block_of[k] for k in fed],
                            [self.turns.budget(self.first_row + slot_row[k]) for k in fed])
            self.feeding.update({slot_row[k]: (lag, len(block_of[k]) - 1) for k in fed})
        lead = self.engine.prefill_lead_steps if running and prefilled else 0
        for _ in range(lead):  # queued on the GPU before the prefill's host-bound launches
            column = self._decode_step(bucket, column)
        if prefilled:
            for k, block in zip(prefilled, blocks):
                self.appended[slot_row[k]] = (lag + lead, len(block))
                self.col_seen[slot_row[k]] = col[k] + 1  # the block's prefill samples the turn's first token
            budgets = [self.turns.budget(self.first_row + slot_row[k]) for k in prefilled]
            column = self._append(first, blocks, budgets, column)
        return bucket, column, lead

    def _count_stretch(self, b: int, col: list[int], slot_row: list[int], lag: int) -> None:
        """Count the decode steps from the last check's state to this one's (``WaveCosts.stretch``) from the rows'
        output columns then; the ``lag`` steps launched since this state belong to the next stretch."""
        steps = len(self.lengths) - lag
        lengths, self.lengths = self.lengths[:steps], self.lengths[steps:]
        batches, self.batches = self.batches[:steps], self.batches[steps:]
        decoded, fed, fed_from = [0] * self.rows, [0] * self.rows, [0] * self.rows
        for k in range(b):
            decoded[slot_row[k]] = col[k] - self.col_seen[slot_row[k]]
        for row, (start, left) in list(self.feeding.items()):  # a fed row reads its block from its start on
            fed[row], fed_from[row] = min(left, steps - start), start
            self.feeding[row] = (0, left - fed[row])
            if not self.feeding[row][1]:
                del self.feeding[row]
        starts = [self.appended.get(row, (fed_from[row], 0))[0] for row in range(self.rows)]
        blocks = [self.appended.get(row, (0, 0))[1] for row in range(self.rows)]
        self.costs.stretch(batches, lengths, self.context, decoded, starts, blocks, fed)
        for row, (_, width) in self.appended.items():
            self.context[row] += width
        self.appended = {}
        self.costs.waiting += sum(steps - decoded[slot_row[k]] - fed[slot_row[k]] for k in range(b)
                                  if slot_row[k] in self.live)
        self.costs.checks += 1
        for k in range(self.rows):
            self.context[slot_row[k]] += decoded[slot_row[k]] + fed[slot_row[k]]
            self.col_seen[slot_row[k]] = col[k]

    def _turns_of(self, stopped: list[int], col: list[int], slot_row: list[int],
                  after: torch.cuda.Event | None = None) -> dict[int, TurnEnd]:
        """The finished turn of each stopped slot, read from the output buffers (one copy to the host). On CUDA the
        copy runs on a side stream once the check's state is read (``after``), beside the lag steps: a stopped
        slot's turn is written before that, and the steps after it write none of its columns."""
        if not stopped:
            return {}
        s = self.s
        rows = torch.tensor([slot_row[k] for k in stopped])
        if after is None:
            tokens, logprobs, entropy = (getattr(s, name).index_select(0, rows.to(s.col.device)).cpu()
                                         for name in s.OUTPUTS)
        else:
            if self._copies is None:
                self._copies = torch.cuda.Stream(s.col.device)
            self._copies.wait_event(after)
            with torch.cuda.stream(self._copies):
                index = rows.pin_memory().to(s.col.device, non_blocking=True)
                tokens, logprobs, entropy = [], [], []
                for name, out in zip(s.OUTPUTS, (tokens, logprobs, entropy)):
                    rows_out = getattr(s, name).index_select(0, index)
                    out.append(torch.empty(rows_out.shape, dtype=rows_out.dtype, pin_memory=True))
                    out[0].copy_(rows_out, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._copies)
            copied.synchronize()
            tokens, logprobs, entropy = tokens[0], logprobs[0], entropy[0]
        turns = {}
        for i, k in enumerate(stopped):
            start, end = self.turn_start[slot_row[k]], col[k]
            ids = tokens[i, start:end].tolist()
            turns[k] = TurnEnd(self.first_row + slot_row[k], ids, logprobs[i, start:end].tolist(),
                               entropy[i, start:end].tolist(), ids[-1] not in self.eos)
        return turns

    def _append(self, first: int, blocks: list[list[int]], budgets: list[int], column: int) -> int:
        """Prefill ``blocks`` (a token list per slot ``first``.. on) at cache columns ``column``.. of those slots'
        rows, left-padded to one width, after each slot's own context; sample each slot's next token. Returns the
        next free column."""
        s, engine, device = self.s, self.engine, self.s.col.device
        R, width = len(blocks), max(map(len, blocks))
        ids = torch.full((R, width), self.pad, dtype=torch.long)
        real = torch.zeros((R, width), dtype=torch.bool)
        for i, block in enumerate(blocks):
            ids[i, width - len(block):], real[i, width - len(block):] = torch.tensor(block), True
        ids, real, budget = (to_device(t, device) for t in (ids, real, torch.tensor(budgets)))  # behind the lead steps
        slots = slice(first, first + R)
        pos = s.pos[slots, None] + (real.long().cumsum(-1) - 1).clamp(min=0)  # [R, width] on from each row's own
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()[None] & real[:, None, :]
        causal |= torch.eye(width, dtype=torch.bool, device=device)[None]
        context = s.mask[slots, 0, 0, :column][:, None, :].expand(R, width, column)
        m4 = torch.cat([context, causal], -1)[:, None]  # [R, 1, width, column + width]
        with sdpa_kernel(SDPA_KERNELS):  # (every observation's prefill attends to a new number of columns)
            if s.decoder is not None:
                keys, values = [k[slots] for k in s.cache.keys], [v[slots] for v in s.cache.values]
                logits = s.decoder.prefill(ids, pos, keys, values, m4, start=column)
            else:
                s.cache.start_append(first, R, column, width)
                logits = self.policy(input_ids=ids, attention_mask=m4, position_ids=pos, past_key_values=s.hf_cache,
                                     use_cache=True, logits_to_keep=1).logits[:, -1]
        self.costs.prefills += 1
        self.costs.prefill_tokens += sum(map(len, blocks))
        self.costs.prefill_columns += R * width
        s.mask[slots, 0, 0, column:column + width] = real
        s.pos[slots] += real.sum(-1)
        s.finished[slots] = False
        s.limit[slots] = s.col[slots] + budget
        engine._record(s, logits, first + R, self.spec, first=first)
        s.cache.position.fill_(column + width)
        return column + width
