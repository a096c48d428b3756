"""The CUDA-graph engine's KV cache: K/V of every layer preallocated as one block of ``[rows, kv_heads, length,
head_dim]`` slots, written in place, and its lifecycle behind two calls (``allocate`` / ``release``, as litgpt's
``set_kv_cache`` / ``clear_kv_cache``): the engine never decides inline when the memory comes or goes.

Its bytes (``slot_bytes``) and whether a rollout frees it for the update (``releases_kv_cache``) are the rules the
memory plan counts with (``qerl.rollout.footprint``), so the plan and the engine cannot disagree.
"""

from __future__ import annotations

import torch

from qerl.kernels.kv_cache_element import cache_bytes, to_cache_element

KV_RELEASE_FRACTION = 0.05  # by default a KV cache above this share of the GPU is freed for the update


def slot_bytes(layers: int, kv_heads: int, head_dim: int, rows: int, length: int, element_bytes: int) -> int:
    """Bytes of the K/V of ``rows`` slots of ``length`` positions (what :class:`SlotCache` allocates)."""
    return 2 * layers * kv_heads * head_dim * element_bytes * rows * length


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_cache_bytes(config, rows: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of the static K/V cache of a transformers ``config`` for ``rows`` slots of ``length`` positions."""
    return slot_bytes(config.num_hidden_layers, config.num_key_value_heads, head_dim(config), rows, length,
                      dtype.itemsize)


def releases_kv_cache(keep: bool | None, nbytes: int, total_bytes: int | None) -> bool:
    """Whether a rollout frees its KV cache of ``nbytes`` when it ends, for the update (``keep_kv_cache`` = ``keep``;
    None: when it holds more than ``KV_RELEASE_FRACTION`` of a GPU of ``total_bytes``; no GPU (None): never)."""
    if keep is not None:
        return not keep
    return total_bytes is not None and nbytes > KV_RELEASE_FRACTION * total_bytes


def unreserved_bytes(device) -> int:
    """What the caching allocator may still reserve on the GPU: its free memory, or less where the process's cap
    (``--memory_budget_gb``: ``set_per_process_memory_fraction``) stops the allocator first."""
    free, total = torch.cuda.mem_get_info(device)
    cap = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
    return int(min(free, cap))


def free_bytes(device) -> int:
    """Free GPU memory, counting what the caching allocator holds unused."""
    return unreserved_bytes(device) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def total_bytes(device) -> int | None:
    """The GPU's memory (None off CUDA)."""
    return torch.cuda.get_device_properties(device).total_memory if torch.device(device).type == "cuda" else None


def check_kv_cache_fits(nbytes: int, free: int, rows: int, length: int, where: str) -> None:
    """Refuse a static KV cache larger than the free memory with what to change, instead of an opaque OOM."""
    if nbytes > free:
        raise torch.cuda.OutOfMemoryError(
            f"CUDAGraphRollout: the static KV cache for {rows} rows x {length} positions needs {nbytes / 2**30:.1f} "
            f"GiB, {free / 2**30:.1f} GiB are free on {where}. Lower data.batch_size, model.sampling.group_size or "
            "model.sampling.max_new_tokens (or data.max_prompt_tokens; with model.agent, "
            "model.agent.max_episode_tokens), or use "
            "qerl.rollout.builtin.BuiltinRollout, whose cache grows with the longest live sequence.")


class SlotCache:
    """Preallocated K/V per layer ``[rows, kv_heads, length, head_dim]``, written in place.

    ``prefill(B, P)``: the layer's keys go to rows 0..B-1, columns 0..P-1 (and are returned as they are).
    ``append``: new tokens of some rows go after their columns (``start_append``), all their columns are returned.
    ``decode(b, L)``: the new key goes to column ``position`` (a device tensor) of rows 0..b-1; the first ``L``
    columns of those rows are returned as views, so the attention reads nothing else.
    ``dtype``: the model's, or e4m3 (``qerl.kernels.kv_cache_element``; then what is returned is the rounded
    values widened back to the model's dtype)."""

    def __init__(self, layers: int, rows: int, kv_heads: int, length: int, head_dim: int, dtype, device,
                 allocate: bool = True):
        self.shape, self.dtype, self.device = (2, layers, rows, kv_heads, length, head_dim), dtype, torch.device(device)
        self.storage: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._address: int | None = None  # where the last allocation landed
        self.rows, self.length = rows, length
        if allocate:
            self.allocate()
        # lives as long as the cache object (captured graphs read it), whether or not the storage is allocated
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.mode, self.b, self.L = "prefill", rows, length
        self.span = (0, rows, 0, length)  # (first row, rows, column, width) of an append

    def start_prefill(self) -> None:
        """The next ``update`` of each layer writes a prompt's keys (``prefill`` above)."""
        self.mode = "prefill"

    def start_append(self, first: int, rows: int, column: int, width: int) -> None:
        """The next ``update`` of each layer writes ``width`` new tokens of rows ``first``..``first + rows - 1`` at
        columns ``column``.. (a multi-turn row's observation) and returns their first ``column + width`` columns."""
        self.mode, self.span = "append", (first, rows, column, width)

    def start_decode(self, rows: int, length: int) -> None:
        """The next ``update`` of each layer is one decode step of rows 0..``rows``-1 attending to the first
        ``length`` columns (``decode`` above)."""
        self.mode, self.b, self.L = "decode", rows, length

    @property
    def nbytes(self) -> int:
        _, layers, rows, kv_heads, length, head_dim = self.shape
        return slot_bytes(layers, kv_heads, head_dim, rows, length, self.dtype.itemsize)

    def allocate(self) -> bool:
        """(Re)allocate K/V as one block (refused with what to change where the GPU lacks the room): freed around the
        update, it comes back as one block, usually at the same address. Returns whether it landed elsewhere than the
        last time (graphs captured over the old block can then never replay)."""
        if self.storage is not None:
            return False
        if self.device.type == "cuda":
            if unreserved_bytes(self.device) < self.nbytes:
                torch.cuda.empty_cache()  # the update's cached blocks back to the device: the cache is one block
            check_kv_cache_fits(self.nbytes, free_bytes(self.device), self.rows, self.length, str(self.device))
        self.storage = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.keys, self.values = list(self.storage[0].unbind(0)), list(self.storage[1].unbind(0))
        moved = self._address is not None and self._address != self.storage.data_ptr()
        self._address = self.storage.data_ptr()
        return moved

    def release(self) -> None:
        """Free K/V (the next ``allocate`` brings them back)."""
        if self.storage is None:
            return
        self.storage, self.keys, self.values = None, [], []
        if self.device.type == "cuda" and unreserved_bytes(self.device) < self.nbytes:
            # Too little memory outside the allocator for the cache to come back as a fresh block: give its block
            # back now, before the update's long-lived tensors (AdamW states) land in it and pin it.
            torch.cuda.empty_cache()

    def update(self, key, value, layer_idx, *args, **kwargs):
        """transformers' cache call: store ``key``/``value``; return what the attention reads, in their dtype (an
        e4m3 cache hands back its rounded values, in the prefill too, as the fused step reads them)."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.mode == "prefill":
            k, v = k[: key.shape[0], :, : key.shape[2]], v[: key.shape[0], :, : key.shape[2]]
            k.copy_(to_cache_element(key, k.dtype))
            v.copy_(to_cache_element(value, v.dtype))
        elif self.mode == "append":
            first, rows, column, width = self.span
            k, v = k[first: first + rows, :, : column + width], v[first: first + rows, :, : column + width]
            k[:, :, column:].copy_(to_cache_element(key, k.dtype))
            v[:, :, column:].copy_(to_cache_element(value, v.dtype))
            return (k, v) if self.dtype == key.dtype else (k.to(key.dtype), v.to(value.dtype))
        else:
            k, v = k[: self.b], v[: self.b]
            cache_bytes(k).index_copy_(2, self.position, cache_bytes(to_cache_element(key, k.dtype)))
            cache_bytes(v).index_copy_(2, self.position, cache_bytes(to_cache_element(value, v.dtype)))
            k, v = k[:, :, : self.L], v[:, :, : self.L]
        if self.dtype == key.dtype:
            return (key, value) if self.mode == "prefill" else (k, v)
        return k.to(key.dtype), v.to(value.dtype)

    def repeat_rows(self, prompts: int, group_size: int, length: int) -> None:
        """Rows 0..B-1 -> rows 0..B*G-1, each prompt's KV copied to the G rows of its group."""
        for t in (*self.keys, *self.values):
            t = cache_bytes(t)
            t[: prompts * group_size, :, :length].copy_(t[:prompts, :, :length].repeat_interleave(group_size, 0))

    def permute_rows(self, order: torch.Tensor, length: int) -> None:
        for t in (*self.keys, *self.values):
            view = cache_bytes(t)[: order.numel(), :, :length]
            view.copy_(view.index_select(0, order))

    def move_rows(self, sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        """Row ``targets[i]`` takes the first ``length`` columns of row ``sources[i]`` (all read before any write)."""
        for t in (*self.keys, *self.values):
            view = cache_bytes(t)[:, :, :length]
            view.index_copy_(0, targets, view.index_select(0, sources))

    def gather_columns(self, order: torch.Tensor, length: int) -> None:
        """Column j of row i takes column ``order[i, j]`` of the same row, of its first ``length`` (``order`` [rows,
        kept]: only the first ``kept`` columns are written)."""
        for t in (*self.keys, *self.values):
            view = cache_bytes(t)[: order.shape[0], :, :length]
            index = order[:, None, :, None].expand(-1, view.shape[1], -1, view.shape[3])
            view[:, :, : order.shape[1]].copy_(view.gather(2, index))


def as_cache(slot_cache: SlotCache):
    """A transformers ``Cache`` whose ``update`` is the slot cache's (models only call ``update`` when the masks and
    position ids are given)."""
    from transformers.cache_utils import Cache

    class _Cache(Cache):
        def __init__(self):
            super().__init__(layers=[])

        def update(self, key, value, layer_idx, *args, **kwargs):
            return slot_cache.update(key, value, layer_idx)

    return _Cache()
