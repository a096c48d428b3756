"""The host copies of many tensors (``qerl.kernels.host_copy``): the runs it joins; on a GPU, ``tests/gpu``."""

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
