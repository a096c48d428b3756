"""What the CUDA-graph engine's decode reads, counted on the host from what its checks read anyway (no extra sync): per
decode step the attended cache columns x batch rows (the K/V the attention reads) against the columns the decoding
rows need (their own context), the rows decoding, reading fed observation tokens and idling; a multi-turn wave's
observation prefills (padded), the packs of its cache columns and the rows it moves (in cache columns copied).

The counts follow the schedule, which follows the sampled tokens only: a CPU run with a tiny model gives the same
numbers as a GPU run of the same episode shape, so a change to the schedule can be weighed before a GPU measures it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch


@dataclass
class WaveCosts:
    """Sums over the decode steps and checks of the calls counted (``add`` merges two)."""

    decode_steps: int = 0
    row_steps: int = 0  # batch rows of each step, summed
    decoded: int = 0  # rows that sampled a token in a decode step (the tokens decoded)
    fed: int = 0  # rows that read a fed observation token in a decode step and sampled nothing
    waiting: int = 0  # batch rows of a step between two turns of their episode (the other idle rows: its end, padding)
    attended: int = 0  # batch rows x attended columns, summed: the K/V row-columns the attention reads
    needed: int = 0  # each decoding row's own context, summed: what a cache without holes would read
    excess: int = 0  # the most columns a step attended past the longest row's context (holes + bucket rounding)
    checks: int = 0
    prefills: int = 0  # observation prefills (the prompts' are not counted)
    prefill_tokens: int = 0
    prefill_columns: int = 0  # rows x padded width of those prefills
    packs: int = 0  # ``DecodeState.defragment`` calls
    packed_columns: int = 0  # rows x columns each pack read
    moved_columns: int = 0  # rows x columns copied by the slot moves of the checks

    def add(self, other: WaveCosts) -> None:
        for f in fields(self):
            merge = max if f.name == "excess" else int.__add__
            setattr(self, f.name, merge(getattr(self, f.name), getattr(other, f.name)))

    def step(self, rows: int, length: int) -> None:
        """Count one decode step of ``rows`` batch rows attending ``length`` columns."""
        self.decode_steps += 1
        self.row_steps += rows
        self.attended += rows * length

    def decoding(self, contexts: list[int], decoded: list[int], fed: list[int] | None = None) -> None:
        """Count rows that held ``contexts[i]`` context columns and then ran ``fed[i]`` steps reading fed tokens and
        ``decoded[i]`` steps decoding, in a row."""
        fed = fed or [0] * len(contexts)
        self.decoded += sum(decoded)
        self.fed += sum(fed)
        # a row running its j-th step (from 0) attends its context + the j + 1 columns it has read since
        self.needed += sum((d + f) * c + (d + f) * (d + f + 1) // 2 for c, d, f in zip(contexts, decoded, fed))

    def stretch(self, rows: int | list[int], lengths: list[int], contexts: list[int], decoded: list[int],
                starts: list[int] | None = None, blocks: list[int] | None = None,
                fed: list[int] | None = None) -> None:
        """Count ``len(lengths)`` decode steps of ``rows`` batch rows (or ``rows[j]`` at step j), step j attending
        ``lengths[j]`` columns; the wave's row i held ``contexts[i]`` context columns before the first, got
        ``blocks[i]`` more (a prefilled observation) after its first ``starts[i]`` steps (idle), read ``fed[i]`` fed
        tokens in the next steps and decoded in the next ``decoded[i]`` (a row that stops idles until the next check:
        its steps are a run from its start)."""
        starts, blocks, fed = starts or [0] * len(contexts), blocks or [0] * len(contexts), fed or [0] * len(contexts)
        batches = rows if isinstance(rows, list) else [rows] * len(lengths)
        for batch, length in zip(batches, lengths):
            self.step(batch, length)
        if lengths and contexts:  # (on the host at every check: one [steps, rows] table, not a Python loop over it)
            c, ran, a, w = (torch.tensor(v) for v in (contexts, [d + f for d, f in zip(decoded, fed)], starts, blocks))
            j = torch.arange(len(lengths))[:, None]
            held = c + torch.where(j >= a, w + torch.minimum(j + 1 - a, ran), 0)  # each row's context at step j
            self.excess = max(self.excess, int((torch.tensor(lengths) - held.max(1).values).max()))
        self.decoding([c + w for c, w in zip(contexts, blocks)], decoded, fed)

    def summary(self) -> dict[str, float]:
        """The sums with the ratios a comparison reads: attended per decoded token and per needed column, the idle
        share of the batch rows, the prefill padding and the copies per decoded token."""
        tokens = max(self.decoded, 1)
        return {**{k: float(v) for k, v in asdict(self).items()},
                "attended_per_token": self.attended / tokens,
                "attended_per_needed": self.attended / max(self.needed, 1),
                "idle_row_share": 1.0 - (self.decoded + self.fed) / max(self.row_steps, 1),
                "waiting_row_share": self.waiting / max(self.row_steps, 1),
                "prefill_padding": 1.0 - self.prefill_tokens / self.prefill_columns if self.prefill_columns else 0.0,
                "copied_per_token": (self.packed_columns + self.moved_columns) / tokens}
