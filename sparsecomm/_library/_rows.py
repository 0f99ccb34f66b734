"""The row operators: coalesce, partition by owner, gather, scatter-add, row-wise Adagrad; shard storage.

Each op: its CPU kernel (``sparsecomm._C``), its CUDA kernel (the launch of
its ``csrc/cuda/*.cu`` kernels through :mod:`sparsecomm._cuda`, or torch ops
where that is as fast), its fake and, where a gradient means something, its
autograd formula.

On CUDA, sorting and run-finding use torch (``torch.sort(stable=True)``,
``torch.unique_consecutive``, ``torch.cumsum``); the kernels do the fused
parts: segment sums, owner mapping with its histogram, and row copies.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from sparsecomm import _C, _cuda, ownership
from sparsecomm._library._common import (INDEX_CODE, VALUE_CODE, check_cuda_ids, check_no_overlap, dynamic_rows,
                                         row_bytes, threads)
from sparsecomm._library._registry import cuda_kernel, custom_op
from sparsecomm.types import PartitionScheme

__all__ = ["coalesce", "coalesce_partition", "partition", "gather", "scatter_add_", "rowwise_adagrad_", "empty_rows",
           "coalesce_rows_cuda", "partition_rows_cuda", "gather_rows_cuda", "scatter_add_rows_cuda"]

def _group_rows(ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Group positions by id: (order, group start offsets, group ids ascending).

    ``ids[order]`` is sorted and stable, so within a group ``order`` lists the
    input positions in input order: what makes the segment sums deterministic.
    """
    sorted_ids, order = torch.sort(ids, stable=True)
    group_ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    seg_start = torch.zeros(group_ids.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=seg_start[1:])
    return order, seg_start, group_ids


# ------------------------------------------------------------------ coalesce


@custom_op("coalesce")
def coalesce(ids: Tensor, values: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    # allow_dense: ids over a narrow range are grouped by a dense slot map and the values streamed in order.
    plan = _C.coalesce_plan(ids.data_ptr(), INDEX_CODE[ids.dtype], ids.shape[0], num_rows,
                            threads(ids.shape[0] * 8), True)
    u = plan.num_unique
    out_ids = torch.empty(u, dtype=ids.dtype)
    out_values = torch.empty((u, values.shape[1]), dtype=values.dtype)
    _C.coalesce_apply(plan, values.data_ptr(), VALUE_CODE[values.dtype], values.shape[1], out_ids.data_ptr(),
                      out_values.data_ptr(), threads(values.numel() * values.element_size()))
    return out_ids, out_values


def coalesce_rows_cuda(ids: Tensor, values: Tensor) -> Tuple[Tensor, Tensor]:
    """Sum the value rows of equal ids, on the GPU.

    Args:
        ids: ``(n,)`` int32 or int64 row ids, ``n`` may be 0.
        values: ``(n, d)`` float32/float64/float16/bfloat16 rows, ``d >= 1``.

    Returns:
        ``(unique_ids, sums)``: the distinct ids ascending (dtype of ``ids``)
        and ``(u, d)`` row sums (dtype of ``values``). Each sum adds its rows
        in input order (fp16/bf16 in float32, rounded once), so results are
        deterministic and bitwise equal to the CPU kernel.
    """
    d = values.shape[1]
    if ids.numel() == 0:
        return ids.new_empty(0), values.new_empty((0, d))
    order, seg_start, group_ids = _group_rows(ids)
    out = values.new_empty((group_ids.numel(), d))
    _segment_sums("coalesce_rows", _cuda.VALUE_SUFFIX[values.dtype], order, seg_start, d,
                  (_cuda.ptr(values), _cuda.ptr(order), _cuda.ptr(seg_start)), (_cuda.ptr(out),))
    return group_ids, out


LONG_ROWS = 256
"""Groups of more rows than this (hot ids) are summed by a second launch, a block each (``csrc/cuda/common.cuh``)."""


def _segment_sums(op: str, suffix: str, order: Tensor, seg_start: Tensor, d: int, head: Tuple[Any, ...],
                  tail: Tuple[Any, ...]) -> None:
    """Launch ``sparsecomm_<op>_<suffix>`` over the short groups, which lists the groups of more than
    :data:`LONG_ROWS` rows on the device, then ``sparsecomm_<op>_long_<suffix>`` over that list: no host sync
    between them. ``head``, ``tail``: the arguments before and after the group ones."""
    num_groups = seg_start.numel() - 1
    capacity = min(num_groups, order.numel() // (LONG_ROWS + 1))
    long_groups = torch.empty(capacity, dtype=torch.int64, device=order.device)
    num_long = torch.zeros(1, dtype=torch.int64, device=order.device)
    _cuda.launch(order.device, f"sparsecomm_{op}_{suffix}", num_groups * d,
                 head + (_cuda.i64(num_groups), _cuda.i64(d), _cuda.i64(LONG_ROWS), _cuda.ptr(long_groups),
                         _cuda.ptr(num_long), _cuda.i64(capacity)) + tail)
    _cuda.launch(order.device, f"sparsecomm_{op}_long_{suffix}", capacity * -(-d // _cuda.BLOCK) * _cuda.BLOCK,
                 head + (_cuda.ptr(long_groups), _cuda.ptr(num_long), _cuda.i64(capacity), _cuda.i64(d)) + tail)


@cuda_kernel("coalesce")
def _(ids: Tensor, values: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    check_cuda_ids(ids, num_rows)
    return coalesce_rows_cuda(ids, values)


@coalesce.register_fake
def _(ids: Tensor, values: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    u = dynamic_rows()
    return ids.new_empty(u), values.new_empty((u, values.shape[1]))


def _coalesce_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], output[0])


def _coalesce_backward(ctx, grad_ids, grad_sums):
    ids, out_ids = ctx.saved_tensors
    # Each input row went into the sum of its id: its gradient is that sum's gradient.
    where = torch.searchsorted(out_ids, ids)
    return None, grad_sums.index_select(0, where), None


coalesce.register_autograd(_coalesce_backward, setup_context=_coalesce_setup)


# ---------------------------------------------------- coalesce + partition


@custom_op("coalesce_partition")
def coalesce_partition(ids: Tensor, values: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int,
                       stride: int) -> Tuple[Tensor, Tensor, Tensor]:
    plan = _C.coalesce_plan(ids.data_ptr(), INDEX_CODE[ids.dtype], ids.shape[0], num_rows,
                            threads(ids.shape[0] * 8), False)
    u = plan.num_unique
    counts = torch.empty(num_owners, dtype=torch.int64)
    out_ids = torch.empty(u, dtype=ids.dtype)
    out_values = torch.empty((u, values.shape[1]), dtype=values.dtype)
    _C.coalesce_partition_apply(plan, values.data_ptr(), VALUE_CODE[values.dtype], values.shape[1], scheme,
                                num_owners, range_size, stride, counts.data_ptr(), out_ids.data_ptr(),
                                out_values.data_ptr(), threads(values.numel() * values.element_size()))
    return counts, out_ids, out_values


@cuda_kernel("coalesce_partition")
def _(ids: Tensor, values: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor]:
    check_cuda_ids(ids, num_rows)
    out_ids, sums = coalesce_rows_cuda(ids, values)
    counts, out_ids, sums, _ = partition_rows_cuda(out_ids, sums, num_owners, scheme, range_size, stride)
    return counts, out_ids, sums


@coalesce_partition.register_fake
def _(ids: Tensor, values: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor]:
    u = dynamic_rows()
    return ids.new_empty(num_owners, dtype=torch.int64), ids.new_empty(u), values.new_empty((u, values.shape[1]))


# ----------------------------------------------------------------- partition


@custom_op("partition")
def partition(ids: Tensor, values: Optional[Tensor], num_rows: int, num_owners: int, scheme: int, range_size: int,
              stride: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    n = ids.shape[0]
    counts = torch.empty(num_owners, dtype=torch.int64)
    out_ids = torch.empty_like(ids)
    perm = torch.empty(n, dtype=torch.int64)
    out_values = ids.new_empty((0, 0), dtype=torch.float32) if values is None else torch.empty_like(values)
    _C.partition_rows(ids.data_ptr(), INDEX_CODE[ids.dtype], n, num_rows,
                      0 if values is None else values.data_ptr(), 0 if values is None else row_bytes(values),
                      scheme, num_owners, range_size, stride, counts.data_ptr(), out_ids.data_ptr(),
                      0 if values is None else out_values.data_ptr(), perm.data_ptr(),
                      threads(n * (8 + (0 if values is None else row_bytes(values)))))
    return counts, out_ids, out_values, perm


# partition_owners counts in shared memory (8 bytes a bin) up to this many
# owners; beyond it, straight into global memory.
_MAX_BLOCK_BINS = 4096


def partition_rows_cuda(
    ids: Tensor,
    values: Optional[Tensor],
    num_owners: int,
    scheme: int,
    range_size: int,
    stride: int,
) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """Reorder rows so that each owner's rows are contiguous, on the GPU.

    ``owner(id) = (bucket(id) // stride) % num_owners`` where ``bucket`` is
    splitmix64(id) for the hash scheme, ``id // range_size`` for the range
    scheme, ``range_size`` itself (the owner) for the table scheme:
    ``csrc/owner_map.h``, the map the CPU kernel evaluates too.

    Args:
        ids: ``(n,)`` int32 or int64 non-negative row ids.
        values: ``(n, d)`` rows that travel with the ids, or None.
        num_owners: Number of owners (ranks), >= 1.
        scheme: The scheme's code (:func:`sparsecomm.ownership.scheme_code`).
        range_size: Ids per range (range scheme), >= 1; the owner (table scheme), >= 0.
        stride: Consecutive buckets that map to one owner, >= 1.

    Returns:
        ``(counts, ids_out, values_out, perm)``: ``(num_owners,)`` int64 rows
        per owner; ids grouped by owner in owner order, stable inside an owner;
        values permuted the same way (None if ``values`` is None); ``(n,)``
        int64 ``perm`` with ``ids_out == ids[perm]``.

    Raises:
        ValueError: An owner-map parameter is out of range.
    """
    ownership.OwnerMap(num_owners, scheme, range_size, stride).check()
    if num_owners > 2**31 - 1:  # owners are written as int32
        raise ValueError(f"sparsecomm: num_owners must be in [1, 2**31), got {num_owners}")
    uses_param = ownership.scheme_from_code(scheme) in (PartitionScheme.RANGE, PartitionScheme.TABLE)
    n = ids.numel()
    counts = torch.zeros(num_owners, dtype=torch.int64, device=ids.device)
    if n == 0:
        empty_values = None if values is None else values.new_empty((0, values.shape[1]))
        perm = torch.empty(0, dtype=torch.int64, device=ids.device)
        return counts, ids.new_empty(0), empty_values, perm
    owners = torch.empty(n, dtype=torch.int32, device=ids.device)
    block_bins = num_owners <= _MAX_BLOCK_BINS
    _cuda.launch(
        ids.device,
        f"sparsecomm_partition_owners_{_cuda.ID_SUFFIX[ids.dtype]}",
        n,
        (
            _cuda.ptr(ids),
            _cuda.i64(n),
            _cuda.i32(scheme),
            _cuda.i64(num_owners),
            # Unused by the hash scheme; 1 keeps the argument meaningful.
            _cuda.i64(range_size if uses_param else 1),
            _cuda.i64(stride),
            _cuda.ptr(owners),
            _cuda.ptr(counts),
            _cuda.i32(int(block_bins)),
        ),
        shared_mem=8 * num_owners if block_bins else 0,
    )
    # A stable sort of the owner ranks is the stable counting sort we need.
    perm = torch.sort(owners, stable=True).indices
    ids_out = gather_rows_cuda(ids.view(n, 1), perm).view(n)
    values_out = None if values is None else gather_rows_cuda(values, perm)
    return counts, ids_out, values_out, perm


@cuda_kernel("partition")
def _(ids: Tensor, values: Optional[Tensor], num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    check_cuda_ids(ids, num_rows)
    counts, out_ids, out_values, perm = partition_rows_cuda(ids, values, num_owners, scheme, range_size, stride)
    if out_values is None:
        out_values = torch.empty((0, 0), device=ids.device)
    return counts, out_ids, out_values, perm


@partition.register_fake
def _(ids: Tensor, values: Optional[Tensor], num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    out_values = ids.new_empty((0, 0), dtype=torch.float32) if values is None else torch.empty_like(values)
    return (ids.new_empty(num_owners, dtype=torch.int64), torch.empty_like(ids), out_values,
            ids.new_empty(ids.shape[0], dtype=torch.int64))


def _partition_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[3])
    ctx.has_values = inputs[1] is not None


def _partition_backward(ctx, grad_counts, grad_ids, grad_values, grad_perm):
    (perm,) = ctx.saved_tensors
    if grad_values is None or not ctx.has_values:
        return None, None, None, None, None, None, None
    # Row perm[i] of the input became row i of the output.
    grad_in = torch.empty_like(grad_values).index_copy_(0, perm, grad_values)
    return None, grad_in, None, None, None, None, None


partition.register_autograd(_partition_backward, setup_context=_partition_setup)


# -------------------------------------------------------------------- gather


@custom_op("gather")
def gather(table: Tensor, ids: Tensor) -> Tensor:
    out = torch.empty((ids.shape[0], table.shape[1]), dtype=table.dtype)
    _C.gather_rows(table.data_ptr(), table.shape[0], row_bytes(table), ids.data_ptr(), INDEX_CODE[ids.dtype],
                   ids.shape[0], out.data_ptr(), threads(out.numel() * out.element_size()))
    return out


# gather copies bytes, not values: its kernels are typed by copy unit (bytes).
_UNIT_SUFFIX = {16: "u128", 8: "u64", 4: "u32", 2: "u16", 1: "u8"}


def gather_rows_cuda(table: Tensor, ids: Tensor) -> Tensor:
    """Copy the rows ``table[ids]`` into a new tensor, on the GPU.

    Args:
        table: ``(V, d)`` contiguous rows of any dtype.
        ids: ``(n,)`` int32 or int64 ids in ``[0, V)``.

    Returns:
        ``(n, d)`` tensor of the dtype of ``table`` with ``out[i] = table[ids[i]]``.
    """
    n = ids.numel()
    num_rows, d = table.shape
    out = table.new_empty((n, d))
    row_bytes = d * table.element_size()
    if n == 0 or row_bytes == 0:
        return out
    # Widest copy unit that divides the row and keeps both sides aligned.
    unit = next(
        w
        for w in _UNIT_SUFFIX
        if row_bytes % w == 0 and table.data_ptr() % w == 0 and out.data_ptr() % w == 0
    )
    row_units = row_bytes // unit
    _cuda.launch(
        table.device,
        f"sparsecomm_gather_rows_{_UNIT_SUFFIX[unit]}_{_cuda.ID_SUFFIX[ids.dtype]}",
        n * row_units,
        (_cuda.ptr(table), _cuda.i64(num_rows), _cuda.ptr(ids), _cuda.i64(n), _cuda.i64(row_units), _cuda.ptr(out)),
    )
    return out


@cuda_kernel("gather")
def _(table: Tensor, ids: Tensor) -> Tensor:
    check_cuda_ids(ids, table.shape[0])
    return gather_rows_cuda(table, ids)


@gather.register_fake
def _(table: Tensor, ids: Tensor) -> Tensor:
    return table.new_empty((ids.shape[0], table.shape[1]))


def _gather_setup(ctx, inputs, output) -> None:
    table, ids = inputs
    ctx.save_for_backward(ids)
    ctx.table_shape = table.shape


def _gather_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    grad_table = grad.new_zeros(ctx.table_shape)
    torch.ops.sparsecomm.scatter_add_(grad_table, ids, grad.contiguous())
    return grad_table, None


gather.register_autograd(_gather_backward, setup_context=_gather_setup)


# --------------------------------------------------------------- scatter-add


@custom_op("scatter_add_", mutates_args=("table",))
def scatter_add_(table: Tensor, ids: Tensor, values: Tensor) -> None:
    check_no_overlap(table, values, "values")
    check_no_overlap(table, ids, "ids")
    _C.scatter_add_rows(table.data_ptr(), table.shape[0], VALUE_CODE[table.dtype], table.shape[1], ids.data_ptr(),
                        INDEX_CODE[ids.dtype], ids.shape[0], values.data_ptr(),
                        threads(values.numel() * values.element_size()))


def scatter_add_rows_cuda(table: Tensor, ids: Tensor, values: Tensor) -> Tensor:
    """Add ``values[i]`` into ``table[ids[i]]`` in place, on the GPU.

    Duplicate ids are allowed. Each touched table row becomes its old value
    plus its updates summed in input order (fp16/bf16 in float32, rounded
    once), without atomics: deterministic and bitwise equal to the CPU kernel.

    Args:
        table: ``(V, d)`` float32/float64/float16/bfloat16 table, updated in place.
        ids: ``(n,)`` int32 or int64 ids in ``[0, V)``.
        values: ``(n, d)`` rows of the dtype of ``table``.

    Returns:
        ``table``.
    """
    if ids.numel() == 0:
        return table
    num_rows, d = table.shape
    order, seg_start, group_ids = _group_rows(ids)
    _segment_sums("scatter_add_rows", f"{_cuda.VALUE_SUFFIX[table.dtype]}_{_cuda.ID_SUFFIX[ids.dtype]}", order,
                  seg_start, d, (_cuda.ptr(table), _cuda.i64(num_rows), _cuda.ptr(group_ids), _cuda.ptr(values),
                                 _cuda.ptr(order), _cuda.ptr(seg_start)), ())
    return table


@cuda_kernel("scatter_add_")
def _(table: Tensor, ids: Tensor, values: Tensor) -> None:
    check_no_overlap(table, values, "values")
    check_no_overlap(table, ids, "ids")
    check_cuda_ids(ids, table.shape[0])
    scatter_add_rows_cuda(table, ids, values)


@scatter_add_.register_fake
def _(table: Tensor, ids: Tensor, values: Tensor) -> None:
    return None


# ------------------------------------------------------- shard storage


def empty_rows(shape: Tuple[int, ...], dtype: torch.dtype, device: Any = None) -> Tensor:
    """``torch.empty(shape)`` for a table read and updated at random rows: on the CPU, backed by transparent
    huge pages where the OS allows it (Linux with THP "always" or "madvise"; elsewhere plain pages).

    Asked before the first write, so the pages are huge from the start: with 4 KiB pages every random row is
    a TLB miss.
    """
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu" and t.numel():
        _C.advise_huge_pages(t.data_ptr(), t.numel() * t.element_size())
    return t


# ------------------------------------------------------- owned-id bitmaps


def owned_bitmap(num_rows: int, owner_map: ownership.OwnerMap, rank: int) -> Tensor:
    """The ids in ``[0, num_rows)`` that ``rank`` owns under ``owner_map``, as a bitmap: bit ``j`` of word ``w``
    (``ceil(num_rows / 64)`` int64 words, on the CPU) is id ``64 w + j``; one pass, no ids materialized."""
    words = torch.empty(-(-num_rows // 64), dtype=torch.int64)
    _C.owned_bitmap(num_rows, owner_map.scheme, owner_map.num_owners, owner_map.range_size, owner_map.stride, rank,
                    words.data_ptr(), threads(num_rows))
    return words


def bitmap_ids(words: Tensor, count: int) -> Tensor:
    """The ids of the ``count`` set bits of CPU int64 ``words`` (an :func:`owned_bitmap`), ascending (int64).

    Raises:
        ValueError: ``words`` has another number of set bits (nothing is written past ``count``).
    """
    words = words.contiguous()
    out = torch.empty(count, dtype=torch.int64)
    found = _C.bitmap_ids(words.data_ptr(), words.numel(), out.data_ptr(), count)
    if found != count:
        raise ValueError(f"the bitmap has {found} set bits, not {count}")
    return out


def bitmap_positions(words: Tensor, before: Tensor, ids: Tensor) -> Tensor:
    """Each of the CPU int64 ``ids``' rank among the set bits of ``words`` (an :func:`owned_bitmap`; ``before``:
    per word, the set bits before it): its slot (int64). ``ValueError`` for an id outside the bitmap."""
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), dtype=torch.int64)
    bad = _C.bitmap_positions(words.data_ptr(), words.numel(), before.data_ptr(), before.element_size(),
                              ids.data_ptr(), ids.numel(), out.data_ptr())
    if bad >= 0:
        raise ValueError(f"id {int(ids[bad])} lies outside the bitmap of {64 * words.numel()} ids")
    return out


def bitmap_owns(words: Tensor, num_rows: int, ids: Tensor) -> Tensor:
    """Whether each of the CPU int64 ``ids`` lies in ``[0, num_rows)`` with its bit of ``words`` set (bool)."""
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), dtype=torch.bool)
    _C.bitmap_owns(words.data_ptr(), num_rows, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out


# ------------------------------------------------------- row-wise Adagrad


@custom_op("rowwise_adagrad_", mutates_args=("weight", "acc"))
def rowwise_adagrad_(weight: Tensor, acc: Tensor, slots: Tensor, grad: Tensor, lr: float, eps: float) -> None:
    check_no_overlap(weight, grad, "grad")
    check_no_overlap(acc, grad, "grad")
    _C.rowwise_adagrad(weight.data_ptr(), acc.data_ptr(), weight.shape[0], VALUE_CODE[weight.dtype],
                       weight.shape[1], slots.data_ptr(), slots.shape[0], grad.data_ptr(), lr, eps,
                       threads(grad.numel() * grad.element_size()))


@cuda_kernel("rowwise_adagrad_")
def _(weight: Tensor, acc: Tensor, slots: Tensor, grad: Tensor, lr: float, eps: float) -> None:
    # The CPU kernel checks the order in its pass; index_add_ would sum a repeated slot's rows instead.
    if slots.numel() > 1 and not bool((slots[1:] > slots[:-1]).all()):
        raise ValueError("slots must be strictly increasing (coalesced)")
    check_cuda_ids(slots, weight.shape[0], "slots")
    acc.index_add_(0, slots, grad.pow(2).mean(dim=1))
    std = acc.index_select(0, slots).sqrt_().add_(eps).unsqueeze(1)
    weight.index_add_(0, slots, (grad / std).mul_(-lr))


@rowwise_adagrad_.register_fake
def _(weight: Tensor, acc: Tensor, slots: Tensor, grad: Tensor, lr: float, eps: float) -> None:
    return None
