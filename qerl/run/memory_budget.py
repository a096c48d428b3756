"""The run's memory budget (``--memory_budget_gb N``): a run held to N GiB of its GPU, as if the GPU had N GiB.

Two parts obey it, so that what the plan promises is what the process may take:

    the memory plan     plans for min(N GiB, the GPU's free memory), on a GPU of N GiB
                        (``qerl.run.resolve.device_memory``)
    PyTorch's allocator refuses to hold more than N GiB (``torch.cuda.set_per_process_memory_fraction``): a run
                        that would grow past the budget fails as it would on the smaller GPU, and the rest of the
                        GPU stays free for other processes

The graph engine's KV cache reads the cap too when it decides to give cached blocks back
(``qerl.rollout.kv_cache.unreserved_bytes``), as it would on the smaller GPU. The CUDA context lives outside the
allocator: a budget of what the smaller GPU leaves PyTorch after its context (docs/memory.md) makes a larger GPU
behave as that one. Off CUDA the plan is made for N GiB and nothing is held. The vLLM engine allocates its share
outside PyTorch's allocator and is sized by its ``gpu_memory_utilization``: a budget is refused there.
"""

from __future__ import annotations

import torch

from qerl.model.footprint import GIB

OPTION = "--memory_budget_gb"


def budget_error(budget_gb: float | None, device_gb: float | None, engine: str | None) -> str | None:
    """Why ``--memory_budget_gb`` = ``budget_gb`` cannot be used with the run's other settings (None: it can):
    ``device_gb`` is ``--memory_plan_device_gb``, ``engine`` the planned engine's kind (``cuda_graph``, ``builtin``,
    ``vllm`` or None)."""
    if budget_gb is None:
        return None
    if not budget_gb > 0:
        return f"{OPTION}={budget_gb}: must be a number > 0 (the GiB of the GPU the run may use)."
    if device_gb is not None:
        return (f"{OPTION}={budget_gb} with --memory_plan_device_gb={device_gb}: set one (the budget plans for its "
                "GiB and holds the run to them; --memory_plan_device_gb only plans).")
    if engine == "vllm":
        return (f"{OPTION}={budget_gb}: the vLLM engine allocates its share outside PyTorch's allocator; size it with "
                "model.rollout.init_args.gpu_memory_utilization (a share of the whole GPU) instead, or use "
                "qerl.rollout.cuda_graph.CUDAGraphRollout.")
    return None


def within_budget(free_bytes: int, total_bytes: int, budget_gb: float) -> tuple[int, int]:
    """(free, total) bytes the plan assumes on a GPU with ``free_bytes`` of ``total_bytes`` free, held to ``budget_gb``
    GiB: the budget is the GPU's size, and no more is free than the GPU has."""
    budget = int(budget_gb * GIB)
    return min(free_bytes, budget), budget


def allocator_fraction(budget_gb: float, total_bytes: int) -> float:
    """The share of a GPU of ``total_bytes`` that PyTorch's allocator may hold under ``budget_gb`` GiB.

    Raises:
        ValueError: the budget is larger than the GPU.
    """
    budget = budget_gb * GIB
    if budget > total_bytes:
        raise ValueError(f"{OPTION}={budget_gb}: more than the GPU's {total_bytes / GIB:.1f} GiB; lower it (or leave "
                         "it unset: the whole GPU).")
    return budget / total_bytes


def hold_to_budget(device: torch.device, budget_gb: float) -> None:
    """Cap PyTorch's allocator on ``device`` (a CUDA device) at ``budget_gb`` GiB, before the run allocates there."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(allocator_fraction(budget_gb, total), device)
