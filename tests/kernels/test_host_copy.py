"""The host copies of many tensors (``qerl.kernels.host_copy``): the runs it joins and the joins, cast and split back
on the CPU (the same code as from a GPU but for the pinned buffer: ``tests/gpu`` runs it there)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from qerl.kernels.host_copy import join_runs, to_host


def test_runs_keep_order_and_cut_before_the_limit_with_a_larger_tensor_alone():
    assert join_runs([4, 4, 4, 4], 8) == [(0, 2), (2, 4)]
    assert join_runs([3, 10, 3, 3, 3], 8) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert join_runs([], 8) == []
    assert join_runs([1] * 5, 100) == [(0, 5)]


def test_host_tensors_are_copied_in_order_and_written_as_safetensors(tmp_path):
    source = {"b": torch.arange(6.0).view(2, 3), "a": torch.ones(4, dtype=torch.bfloat16).t(),
              "c": torch.arange(8.0).view(2, 4)[:, ::2]}
    copies = to_host(source)
    assert list(copies) == ["b", "a", "c"]
    for key, t in source.items():
        assert copies[key].is_contiguous() and torch.equal(copies[key], t)
        assert copies[key].data_ptr() != t.data_ptr()  # a snapshot, not the live tensor
    save_file(copies, str(tmp_path / "x.safetensors"))
    assert all(torch.equal(v, source[k]) for k, v in load_file(str(tmp_path / "x.safetensors")).items())


def test_floating_tensors_are_cast_to_the_asked_dtype_and_integers_are_not():
    source = {"w": torch.tensor([1.0, 1.0 + 2**-10, -3.5]), "i": torch.arange(3)}
    copies = to_host(source, torch.bfloat16)
    assert copies["w"].dtype == torch.bfloat16 and torch.equal(copies["w"], source["w"].to(torch.bfloat16))
    assert copies["i"].dtype == torch.int64 and torch.equal(copies["i"], source["i"])


def test_joins_cut_at_the_limit_cast_once_and_give_back_separate_views(monkeypatch):
    from qerl.kernels import host_copy

    monkeypatch.setattr(host_copy, "JOIN_BYTES", 64)  # 32 bf16 values a join: several joins
    gen = torch.Generator().manual_seed(0)
    source = {f"t{i}": torch.randn(3, 2 + i, generator=gen).to(torch.float32 if i % 2 else torch.bfloat16)
              for i in range(12)}
    source["t3"] = source["t3"].t()  # not contiguous
    source["n"] = torch.arange(5)  # not floating: its own dtype, its own join
    copies = host_copy.to_host(source, torch.bfloat16)
    assert list(copies) == list(source)
    spans = []
    for key, t in source.items():
        expected = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert copies[key].dtype == expected.dtype and torch.equal(copies[key], expected)
        assert copies[key].is_contiguous()
        spans.append((copies[key].data_ptr(), copies[key].data_ptr() + copies[key].nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # views that do not overlap
    storages = {copies[k].untyped_storage().data_ptr() for k in source if k != "n"}
    assert 1 < len(storages) < len(source) - 1  # joined, in more than one run
