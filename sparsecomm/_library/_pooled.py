"""Owner pooling's index operators: group_by, bag_groups, unique_inverse, pooled_request.

CPU: one-pass C++ kernels (``csrc/pooled.cpp``). CUDA: the torch ops they
replace (the ``*_torch`` functions here, which run on any device and are the
reference the CPU kernels must equal exactly).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from sparsecomm import _C
from sparsecomm._library._common import check_cuda_ids, dynamic_rows, threads
from sparsecomm._library._registry import cuda_kernel, custom_op

__all__ = ["group_by_torch", "bag_groups_torch", "unique_inverse_torch", "pooled_request_torch", "group_by",
           "bag_groups", "unique_inverse", "pooled_request"]


def group_by_torch(index: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    """``(argsort(index, stable=True), cumsum(count) - count)``, ``count = bincount(index, minlength=size)``."""
    check_cuda_ids(index, size, "index")
    order = torch.argsort(index, stable=True)
    count = torch.bincount(index, minlength=size)
    return order, torch.cumsum(count, 0) - count


def bag_groups_torch(key: Tensor, positions: Tensor, lengths: Tensor, size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``order = argsort(key[positions], stable=True)``, ``rows = repeat_interleave(arange(B), lengths)[order]``
    and the groups' starts (``cumsum(bincount) - bincount``)."""
    check_cuda_ids(key, size, "key")
    check_cuda_ids(positions, key.shape[0], "positions")
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.sum()) != positions.shape[0]):
        raise ValueError(f"sparsecomm: bag_groups: lengths must be >= 0 and add up to the {positions.shape[0]} "
                         f"positions")
    if not lengths.numel() and positions.numel():
        raise ValueError(f"sparsecomm: bag_groups: lengths add up to 0, not the {positions.shape[0]} positions")
    group = key[positions]
    order = torch.argsort(group, stable=True)
    bag_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=key.device), lengths,
                                     output_size=positions.shape[0])
    count = torch.bincount(group, minlength=size)
    return order, bag_of[order], torch.cumsum(count, 0) - count


def unique_inverse_torch(ids: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    """``torch.unique(ids, sorted=True, return_inverse=True)``."""
    check_cuda_ids(ids, num_rows)
    return torch.unique(ids, sorted=True, return_inverse=True)


def _check_bags(bag_of: Tensor, num_bags: int) -> None:
    if bag_of.numel() == 0:
        return
    lo, hi = int(bag_of.min()), int(bag_of.max())
    if lo < 0 or (num_bags >= 0 and hi >= num_bags):
        bound = "inf" if num_bags < 0 else str(num_bags)
        raise ValueError(f"sparsecomm: bag_of contains bag {lo if lo < 0 else hi} outside [0, {bound})")
    if bag_of.numel() > 1 and bool((bag_of[1:] < bag_of[:-1]).any()):
        raise ValueError("sparsecomm: bag_of must be non-decreasing")


def pooled_request_torch(ids: Tensor, bag_of: Tensor, num_rows: int, num_owners: int, scheme: int,
                         range_size: int, stride: int, num_bags: int
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The torch ops of ``requester.pooled_request`` (sparsecomm/sharded/requester.py) that pooled_request replaces."""
    check_cuda_ids(ids, num_rows)
    _check_bags(bag_of, num_bags)
    n = num_owners
    occ_counts, occ_ids, _, order = torch.ops.sparsecomm.partition(ids, None, num_rows, n, scheme, range_size,
                                                                   stride)
    uniques, positions = [], []
    for seg in torch.split(occ_ids, occ_counts.tolist()):
        u, pos = torch.unique(seg, sorted=True, return_inverse=True)
        uniques.append(u)
        positions.append(pos.to(torch.int32))
    unique_counts = torch.tensor([u.numel() for u in uniques], dtype=torch.int64, device=ids.device)
    bag_occ = bag_of[order]
    owner_occ = torch.repeat_interleave(torch.arange(n, device=ids.device), occ_counts)
    nb = max(int(bag_of.max()) + 1 if bag_of.numel() else 0, num_bags, 1)
    keys, lengths = torch.unique_consecutive(owner_occ * nb + bag_occ, return_counts=True)
    return (torch.cat(uniques), unique_counts, order, occ_counts, torch.cat(positions), keys % nb,
            lengths.to(torch.int32), torch.bincount(keys // nb, minlength=n))


@custom_op("group_by")
def group_by(index: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    order = torch.empty(index.shape[0], dtype=torch.int64)
    offsets = torch.empty(size, dtype=torch.int64)
    _C.group_by(index.data_ptr(), index.shape[0], size, order.data_ptr(), offsets.data_ptr(),
                threads(index.shape[0] * 8))
    return order, offsets


cuda_kernel("group_by")(group_by_torch)


@group_by.register_fake
def _(index: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    return index.new_empty(index.shape[0], dtype=torch.int64), index.new_empty(size, dtype=torch.int64)


@custom_op("bag_groups")
def bag_groups(key: Tensor, positions: Tensor, lengths: Tensor, size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n = positions.shape[0]
    order = torch.empty(n, dtype=torch.int64)
    rows = torch.empty(n, dtype=torch.int64)
    offsets = torch.empty(size, dtype=torch.int64)
    _C.bag_groups(key.data_ptr(), key.shape[0], positions.data_ptr(), n, lengths.data_ptr(), lengths.shape[0], size,
                  order.data_ptr(), rows.data_ptr(), offsets.data_ptr(), threads(n * 8))
    return order, rows, offsets


cuda_kernel("bag_groups")(bag_groups_torch)


@bag_groups.register_fake
def _(key: Tensor, positions: Tensor, lengths: Tensor, size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n = positions.shape[0]
    return (positions.new_empty(n, dtype=torch.int64), positions.new_empty(n, dtype=torch.int64),
            positions.new_empty(size, dtype=torch.int64))


@custom_op("unique_inverse")
def unique_inverse(ids: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    inverse = torch.empty(ids.shape[0], dtype=torch.int64)
    lists = _C.unique_inverse(ids.data_ptr(), ids.shape[0], num_rows, inverse.data_ptr(), threads(ids.shape[0] * 8))
    unique = torch.empty(lists.num_unique, dtype=torch.int64)
    lists.write(unique.data_ptr(), 0, 0)
    return unique, inverse


cuda_kernel("unique_inverse")(unique_inverse_torch)


@unique_inverse.register_fake
def _(ids: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    return ids.new_empty(dynamic_rows(), dtype=torch.int64), ids.new_empty(ids.shape[0], dtype=torch.int64)


@custom_op("pooled_request")
def pooled_request(ids: Tensor, bag_of: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int,
                   stride: int, num_bags: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    n = ids.shape[0]
    unique_counts = torch.empty(num_owners, dtype=torch.int64)
    order = torch.empty(n, dtype=torch.int64)
    occ_counts = torch.empty(num_owners, dtype=torch.int64)
    positions = torch.empty(n, dtype=torch.int32)
    bag_counts = torch.empty(num_owners, dtype=torch.int64)
    lists = _C.pooled_request(ids.data_ptr(), bag_of.data_ptr(), n, num_rows, num_bags, scheme, num_owners,
                              range_size, stride, unique_counts.data_ptr(), order.data_ptr(), occ_counts.data_ptr(),
                              positions.data_ptr(), bag_counts.data_ptr(), threads(n * 8))
    unique = torch.empty(lists.num_unique, dtype=torch.int64)
    bag_rows = torch.empty(lists.num_bags, dtype=torch.int64)
    lengths = torch.empty(lists.num_bags, dtype=torch.int32)
    lists.write(unique.data_ptr(), bag_rows.data_ptr(), lengths.data_ptr())
    return unique, unique_counts, order, occ_counts, positions, bag_rows, lengths, bag_counts


cuda_kernel("pooled_request")(pooled_request_torch)


@pooled_request.register_fake
def _(ids: Tensor, bag_of: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int, stride: int,
      num_bags: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    u, p, n = dynamic_rows(), dynamic_rows(), ids.shape[0]
    per_owner = [ids.new_empty(num_owners, dtype=torch.int64) for _ in range(3)]
    return (ids.new_empty(u, dtype=torch.int64), per_owner[0], ids.new_empty(n, dtype=torch.int64), per_owner[1],
            ids.new_empty(n, dtype=torch.int32), ids.new_empty(p, dtype=torch.int64),
            ids.new_empty(p, dtype=torch.int32), per_owner[2])
