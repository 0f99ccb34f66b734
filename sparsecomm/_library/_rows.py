"""The row operators: coalesce, partition by owner, gather, scatter-add, row-wise Adagrad; shard storage.

Each op: its CPU kernel (``sparsecomm._C``), its CUDA kernel
(:mod:`sparsecomm._cuda`, or torch ops where that is as fast), its fake and,
where a gradient means something, its autograd formula.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from sparsecomm import _C, _cuda
from sparsecomm._library._common import (INDEX_CODE, VALUE_CODE, check_cuda_ids, check_no_overlap, dynamic_rows,
                                         row_bytes, threads)
from sparsecomm._library._registry import custom_op

__all__ = ["coalesce", "coalesce_partition", "partition", "gather", "scatter_add_", "rowwise_adagrad_", "empty_rows"]


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


@coalesce.register_kernel("cuda")
def _(ids: Tensor, values: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    check_cuda_ids(ids, num_rows)
    return _cuda.coalesce_rows(ids, values)


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


@coalesce_partition.register_kernel("cuda")
def _(ids: Tensor, values: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor]:
    check_cuda_ids(ids, num_rows)
    out_ids, sums = _cuda.coalesce_rows(ids, values)
    counts, out_ids, sums, _ = _cuda.partition_rows(out_ids, sums, num_owners, scheme, range_size, stride)
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


@partition.register_kernel("cuda")
def _(ids: Tensor, values: Optional[Tensor], num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    check_cuda_ids(ids, num_rows)
    counts, out_ids, out_values, perm = _cuda.partition_rows(ids, values, num_owners, scheme, range_size, stride)
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


@gather.register_kernel("cuda")
def _(table: Tensor, ids: Tensor) -> Tensor:
    check_cuda_ids(ids, table.shape[0])
    return _cuda.gather_rows(table, ids)


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


@scatter_add_.register_kernel("cuda")
def _(table: Tensor, ids: Tensor, values: Tensor) -> None:
    check_no_overlap(table, values, "values")
    check_no_overlap(table, ids, "ids")
    check_cuda_ids(ids, table.shape[0])
    _cuda.scatter_add_rows(table, ids, values)


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


# ------------------------------------------------------- row-wise Adagrad


@custom_op("rowwise_adagrad_", mutates_args=("weight", "acc"))
def rowwise_adagrad_(weight: Tensor, acc: Tensor, slots: Tensor, grad: Tensor, lr: float, eps: float) -> None:
    check_no_overlap(weight, grad, "grad")
    check_no_overlap(acc, grad, "grad")
    _C.rowwise_adagrad(weight.data_ptr(), acc.data_ptr(), weight.shape[0], VALUE_CODE[weight.dtype],
                       weight.shape[1], slots.data_ptr(), slots.shape[0], grad.data_ptr(), lr, eps,
                       threads(grad.numel() * grad.element_size()))


@rowwise_adagrad_.register_kernel("cuda")
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
