"""Run by test_pair_sort_kernel.py under TRITON_INTERPRET=1: the pair-sort kernel against the stable torch sort."""

import json

import torch

from qerl.kernels.pair_sort import sort_pairs, sort_pairs_torch

res = {}
g = torch.Generator().manual_seed(0)
# decode shapes (128 experts top-8 over 1, 40 and 128 rows: several chunks, one full comparison tile), 256 experts (the narrower chunks), a few
# experts chosen by all (long runs of one id across chunks), ragged P
for T, E, k in ((1, 128, 8), (40, 128, 8), (128, 128, 8), (9, 256, 8), (700, 6, 2), (7, 60, 4)):
    scores = torch.rand(T, E, generator=g)
    if E == 6:
        scores[:, :2] += 1.0  # experts 0 and 1 take every token
    index = torch.topk(scores, k, dim=1).indices
    order, offsets = sort_pairs(index, E)
    order_ref, offsets_ref = sort_pairs_torch(index, E)
    res[f"{T}-{E}-{k}"] = {"same_order": bool(torch.equal(order, order_ref)),
                           "same_offsets": bool(torch.equal(offsets, offsets_ref)),
                           "dtypes": [str(order.dtype), str(offsets.dtype)]}
    # idle tokens (a decode step's stopped rows): their pairs after every expert's; the others as a plain stable sort
    idle = torch.rand(T, generator=g) < 0.4
    order, offsets = sort_pairs(index, E, idle)
    order_ref, offsets_ref = sort_pairs_torch(index, E, idle)
    live = [p for p in sorted(range(T * k), key=lambda p: int(index.view(-1)[p])) if not idle[p // k]]
    counts = torch.bincount(index[~idle].reshape(-1), minlength=E)
    res[f"{T}-{E}-{k}-idle"] = {
        "same_order": bool(torch.equal(order, order_ref)) and order[:len(live)].tolist() == live
        and sorted(order.tolist()) == list(range(T * k)),
        "same_offsets": bool(torch.equal(offsets, offsets_ref))
        and offsets.tolist() == [0, *torch.cumsum(counts, 0).tolist()],
        "dtypes": [str(order.dtype), str(offsets.dtype)]}
print(json.dumps(res))
