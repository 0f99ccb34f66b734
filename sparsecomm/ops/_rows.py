"""The row ops: coalesce, partition by owner, gather, scatter-add, row-wise Adagrad.

Thin typed wrappers: each validates its arguments (:mod:`._validate`), then
calls its registered operator (:mod:`sparsecomm._library`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from sparsecomm import _library
from sparsecomm.ops._validate import check_ids, check_num_rows, check_size, check_values, owner_map, row_width

__all__ = ["Partition", "coalesce_rows", "partition_rows", "coalesce_partition_rows", "row_owners", "owned_bitmap",
           "bitmap_ids", "bitmap_positions", "bitmap_owns", "gather_rows",
           "take_rows", "scatter_add_rows", "rowwise_adagrad_"]


class Partition(NamedTuple):
    """Rows grouped by owner: owner ``o`` holds ``ids[offsets[o]:offsets[o+1]]``.

    Attributes:
        counts: ``(num_owners,)`` int64, rows per owner.
        ids: the ids, permuted so each owner's rows are contiguous (owner order,
            input order inside an owner).
        values: the value rows permuted the same way, or None.
        perm: ``(n,)`` int64 with ``ids == input_ids[perm]``; None from
            :func:`coalesce_partition_rows` (its rows are sums, not input rows).
    """

    counts: torch.Tensor
    ids: torch.Tensor
    values: Optional[torch.Tensor]
    perm: Optional[torch.Tensor]


def coalesce_rows(ids: torch.Tensor, values: torch.Tensor, num_rows: Optional[int] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum the value rows of equal ids.

    Deterministic: each output row is the sum of its input rows taken in input
    order, so the same input gives bitwise the same output for any thread count.

    Args:
        ids: ``(n,)`` int32/int64 row ids, any order, duplicates allowed.
        values: ``(n, *row_shape)`` float values, one row per id.
        num_rows: optional bound; ids must lie in ``[0, num_rows)``.

    Returns:
        ``(unique_ids, sums)``: sorted unique ids (dtype of ``ids``) and
        ``(u, *row_shape)`` sums (dtype of ``values``).

    Raises:
        TypeError: wrong tensor types or dtypes.
        ValueError: shape/contiguity/device mismatch, or an id out of range.

    Example::

        >>> coalesce_rows(torch.tensor([3, 1, 3]), torch.ones(3, 2))
        (tensor([1, 3]), tensor([[1., 1.], [2., 2.]]))
    """
    check_ids(ids)
    check_values(values, "values", ids.shape[0], ids.device)
    bound = check_num_rows(num_rows)
    out_ids, sums = _library.call("coalesce", ids, values.reshape(ids.shape[0], row_width(values)), bound)
    return out_ids, sums.view((out_ids.shape[0], *values.shape[1:]))


def partition_rows(ids: torch.Tensor, values: Optional[torch.Tensor], num_owners: int, scheme: str = "hash",
                   num_rows: Optional[int] = None, *, range_size: Optional[int] = None, stride: int = 1,
                   owner: Optional[int] = None) -> Partition:
    """Group rows by their owner rank, stably.

    ``owner(id) = (bucket(id) // stride) % num_owners`` where ``bucket`` is a
    64-bit mix of the id (``scheme="hash"``: spreads Zipf-hot and consecutive
    ids evenly), ``id // range_size`` (``scheme="range"``: contiguous blocks,
    ``range_size`` defaults to ``ceil(num_rows / num_owners)``) or ``owner``
    (``scheme="table"``: every row on one rank). ``stride``
    lets a two-level exchange split the same buckets first across the ranks of
    a node and then across nodes.

    Args:
        ids: ``(n,)`` int32/int64 ids, non-negative (and ``< num_rows`` if given).
        values: ``(n, *row_shape)`` rows to move with the ids, or None.
        num_owners: number of owners (ranks).
        scheme: ``"hash"``, ``"range"`` or ``"table"``.
        num_rows: table size; bounds the ids, and sizes the ranges.
        range_size: rows per range bucket (overrides the default above).
        stride: divides the bucket before the modulo.
        owner: the table scheme's owner, in ``[0, num_owners)`` (required by it, ignored by the others).

    Returns:
        A :class:`Partition` (counts, ids, values, perm).

    Raises:
        TypeError, ValueError: as for :func:`coalesce_rows`, or a bad scheme/owner count.
    """
    check_ids(ids)
    if values is not None:
        check_values(values, "values", ids.shape[0], ids.device)
    bound = check_num_rows(num_rows)
    owners = owner_map(num_owners, scheme, num_rows, range_size, stride, owner)
    flat = None if values is None else values.reshape(ids.shape[0], row_width(values))
    counts, out_ids, out_values, perm = _library.call("partition", ids, flat, bound, *owners)
    return Partition(counts, out_ids, None if values is None else out_values.view(values.shape), perm)


def coalesce_partition_rows(ids: torch.Tensor, values: torch.Tensor, num_owners: int, scheme: str = "hash",
                            num_rows: Optional[int] = None, *, range_size: Optional[int] = None, stride: int = 1,
                            owner: Optional[int] = None) -> Partition:
    """Coalesce rows and group the sums by owner, in one pass over the values.

    The same result as ``partition_rows(*coalesce_rows(ids, values, num_rows),
    num_owners, ...)`` (bitwise), without writing the sums twice: each sum is
    written once, straight to its owner's place.

    Args:
        ids, values, num_rows: as for :func:`coalesce_rows`.
        num_owners, scheme, range_size, stride, owner: the owner map of :func:`partition_rows`.

    Returns:
        A :class:`Partition` whose ``ids`` are unique (ascending inside each
        owner), ``values`` their sums, and ``perm`` None.

    Raises:
        TypeError, ValueError: as for :func:`coalesce_rows` and :func:`partition_rows`.
    """
    check_ids(ids)
    check_values(values, "values", ids.shape[0], ids.device)
    bound = check_num_rows(num_rows)
    owners = owner_map(num_owners, scheme, num_rows, range_size, stride, owner)
    counts, out_ids, sums = _library.call("coalesce_partition", ids, values.reshape(ids.shape[0], row_width(values)),
                                          bound, *owners)
    return Partition(counts, out_ids, sums.view((out_ids.shape[0], *values.shape[1:])), None)


def row_owners(ids: torch.Tensor, num_owners: int, scheme: str = "hash", num_rows: Optional[int] = None, *,
               range_size: Optional[int] = None, stride: int = 1, owner: Optional[int] = None) -> torch.Tensor:
    """Return the owner of each id under the same map as :func:`partition_rows`.

    Returns:
        ``(n,)`` int64 owners.
    """
    part = partition_rows(ids, None, num_owners, scheme, num_rows, range_size=range_size, stride=stride, owner=owner)
    owners = torch.repeat_interleave(torch.arange(num_owners, device=ids.device), part.counts)
    out = torch.empty_like(owners)
    out[part.perm] = owners
    return out


def owned_bitmap(num_rows: int, num_owners: int, rank: int, scheme: str = "hash", *,
                 range_size: Optional[int] = None, stride: int = 1, owner: Optional[int] = None) -> torch.Tensor:
    """The ids of ``[0, num_rows)`` that ``rank`` owns under the map of :func:`partition_rows`, as a bitmap.

    Bit ``j`` of word ``w`` is set when id ``64 * w + j`` belongs to ``rank``
    (bit 63 is the sign bit). One pass over the ids, with none of them
    materialized: the ownership map of a row-sharded table's layout.

    Returns:
        ``(ceil(num_rows / 64),)`` int64 words on the CPU.

    Raises:
        ValueError: a bad size, rank or owner map.
    """
    bound = check_num_rows(num_rows)
    if bound < 1:
        raise ValueError(f"num_rows must be a positive int, got {num_rows!r}")
    if not isinstance(rank, int) or not 0 <= rank < num_owners:
        raise ValueError(f"need 0 <= rank < num_owners, got rank={rank!r}, num_owners={num_owners!r}")
    return _library.owned_bitmap(bound, owner_map(num_owners, scheme, bound, range_size, stride, owner), rank)


def bitmap_ids(words: torch.Tensor, count: int) -> torch.Tensor:
    """The ids of the set bits of ``words`` (an :func:`owned_bitmap`), ascending.

    Args:
        words: CPU int64 words.
        count: how many bits are set (the caller knows it; a wrong count is refused).

    Returns:
        ``(count,)`` int64 ids on the CPU.

    Raises:
        TypeError, ValueError: words not CPU int64, or ``count`` not their set bits.
    """
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int64 or words.device.type != "cpu" or \
            words.dim() != 1:
        raise TypeError("words must be a 1-D CPU int64 tensor")
    return _library.bitmap_ids(words, check_size(count, "count"))


def _check_bitmap(words: torch.Tensor, ids: torch.Tensor) -> None:
    for name, t in (("words", words), ("ids", ids)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.device.type != "cpu" or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D CPU int64 tensor")


def bitmap_positions(words: torch.Tensor, before: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each id's rank among the set bits of ``words`` (an :func:`owned_bitmap`): a row's slot among the owned ids.

    Args:
        words: CPU int64 words.
        before: per word, the set bits of the words before it (CPU int32 or int64).
        ids: CPU int64 ids, each inside the bitmap (its own bit need not be set).

    Returns:
        ``(len(ids),)`` int64.

    Raises:
        TypeError, ValueError: bad tensors, or an id outside ``[0, 64 len(words))``.
    """
    _check_bitmap(words, ids)
    if not isinstance(before, torch.Tensor) or before.dtype not in (torch.int32, torch.int64) or \
            before.device.type != "cpu" or tuple(before.shape) != tuple(words.shape) or not before.is_contiguous():
        raise TypeError("before must be a contiguous CPU int32/int64 tensor, one count per word")
    return _library.bitmap_positions(words.contiguous(), before, ids)


def bitmap_owns(words: torch.Tensor, num_rows: int, ids: torch.Tensor) -> torch.Tensor:
    """Whether each id lies in ``[0, num_rows)`` and its bit of ``words`` is set (bool, on the CPU).

    Raises:
        TypeError, ValueError: bad tensors, or ``num_rows`` beyond the bitmap.
    """
    _check_bitmap(words, ids)
    bound = check_num_rows(num_rows)
    if bound > 64 * words.numel():
        raise ValueError(f"num_rows {bound} exceeds the bitmap's {64 * words.numel()} ids")
    return _library.bitmap_owns(words.contiguous(), bound, ids)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Return ``table[ids]``: row ``i`` of the result is row ``ids[i]`` of ``table``.

    Args:
        table: ``(V, *row_shape)`` float table.
        ids: ``(n,)`` int32/int64 ids in ``[0, V)``.

    Returns:
        ``(n, *row_shape)`` tensor of the table's dtype.

    Raises:
        TypeError, ValueError: bad types, shapes, devices, or an id out of range.
    """
    check_ids(ids)
    check_values(table, "table", None, ids.device)
    flat = table.reshape(table.shape[0], row_width(table))
    return _library.call("gather", flat, ids).view((ids.shape[0], *table.shape[1:]))


def take_rows(table: torch.Tensor, ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``table[ids]`` for bulk moves of whole shards: a view when ``ids`` are one run of consecutive rows.

    Where :func:`gather_rows` serves a batch's scattered ids, this takes a
    shard's rows (ids ascending, often one run under ``"range"`` or
    ``"table"`` ownership): a slice there, torch's ``index_select`` (written
    into ``out`` when given) otherwise.

    Args:
        table: ``(V, ...)`` tensor.
        ids: ``(n,)`` int64 ids in ``[0, V)``, ascending.
        out: where to write the rows (``(n, ...)``, the table's dtype and
            device); None: a view of ``table`` when the ids are a run, else a
            new tensor.
    """
    ids = ids.to(table.device)
    n = ids.numel()
    run = n == 0 or int(ids[-1]) - int(ids[0]) + 1 == n
    if run:
        rows = table[int(ids[0]):int(ids[0]) + n] if n else table[:0]
        return out.copy_(rows) if out is not None else rows
    if out is not None and out.dtype == table.dtype and out.device == table.device and out.is_contiguous():
        return torch.index_select(table, 0, ids, out=out)
    rows = torch.index_select(table, 0, ids)
    return out.copy_(rows) if out is not None else rows


def scatter_add_rows(table: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Add ``values[i]`` to row ``ids[i]`` of ``table`` in place; duplicate ids add up.

    Each table row is updated by one thread, summing its updates in input order
    (fp16/bf16 in float32, rounded once): race-free and deterministic.

    Args:
        table: ``(V, *row_shape)`` float table, modified in place.
        ids: ``(n,)`` int32/int64 ids in ``[0, V)``.
        values: ``(n, *row_shape)``, same dtype as ``table``.

    Autograd does not see through the kernel, so the call is refused where a
    gradient would silently be wrong: with grad mode on, ``table`` and
    ``values`` must not require grad (run optimizer updates under
    ``torch.no_grad()``, as torch's own in-place updates of leaves must).
    The write bumps ``table``'s version counter like an in-place op, so a
    backward that saved ``table`` before the update raises instead of using
    the new values.

    Returns:
        ``table``.

    Raises:
        TypeError, ValueError: bad types, shapes, devices, dtypes, ``values``
            or ``ids`` sharing memory with ``table``, or an id out of range
            (the table is left untouched).
        RuntimeError: grad mode is on and ``table`` or ``values`` requires
            grad (as for torch's in-place ops on a leaf that requires grad).
    """
    check_ids(ids)
    check_values(table, "table", None, ids.device)
    check_values(values, "values", ids.shape[0], ids.device)
    if values.dtype != table.dtype:
        raise TypeError(f"values dtype {values.dtype} differs from table dtype {table.dtype}")
    if values.shape[1:] != table.shape[1:]:
        raise ValueError(f"values rows have shape {tuple(values.shape[1:])} but table rows have "
                         f"{tuple(table.shape[1:])}")
    # a no_grad view of a leaf counts as the leaf
    base = table if torch.compiler.is_compiling() or table._base is None else table._base
    if torch.is_grad_enabled() and (table.requires_grad or base.requires_grad or values.requires_grad):
        which = "values" if values.requires_grad and not (table.requires_grad or base.requires_grad) else "table"
        raise RuntimeError(f"scatter_add_rows is not differentiable but {which} requires grad: a leaf that "
                           f"requires grad cannot be updated in place, and a gradient through the update would "
                           f"be wrong; call it under torch.no_grad()")
    width = row_width(table)
    # The op declares that it writes `table`: the dispatcher bumps its version as for any in-place op.
    _library.call("scatter_add_", table.view(table.shape[0], width), ids, values.reshape(ids.shape[0], width))
    return table


def rowwise_adagrad_(weight: torch.Tensor, acc: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor,
                     lr: float, eps: float) -> None:
    """Row-wise Adagrad on distinct rows, in place and in one pass (what ``ShardedAdagrad(rowwise=True)`` does).

    For each ``i``: ``acc[s] += mean(grad[i] ** 2)``, then
    ``weight[s] += grad[i] * (-lr / (sqrt(acc[s]) + eps))`` (one division per row, as fbgemm's row-wise
    Adagrad; torch's ``grad / std * -lr`` can differ in the last bit), with ``s = slots[i]``.

    Args:
        weight: ``(V, d)`` float32/float64 rows, updated in place.
        acc: ``(V,)`` per-row accumulators of the same dtype, updated in place.
        slots: ``(k,)`` int64, strictly increasing (coalesced) rows of ``weight``.
        grad: ``(k, d)`` gradient rows, same dtype.
        lr, eps: the step size (already decayed) and Adagrad's epsilon.

    Raises:
        TypeError, ValueError: bad types or shapes, or a slot out of range
            or out of order (nothing is written).
    """
    check_ids(slots, "slots")
    check_values(weight, "weight", None, slots.device)
    if weight.dtype not in (torch.float32, torch.float64) or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-D float32/float64 tensor, got {weight.dtype} {tuple(weight.shape)}")
    check_values(acc, "acc", weight.shape[0], slots.device)
    check_values(grad, "grad", slots.shape[0], slots.device)
    if slots.dtype != torch.int64:
        raise TypeError(f"slots must be int64, got {slots.dtype}")
    if acc.dtype != weight.dtype or grad.dtype != weight.dtype:
        raise TypeError(f"acc ({acc.dtype}) and grad ({grad.dtype}) must have weight's dtype {weight.dtype}")
    if acc.dim() != 1 or grad.dim() != 2 or grad.shape[1] != weight.shape[1]:
        raise ValueError(f"acc must be (V,) and grad (k, {weight.shape[1]}), got {tuple(acc.shape)} and "
                         f"{tuple(grad.shape)}")
    _library.call("rowwise_adagrad_", weight, acc, slots, grad, float(lr), float(eps))
