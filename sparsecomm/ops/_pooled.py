"""Owner pooling's index ops: group_by, bag_groups, unique_inverse, pooled_request; shard storage.

Thin typed wrappers over the operators of :mod:`sparsecomm._library` (one-pass
C++ kernels on the CPU, the torch ops they equal on CUDA).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from sparsecomm import _library
from sparsecomm.ops._validate import check_int64_ids, check_num_rows, check_size, owner_map

__all__ = ["PooledPlan", "empty_rows", "huge_page_copy", "group_by", "bag_groups", "unique_inverse", "pooled_request"]


class PooledPlan(NamedTuple):
    """The requester side of owner pooling (:func:`pooled_request`): what each owner is sent.

    Attributes:
        unique: int64, per owner its distinct ids ascending, owners concatenated in rank order.
        unique_counts: ``(num_owners,)`` int64, distinct ids per owner.
        order: ``(n,)`` int64, the occurrences grouped by owner, input order inside an owner
            (``partition_rows(ids, ...).perm``).
        occ_counts: ``(num_owners,)`` int64, occurrences per owner.
        positions: ``(n,)`` int32, in ``order`` order: each occurrence's index among its owner's distinct ids.
        bag_rows: int64, the bag of each partial bag (a run of one bag inside an owner's occurrences), grouped
            by owner.
        lengths: int32, occurrences per partial bag.
        bag_counts: ``(num_owners,)`` int64, partial bags per owner.
    """

    unique: torch.Tensor
    unique_counts: torch.Tensor
    order: torch.Tensor
    occ_counts: torch.Tensor
    positions: torch.Tensor
    bag_rows: torch.Tensor
    lengths: torch.Tensor
    bag_counts: torch.Tensor


def empty_rows(shape: Tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.empty`` for a table read and updated at random rows (a shard, its optimizer state): on the
    CPU backed by transparent huge pages where the OS allows it (:func:`sparsecomm._library.empty_rows`)."""
    return _library.empty_rows(tuple(shape), dtype, device)


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in :func:`empty_rows` memory (huge pages where the OS allows it), for a table
    or row state that already exists in plain pages and will be read and updated at random rows."""
    return empty_rows(tuple(t.shape), t.dtype, t.device).copy_(t)


def group_by(index: torch.Tensor, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Positions grouped by ``index`` (a stable counting sort), and where each of ``size`` groups starts.

    Exactly ``order = torch.argsort(index, stable=True)`` and ``offsets = cumsum(count) - count`` with
    ``count = torch.bincount(index, minlength=size)``. With them,
    ``F.embedding_bag(src[order], rows, offsets, mode="sum")`` sums per group, in input order, the rows
    ``src`` points at.

    Args:
        index: ``(n,)`` int64 group of each position, in ``[0, size)``.
        size: the number of groups.

    Returns:
        ``(order, offsets)``: ``(n,)`` and ``(size,)`` int64.

    Raises:
        TypeError, ValueError: bad types or shapes, or an index outside ``[0, size)`` (named).
    """
    check_int64_ids(index, "index")
    return _library.call("group_by", index, check_size(size, "size"))


def bag_groups(key: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, size: int
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The owner's backward plan of pooled lookups, in one counting sort.

    Occurrence ``i`` belongs to a bag (``lengths``: consecutive runs of the
    occurrences) and points at ``positions[i]`` among the requested ids, whose
    group (the distinct row it adds its gradient to) is ``key[positions[i]]``.
    Exactly::

        group = key[positions]
        order = torch.argsort(group, stable=True)
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[order]
        offsets = cumsum(count) - count, count = torch.bincount(group, minlength=size)

    so ``F.embedding_bag(rows, bag_grads, offsets, per_sample_weights=w[order])``
    is every group's gradient, summed in input order.

    Args:
        key: ``(r,)`` int64 group of each requested id, in ``[0, size)``.
        positions: ``(n,)`` int64 requested-id index of each occurrence, in ``[0, r)``.
        lengths: ``(num_bags,)`` int64 occurrences per bag, ``>= 0``, adding up to ``n``.
        size: the number of groups.

    Returns:
        ``(order, rows, offsets)``: ``(n,)``, ``(n,)`` and ``(size,)`` int64.

    Raises:
        TypeError, ValueError: bad types or shapes, a key or position out of
            range, or lengths that do not add up (named).
    """
    check_int64_ids(key, "key")
    check_int64_ids(positions, "positions")
    check_int64_ids(lengths, "lengths")
    for t, name in ((positions, "positions"), (lengths, "lengths")):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device} but key is on {key.device}")
    return _library.call("bag_groups", key, positions, lengths, check_size(size, "size"))


def unique_inverse(ids: torch.Tensor, num_rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, sorted=True, return_inverse=True)``, in one pass or two over the ids.

    CPU: the distinct ids are marked in a bitmap over ``[min, max]`` when it holds at most 4 words per id
    (any few thousand ids over 1M rows), else found by a radix sort; the same result either way.

    Args:
        ids: ``(n,)`` int64 ids in ``[0, num_rows)``.
        num_rows: their bound (None: only non-negative).

    Returns:
        ``(unique, inverse)``: the distinct ids ascending (int64) and each id's index among them
        (``(n,)`` int64).

    Raises:
        TypeError, ValueError: bad types or shapes, or an id out of range (named).
    """
    check_int64_ids(ids, "ids")
    return _library.call("unique_inverse", ids, check_num_rows(num_rows))


def pooled_request(ids: torch.Tensor, bag_of: torch.Tensor, num_owners: int, scheme: str = "hash",
                   num_rows: Optional[int] = None, range_size: Optional[int] = None, *,
                   num_bags: Optional[int] = None, stride: int = 1, owner: Optional[int] = None) -> PooledPlan:
    """The requester side of owner pooling, in one kernel call: what each owner gets for a bag lookup.

    Owners are those of :func:`partition_rows` (same ``num_owners``, ``scheme``, ``num_rows``,
    ``range_size``, ``stride``, ``owner``). Exactly what these torch ops give (``n = num_owners``)::

        occ = partition_rows(ids, None, n, scheme, num_rows, range_size=range_size, stride=stride)
        order, occ_counts = occ.perm, occ.counts
        # per owner segment of occ.ids: u, pos = torch.unique(seg, sorted=True, return_inverse=True)
        unique = cat(u), unique_counts = [len(u)], positions = cat(pos).int()
        owner_occ = repeat_interleave(arange(n), occ_counts)
        keys, lengths = unique_consecutive(owner_occ * nb + bag_of[order], return_counts=True)
        bag_rows, bag_counts, lengths = keys % nb, bincount(keys // nb, minlength=n), lengths.int()

    Args:
        ids: ``(n,)`` int64 ids in ``[0, num_rows)``.
        bag_of: ``(n,)`` int64, the bag of each id: non-decreasing, in ``[0, num_bags)`` (bags may be empty).
        num_owners, scheme, num_rows, range_size, stride, owner: the owner map of :func:`partition_rows`.
        num_bags: bound on ``bag_of`` (None: only non-negative).

    Returns:
        A :class:`PooledPlan`.

    Raises:
        TypeError, ValueError: bad types, shapes or owner map; an id or bag out of range, or ``bag_of``
            decreasing (named; nothing is written).
    """
    check_int64_ids(ids, "ids")
    check_int64_ids(bag_of, "bag_of")
    if bag_of.shape[0] != ids.shape[0]:
        raise ValueError(f"bag_of has {bag_of.shape[0]} entries but ids has {ids.shape[0]}")
    if bag_of.device != ids.device:
        raise ValueError(f"bag_of is on {bag_of.device} but ids is on {ids.device}")
    bound = check_num_rows(num_rows)
    bags = -1 if num_bags is None else check_size(num_bags, "num_bags")
    owners = owner_map(num_owners, scheme, num_rows, range_size, stride, owner)
    return PooledPlan(*_library.call("pooled_request", ids, bag_of, bound, *owners, bags))
