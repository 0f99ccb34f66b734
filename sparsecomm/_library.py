"""The row kernels as PyTorch operators: ``torch.ops.sparsecomm.*``.

Each op has a schema (``torch.library.custom_op``), a CPU kernel (the C++
kernels in ``sparsecomm._C``), a CUDA kernel (``sparsecomm._cuda``, CuPy), a
fake implementation (shapes only, for ``torch.compile`` and meta tensors) and,
where a gradient means something, an autograd formula. The dispatcher picks
the kernel from the tensors' device; a device with neither kernel gets
PyTorch's own "could not run ... with arguments from the ... backend" error.

These ops trust their arguments' types and shapes: :mod:`sparsecomm.ops`
validates, names the bad argument and then calls them. They check what only
real data can tell (ids in range, buffers not overlapping) themselves, so a
compiled graph, which skips the Python checks that need data, stays safe.

Ops (values are 2-D ``(n, d)`` here; ``num_rows < 0`` means no upper bound):

- ``coalesce(ids, values, num_rows) -> (unique_ids, sums)``
- ``coalesce_partition(ids, values, num_rows, num_owners, scheme, range_size, stride)
  -> (counts, ids, sums)``: coalesce, then the rows grouped by owner.
- ``partition(ids, values?, num_rows, num_owners, scheme, range_size, stride)
  -> (counts, ids, values, perm)``: ``values`` is ``(0, 0)`` when none was given.
- ``gather(table, ids) -> rows``
- ``scatter_add_(table!, ids, values)``
- ``pack_rows_(buffer!, src, index?, segments, wire_id_bytes)``: copy rows
  (``src[index[start:start+count]]``) straight into their places in a byte
  buffer, ``segments`` flat ``[start, count, byte_offset] * nseg``.
- ``coalesce_segments(buffer, segments, id_bytes, value_dtype, d, num_rows, out_ids_dtype, out_acc)
  -> (unique_ids, sums)``: coalesce rows straight out of a receive buffer,
  ``segments`` flat ``[count, id_byte_offset, value_byte_offset] * nseg``.
- ``group_by(index, size) -> (order, offsets)``: a stable counting sort.
- ``bag_groups(key, positions, lengths, size) -> (order, rows, offsets)``: the owner's backward plan of
  pooled lookups (occurrences grouped by ``key[positions]``, with their bags).
- ``unique_inverse(ids, num_rows) -> (unique, inverse)``: ``torch.unique(sorted, return_inverse)``.
- ``pooled_request(ids, bag_of, num_rows, num_owners, scheme, range_size, stride, num_bags)
  -> (unique, unique_counts, order, occ_counts, positions, bag_rows, lengths, bag_counts)``: owner
  pooling's request (``num_bags < 0``: no bound on ``bag_of``).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from sparsecomm import _C

__all__ = ["INDEX_CODE", "VALUE_CODE", "acc_dtype"]

INDEX_CODE = {torch.int32: 0, torch.int64: 1}
VALUE_CODE = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_WIRE_ID_DTYPE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels sum ``dtype`` in: float32 for fp16/bf16."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# Below this many bytes of rows, one thread: starting an OpenMP team costs more than it saves, and far
# more on a loaded machine (measured here: a 10-row gather took 7 ms with 2 threads while another
# process held the second core, 0.07 ms with one).
_PARALLEL_BYTES = 1 << 18


def _threads(work_bytes: int) -> int:
    return torch.get_num_threads() if work_bytes >= _PARALLEL_BYTES else 1


def _cuda():
    from sparsecomm import _cuda

    return _cuda


def _check_cuda_ids(ids: Tensor, num_rows: int, name: str = "ids") -> None:
    # The CUDA kernels trust their ids; one reduction here keeps them in bounds.
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (num_rows >= 0 and hi >= num_rows):
        bad = lo if lo < 0 else hi
        bound = "inf" if num_rows < 0 else str(num_rows)
        raise ValueError(f"sparsecomm: {name} contains id {bad} outside [0, {bound})")


def _byte_span(t: Tensor) -> Tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_no_overlap(table: Tensor, other: Tensor, name: str) -> None:
    """Raise ValueError if ``other`` shares bytes with ``table`` (both contiguous)."""
    if table.numel() == 0 or other.numel() == 0:
        return
    (a0, a1), (b0, b1) = _byte_span(table), _byte_span(other)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{name} overlaps table's memory: the kernel would read what it is writing")


def _row_bytes(t: Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _dynamic_rows() -> torch.SymInt:
    return torch.library.get_ctx().new_dynamic_size()


# ------------------------------------------------------------------ coalesce


@torch.library.custom_op("sparsecomm::coalesce", mutates_args=(), device_types="cpu")
def coalesce(ids: Tensor, values: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    # allow_dense: ids over a narrow range are grouped by a dense slot map and the values streamed in order.
    plan = _C.coalesce_plan(ids.data_ptr(), INDEX_CODE[ids.dtype], ids.shape[0], num_rows,
                            _threads(ids.shape[0] * 8), True)
    u = plan.num_unique
    out_ids = torch.empty(u, dtype=ids.dtype)
    out_values = torch.empty((u, values.shape[1]), dtype=values.dtype)
    _C.coalesce_apply(plan, values.data_ptr(), VALUE_CODE[values.dtype], values.shape[1], out_ids.data_ptr(),
                      out_values.data_ptr(), _threads(values.numel() * values.element_size()))
    return out_ids, out_values


@coalesce.register_kernel("cuda")
def _(ids: Tensor, values: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    _check_cuda_ids(ids, num_rows)
    return _cuda().coalesce_rows(ids, values)


@coalesce.register_fake
def _(ids: Tensor, values: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    u = _dynamic_rows()
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


@torch.library.custom_op("sparsecomm::coalesce_partition", mutates_args=(), device_types="cpu")
def coalesce_partition(ids: Tensor, values: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int,
                       stride: int) -> Tuple[Tensor, Tensor, Tensor]:
    plan = _C.coalesce_plan(ids.data_ptr(), INDEX_CODE[ids.dtype], ids.shape[0], num_rows,
                            _threads(ids.shape[0] * 8), False)
    u = plan.num_unique
    counts = torch.empty(num_owners, dtype=torch.int64)
    out_ids = torch.empty(u, dtype=ids.dtype)
    out_values = torch.empty((u, values.shape[1]), dtype=values.dtype)
    _C.coalesce_partition_apply(plan, values.data_ptr(), VALUE_CODE[values.dtype], values.shape[1], scheme,
                                num_owners, range_size, stride, counts.data_ptr(), out_ids.data_ptr(),
                                out_values.data_ptr(), _threads(values.numel() * values.element_size()))
    return counts, out_ids, out_values


@coalesce_partition.register_kernel("cuda")
def _(ids: Tensor, values: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor]:
    _check_cuda_ids(ids, num_rows)
    out_ids, sums = _cuda().coalesce_rows(ids, values)
    counts, out_ids, sums, _ = _cuda().partition_rows(out_ids, sums, num_owners, scheme, range_size, stride)
    return counts, out_ids, sums


@coalesce_partition.register_fake
def _(ids: Tensor, values: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor]:
    u = _dynamic_rows()
    return ids.new_empty(num_owners, dtype=torch.int64), ids.new_empty(u), values.new_empty((u, values.shape[1]))


# ----------------------------------------------------------------- partition


@torch.library.custom_op("sparsecomm::partition", mutates_args=(), device_types="cpu")
def partition(ids: Tensor, values: Optional[Tensor], num_rows: int, num_owners: int, scheme: int, range_size: int,
              stride: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    n = ids.shape[0]
    counts = torch.empty(num_owners, dtype=torch.int64)
    out_ids = torch.empty_like(ids)
    perm = torch.empty(n, dtype=torch.int64)
    out_values = ids.new_empty((0, 0), dtype=torch.float32) if values is None else torch.empty_like(values)
    _C.partition_rows(ids.data_ptr(), INDEX_CODE[ids.dtype], n, num_rows,
                      0 if values is None else values.data_ptr(), 0 if values is None else _row_bytes(values),
                      scheme, num_owners, range_size, stride, counts.data_ptr(), out_ids.data_ptr(),
                      0 if values is None else out_values.data_ptr(), perm.data_ptr(),
                      _threads(n * (8 + (0 if values is None else _row_bytes(values)))))
    return counts, out_ids, out_values, perm


@partition.register_kernel("cuda")
def _(ids: Tensor, values: Optional[Tensor], num_rows: int, num_owners: int, scheme: int, range_size: int,
      stride: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_cuda_ids(ids, num_rows)
    counts, out_ids, out_values, perm = _cuda().partition_rows(ids, values, num_owners, scheme, range_size, stride)
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


@torch.library.custom_op("sparsecomm::gather", mutates_args=(), device_types="cpu")
def gather(table: Tensor, ids: Tensor) -> Tensor:
    out = torch.empty((ids.shape[0], table.shape[1]), dtype=table.dtype)
    _C.gather_rows(table.data_ptr(), table.shape[0], _row_bytes(table), ids.data_ptr(), INDEX_CODE[ids.dtype],
                   ids.shape[0], out.data_ptr(), _threads(out.numel() * out.element_size()))
    return out


@gather.register_kernel("cuda")
def _(table: Tensor, ids: Tensor) -> Tensor:
    _check_cuda_ids(ids, table.shape[0])
    return _cuda().gather_rows(table, ids)


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


@torch.library.custom_op("sparsecomm::scatter_add_", mutates_args=("table",), device_types="cpu")
def scatter_add_(table: Tensor, ids: Tensor, values: Tensor) -> None:
    check_no_overlap(table, values, "values")
    check_no_overlap(table, ids, "ids")
    _C.scatter_add_rows(table.data_ptr(), table.shape[0], VALUE_CODE[table.dtype], table.shape[1], ids.data_ptr(),
                        INDEX_CODE[ids.dtype], ids.shape[0], values.data_ptr(),
                        _threads(values.numel() * values.element_size()))


@scatter_add_.register_kernel("cuda")
def _(table: Tensor, ids: Tensor, values: Tensor) -> None:
    check_no_overlap(table, values, "values")
    check_no_overlap(table, ids, "ids")
    _check_cuda_ids(ids, table.shape[0])
    _cuda().scatter_add_rows(table, ids, values)


@scatter_add_.register_fake
def _(table: Tensor, ids: Tensor, values: Tensor) -> None:
    return None


# ------------------------------------------------------- shard storage


def empty_rows(shape: Tuple[int, ...], dtype: torch.dtype, device: Any = None) -> Tensor:
    """``torch.empty(shape)`` for a table read and updated at random rows: on the CPU, backed by transparent
    huge pages where the OS allows it (Linux with THP "always" or "madvise"; elsewhere plain pages).

    Asked before the first write, so the pages are huge from the start: with 4 KiB pages every random row is
    a TLB miss (embedding_bag over 40,960 random rows of a 128 MB shard: 0.40 ms, 0.28 with huge pages).
    """
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu" and t.numel():
        _C.advise_huge_pages(t.data_ptr(), t.numel() * t.element_size())
    return t


# ------------------------------------------------------- row-wise Adagrad


@torch.library.custom_op("sparsecomm::rowwise_adagrad_", mutates_args=("weight", "acc"), device_types="cpu")
def rowwise_adagrad_(weight: Tensor, acc: Tensor, slots: Tensor, grad: Tensor, lr: float, eps: float) -> None:
    check_no_overlap(weight, grad, "grad")
    check_no_overlap(acc, grad, "grad")
    _C.rowwise_adagrad(weight.data_ptr(), acc.data_ptr(), weight.shape[0], VALUE_CODE[weight.dtype],
                       weight.shape[1], slots.data_ptr(), slots.shape[0], grad.data_ptr(), lr, eps,
                       _threads(grad.numel() * grad.element_size()))


@rowwise_adagrad_.register_kernel("cuda")
def _(weight: Tensor, acc: Tensor, slots: Tensor, grad: Tensor, lr: float, eps: float) -> None:
    _check_cuda_ids(slots, weight.shape[0], "slots")
    acc.index_add_(0, slots, grad.pow(2).mean(dim=1))
    std = acc.index_select(0, slots).sqrt_().add_(eps).unsqueeze(1)
    weight.index_add_(0, slots, (grad / std).mul_(-lr))


@rowwise_adagrad_.register_fake
def _(weight: Tensor, acc: Tensor, slots: Tensor, grad: Tensor, lr: float, eps: float) -> None:
    return None


# ------------------------------------------- owner pooling's index kernels
#
# CPU: one-pass C++ kernels (csrc/pooled.cpp). CUDA: the torch ops they replace (`*_torch` below, which run
# on any device and are the reference the CPU kernels must equal exactly).


def group_by_torch(index: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    """``(argsort(index, stable=True), cumsum(count) - count)``, ``count = bincount(index, minlength=size)``."""
    _check_cuda_ids(index, size, "index")
    order = torch.argsort(index, stable=True)
    count = torch.bincount(index, minlength=size)
    return order, torch.cumsum(count, 0) - count


def bag_groups_torch(key: Tensor, positions: Tensor, lengths: Tensor, size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``order = argsort(key[positions], stable=True)``, ``rows = repeat_interleave(arange(B), lengths)[order]``
    and the groups' starts (``cumsum(bincount) - bincount``)."""
    _check_cuda_ids(key, size, "key")
    _check_cuda_ids(positions, key.shape[0], "positions")
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
    _check_cuda_ids(ids, num_rows)
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
    """The torch ops of ``TableSet._pooled_request`` (sparsecomm/sharded/lookup.py) that pooled_request replaces."""
    _check_cuda_ids(ids, num_rows)
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


@torch.library.custom_op("sparsecomm::group_by", mutates_args=(), device_types="cpu")
def group_by(index: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    order = torch.empty(index.shape[0], dtype=torch.int64)
    offsets = torch.empty(size, dtype=torch.int64)
    _C.group_by(index.data_ptr(), index.shape[0], size, order.data_ptr(), offsets.data_ptr(),
                _threads(index.shape[0] * 8))
    return order, offsets


group_by.register_kernel("cuda")(group_by_torch)


@group_by.register_fake
def _(index: Tensor, size: int) -> Tuple[Tensor, Tensor]:
    return index.new_empty(index.shape[0], dtype=torch.int64), index.new_empty(size, dtype=torch.int64)


@torch.library.custom_op("sparsecomm::bag_groups", mutates_args=(), device_types="cpu")
def bag_groups(key: Tensor, positions: Tensor, lengths: Tensor, size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n = positions.shape[0]
    order = torch.empty(n, dtype=torch.int64)
    rows = torch.empty(n, dtype=torch.int64)
    offsets = torch.empty(size, dtype=torch.int64)
    _C.bag_groups(key.data_ptr(), key.shape[0], positions.data_ptr(), n, lengths.data_ptr(), lengths.shape[0], size,
                  order.data_ptr(), rows.data_ptr(), offsets.data_ptr(), _threads(n * 8))
    return order, rows, offsets


bag_groups.register_kernel("cuda")(bag_groups_torch)


@bag_groups.register_fake
def _(key: Tensor, positions: Tensor, lengths: Tensor, size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n = positions.shape[0]
    return (positions.new_empty(n, dtype=torch.int64), positions.new_empty(n, dtype=torch.int64),
            positions.new_empty(size, dtype=torch.int64))


@torch.library.custom_op("sparsecomm::unique_inverse", mutates_args=(), device_types="cpu")
def unique_inverse(ids: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    inverse = torch.empty(ids.shape[0], dtype=torch.int64)
    lists = _C.unique_inverse(ids.data_ptr(), ids.shape[0], num_rows, inverse.data_ptr(), _threads(ids.shape[0] * 8))
    unique = torch.empty(lists.num_unique, dtype=torch.int64)
    lists.write(unique.data_ptr(), 0, 0)
    return unique, inverse


unique_inverse.register_kernel("cuda")(unique_inverse_torch)


@unique_inverse.register_fake
def _(ids: Tensor, num_rows: int) -> Tuple[Tensor, Tensor]:
    return ids.new_empty(_dynamic_rows(), dtype=torch.int64), ids.new_empty(ids.shape[0], dtype=torch.int64)


@torch.library.custom_op("sparsecomm::pooled_request", mutates_args=(), device_types="cpu")
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
                              positions.data_ptr(), bag_counts.data_ptr(), _threads(n * 8))
    unique = torch.empty(lists.num_unique, dtype=torch.int64)
    bag_rows = torch.empty(lists.num_bags, dtype=torch.int64)
    lengths = torch.empty(lists.num_bags, dtype=torch.int32)
    lists.write(unique.data_ptr(), bag_rows.data_ptr(), lengths.data_ptr())
    return unique, unique_counts, order, occ_counts, positions, bag_rows, lengths, bag_counts


pooled_request.register_kernel("cuda")(pooled_request_torch)


@pooled_request.register_fake
def _(ids: Tensor, bag_of: Tensor, num_rows: int, num_owners: int, scheme: int, range_size: int, stride: int,
      num_bags: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    u, p, n = _dynamic_rows(), _dynamic_rows(), ids.shape[0]
    per_owner = [ids.new_empty(num_owners, dtype=torch.int64) for _ in range(3)]
    return (ids.new_empty(u, dtype=torch.int64), per_owner[0], ids.new_empty(n, dtype=torch.int64), per_owner[1],
            ids.new_empty(n, dtype=torch.int32), ids.new_empty(p, dtype=torch.int64),
            ids.new_empty(p, dtype=torch.int32), per_owner[2])


# -------------------------------------------------- packing a send buffer


@torch.library.custom_op("sparsecomm::pack_rows_", mutates_args=("buffer",), device_types="cpu")
def pack_rows_(buffer: Tensor, src: Tensor, index: Optional[Tensor], segments: List[int],
               wire_id_bytes: int) -> None:
    check_no_overlap(buffer, src, "src")
    seg = torch.tensor(segments, dtype=torch.int64)  # held until the kernel returns
    _C.pack_rows(src.data_ptr(), src.shape[0], _row_bytes(src) if src.dim() > 1 else src.element_size(),
                 0 if index is None else index.data_ptr(), INDEX_CODE[index.dtype] if index is not None else 1,
                 0 if index is None else index.shape[0], len(segments) // 3, seg.data_ptr() if segments else 0,
                 buffer.data_ptr(), buffer.numel(), wire_id_bytes, _threads(buffer.numel()))


@pack_rows_.register_kernel("cuda")
def _(buffer: Tensor, src: Tensor, index: Optional[Tensor], segments: List[int], wire_id_bytes: int) -> None:
    check_no_overlap(buffer, src, "src")
    if index is not None:
        _check_cuda_ids(index, src.shape[0], "index")
    for s in range(0, len(segments), 3):
        start, count, offset = segments[s:s + 3]
        rows = src[start:start + count] if index is None else src.index_select(0, index[start:start + count])
        if wire_id_bytes:
            dst = buffer[offset:offset + count * wire_id_bytes].view(_WIRE_ID_DTYPE[wire_id_bytes])
        else:
            dst = buffer[offset:offset + count * _row_bytes(src)].view(src.dtype).view(rows.shape)
        dst.copy_(rows)


@pack_rows_.register_fake
def _(buffer: Tensor, src: Tensor, index: Optional[Tensor], segments: List[int], wire_id_bytes: int) -> None:
    return None


# ------------------------------------------ coalescing out of a receive buffer


@torch.library.custom_op("sparsecomm::coalesce_segments", mutates_args=(), device_types="cpu")
def coalesce_segments(buffer: Tensor, segments: List[int], id_bytes: int, value_dtype: torch.dtype, d: int,
                      num_rows: int, out_ids_dtype: torch.dtype, out_acc: bool) -> Tuple[Tensor, Tensor]:
    nseg = len(segments) // 3
    seg = torch.tensor(segments, dtype=torch.int64).view(nseg, 3).t().contiguous()
    esz = torch.empty(0, dtype=value_dtype).element_size()
    plan = _C.coalesce_segments_plan(buffer.data_ptr(), buffer.numel(), nseg, seg[0].data_ptr(), seg[1].data_ptr(),
                                     seg[2].data_ptr(), id_bytes, d * esz, esz, num_rows,
                                     INDEX_CODE[out_ids_dtype], _threads(buffer.numel()))
    u = plan.num_unique
    out_ids = torch.empty(u, dtype=out_ids_dtype)
    out_values = torch.empty((u, d), dtype=acc_dtype(value_dtype) if out_acc else value_dtype)
    _C.coalesce_segments_apply(plan, VALUE_CODE[value_dtype], d, out_ids.data_ptr(), out_values.data_ptr(),
                               out_acc, _threads(out_values.numel() * out_values.element_size()))
    return out_ids, out_values


@coalesce_segments.register_kernel("cuda")
def _(buffer: Tensor, segments: List[int], id_bytes: int, value_dtype: torch.dtype, d: int, num_rows: int,
      out_ids_dtype: torch.dtype, out_acc: bool) -> Tuple[Tensor, Tensor]:
    esz = torch.empty(0, dtype=value_dtype).element_size()
    ids, rows = [], []
    for s in range(0, len(segments), 3):
        count, id_off, val_off = segments[s:s + 3]
        ids.append(buffer[id_off:id_off + count * id_bytes].view(_WIRE_ID_DTYPE[id_bytes]))
        rows.append(buffer[val_off:val_off + count * d * esz].view(value_dtype).view(count, d))
    ids = torch.cat(ids).to(out_ids_dtype) if ids else buffer.new_empty(0, dtype=out_ids_dtype)
    values = torch.cat(rows) if rows else buffer.new_empty((0, d), dtype=value_dtype)
    if out_acc:
        values = values.to(acc_dtype(value_dtype))
    _check_cuda_ids(ids, num_rows)
    return _cuda().coalesce_rows(ids, values)


@coalesce_segments.register_fake
def _(buffer: Tensor, segments: List[int], id_bytes: int, value_dtype: torch.dtype, d: int, num_rows: int,
      out_ids_dtype: torch.dtype, out_acc: bool) -> Tuple[Tensor, Tensor]:
    u = _dynamic_rows()
    return (buffer.new_empty(u, dtype=out_ids_dtype),
            buffer.new_empty((u, d), dtype=acc_dtype(value_dtype) if out_acc else value_dtype))
