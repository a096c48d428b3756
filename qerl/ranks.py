"""What each process of a multi-process (DDP) run owns: its random streams and its share of every checkpoint.

Under DDP every rank rolls out its own prompts. Its sampling, AQN noise and other random streams must differ from the
other ranks' (a shared seed would give every rank the same noise on different prompts), and a checkpoint must hold
every rank's position, not rank 0's alone, for a resume on the same number of ranks to continue each stream exactly.
Lightning builds a checkpoint on every rank (``Trainer.save_checkpoint`` is called on all of them) and writes rank 0's,
so a ``state_dict`` gathers the ranks' states into it and ``load_state_dict`` picks its own out again.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist


def rank_and_world_size() -> tuple[int, int]:
    """This process's global rank and the number of processes (0, 1 outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_seed(seed: int, rank: int | None = None) -> int:
    """The seed of rank ``rank``'s stream (default: this process's rank): ``seed`` on rank 0 (a single process draws
    what it always drew), a 63-bit hash of (seed, rank) elsewhere, so that no two ranks share a stream (nor rank 1 of
    seed s and rank 0 of s + 1)."""
    rank = rank_and_world_size()[0] if rank is None else rank
    if rank == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{rank}".encode()).digest()[:8], "little") >> 1


def gather_rank_states(state: Any) -> dict:
    """``{"ranks": [state of rank 0, rank 1, ...]}``: every rank's ``state`` (picklable), for a checkpoint. A collective
    under DDP: every rank must call it."""
    _, world = rank_and_world_size()
    states = [state]
    if world > 1:
        states = [None] * world
        dist.all_gather_object(states, state)
    return {"ranks": states}


def own_rank_state(saved: Any) -> Any:
    """This rank's entry of what ``gather_rank_states`` saved. None when the checkpoint came from fewer ranks (this
    rank starts its streams from its seed) or holds a single, older, state (only rank 0 takes it)."""
    rank, _ = rank_and_world_size()
    if isinstance(saved, dict) and set(saved) == {"ranks"}:
        states = saved["ranks"]
        return states[rank] if rank < len(states) else None
    return saved if rank == 0 else None
