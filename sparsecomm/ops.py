"""Typed, validated row kernels: coalesce, partition by owner, gather, scatter-add.

The only module that imports the compiled kernels. CPU tensors run the C++
(OpenMP) kernels in ``sparsecomm._C``; CUDA tensors run the CUDA kernels in
``csrc/cuda`` through CuPy on torch's current stream (``sparsecomm._cuda``).

Every function checks its arguments and raises ``TypeError`` (wrong type or
dtype) or ``ValueError`` (shape, contiguity, device, out-of-range id) naming the
argument, before touching any output. Only CPU and CUDA tensors are accepted:
a ``meta`` (or any other) tensor has no memory a kernel could read. Values may be float32, float64, float16
or bfloat16 (fp16/bf16 accumulate in float32 and round once); ids int32 or
int64. Values are ``(n, *row_shape)``: each row is ``prod(row_shape)`` values.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple, Optional, Tuple

import torch

from sparsecomm import _C

__all__ = [
    "INDEX_DTYPES",
    "VALUE_DTYPES",
    "Partition",
    "coalesce_rows",
    "partition_rows",
    "row_owners",
    "gather_rows",
    "scatter_add_rows",
]

INDEX_DTYPES = (torch.int32, torch.int64)
VALUE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INDEX_CODE = {torch.int32: 0, torch.int64: 1}
_VALUE_CODE = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_SCHEMES = {"hash": 0, "range": 1}


class Partition(NamedTuple):
    """Rows grouped by owner: owner ``o`` holds ``ids[offsets[o]:offsets[o+1]]``.

    Attributes:
        counts: ``(num_owners,)`` int64, rows per owner.
        ids: the ids, permuted so each owner's rows are contiguous (owner order,
            input order inside an owner).
        values: the value rows permuted the same way, or None.
        perm: ``(n,)`` int64 with ``ids == input_ids[perm]``.
    """

    counts: torch.Tensor
    ids: torch.Tensor
    values: Optional[torch.Tensor]
    perm: torch.Tensor


# ---------------------------------------------------------------- validation


_KERNEL_DEVICES = ("cpu", "cuda")


def _check_device(t: torch.Tensor, name: str) -> None:
    # The kernels read and write raw pointers: a meta tensor's is null.
    if t.device.type not in _KERNEL_DEVICES:
        raise ValueError(f"{name} is on {t.device}: sparsecomm kernels take CPU or CUDA tensors")


def _check_ids(ids, name: str = "ids") -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    _check_device(ids, name)
    if ids.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if not ids.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_values(values, name: str, rows: Optional[int], device: torch.device) -> None:
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    _check_device(values, name)
    if values.dtype not in VALUE_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {values.dtype}")
    if values.dim() < 1:
        raise ValueError(f"{name} must have a leading row dimension, got a scalar")
    if rows is not None and values.shape[0] != rows:
        raise ValueError(f"{name} has {values.shape[0]} rows but ids has {rows}")
    if values.is_sparse or values.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor")
    if not values.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if values.device != device:
        raise ValueError(f"{name} is on {values.device} but ids is on {device}")


def _check_num_rows(num_rows) -> int:
    """``num_rows`` as the kernels take it: a bound >= 0, or -1 for "no upper bound" (None)."""
    if num_rows is None:
        return -1
    try:
        n = operator.index(num_rows)
    except TypeError:
        raise TypeError(f"num_rows must be an int or None, got {type(num_rows).__name__}") from None
    if n < 0:
        # The kernels read a negative bound as "none": it must never get there.
        raise ValueError(f"num_rows must be >= 0, got {n}")
    return n


def _byte_span(t: torch.Tensor) -> Tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_no_overlap(table: torch.Tensor, other: torch.Tensor, name: str) -> None:
    # Both are contiguous, so their bytes are exactly these spans.
    if table.numel() == 0 or other.numel() == 0:
        return
    (a0, a1), (b0, b1) = _byte_span(table), _byte_span(other)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{name} overlaps table's memory: the kernel would read what it is writing")


def _row_width(values: torch.Tensor) -> int:
    return math.prod(values.shape[1:])


def _threads() -> int:
    return torch.get_num_threads()


def _check_cuda_ids(ids: torch.Tensor, num_rows: Optional[int], name: str = "ids") -> None:
    # The CUDA kernels trust their ids; one reduction here keeps them in bounds.
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (num_rows is not None and hi >= num_rows):
        bad = lo if lo < 0 else hi
        bound = "inf" if num_rows is None else str(num_rows)
        raise ValueError(f"sparsecomm: {name} contains id {bad} outside [0, {bound})")


def _cuda():
    from sparsecomm import _cuda

    return _cuda


# ------------------------------------------------------------------- kernels


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
    _check_ids(ids)
    _check_values(values, "values", ids.shape[0], ids.device)
    bound = _check_num_rows(num_rows)
    if ids.is_cuda:
        _check_cuda_ids(ids, num_rows)
        out_ids, sums = _cuda().coalesce_rows(ids, values.reshape(ids.shape[0], _row_width(values)))
        return out_ids, sums.view((out_ids.shape[0], *values.shape[1:]))
    plan = _C.coalesce_plan(ids.data_ptr(), _INDEX_CODE[ids.dtype], ids.shape[0], bound, _threads())
    u = plan.num_unique
    out_ids = torch.empty(u, dtype=ids.dtype)
    out_values = torch.empty((u, *values.shape[1:]), dtype=values.dtype)
    _C.coalesce_apply(plan, values.data_ptr(), _VALUE_CODE[values.dtype], _row_width(values),
                      out_ids.data_ptr(), out_values.data_ptr(), _threads())
    return out_ids, out_values


def _owner_map(num_owners: int, scheme: str, num_rows: Optional[int], range_size: Optional[int], stride: int):
    if not isinstance(num_owners, int) or num_owners < 1:
        raise ValueError(f"num_owners must be a positive int, got {num_owners!r}")
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme must be 'hash' or 'range', got {scheme!r}")
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be a positive int, got {stride!r}")
    if scheme == "range":
        if range_size is None:
            if num_rows is None:
                raise ValueError("scheme='range' needs num_rows (or range_size)")
            range_size = max(1, -(-int(num_rows) // num_owners))
        if range_size < 1:
            raise ValueError(f"range_size must be >= 1, got {range_size}")
    return _SCHEMES[scheme], int(range_size or 1)


def partition_rows(ids: torch.Tensor, values: Optional[torch.Tensor], num_owners: int, scheme: str = "hash",
                   num_rows: Optional[int] = None, *, range_size: Optional[int] = None, stride: int = 1
                   ) -> Partition:
    """Group rows by their owner rank, stably.

    ``owner(id) = (bucket(id) // stride) % num_owners`` where ``bucket`` is a
    64-bit mix of the id (``scheme="hash"``: spreads Zipf-hot and consecutive
    ids evenly) or ``id // range_size`` (``scheme="range"``: contiguous blocks,
    ``range_size`` defaults to ``ceil(num_rows / num_owners)``). ``stride``
    lets a two-level exchange split the same buckets first across the ranks of
    a node and then across nodes.

    Args:
        ids: ``(n,)`` int32/int64 ids, non-negative (and ``< num_rows`` if given).
        values: ``(n, *row_shape)`` rows to move with the ids, or None.
        num_owners: number of owners (ranks).
        scheme: ``"hash"`` or ``"range"``.
        num_rows: table size; bounds the ids, and sizes the ranges.
        range_size: rows per range bucket (overrides the default above).
        stride: divides the bucket before the modulo.

    Returns:
        A :class:`Partition` (counts, ids, values, perm).

    Raises:
        TypeError, ValueError: as for :func:`coalesce_rows`, or a bad scheme/owner count.
    """
    _check_ids(ids)
    if values is not None:
        _check_values(values, "values", ids.shape[0], ids.device)
    bound = _check_num_rows(num_rows)
    scheme_code, range_size = _owner_map(num_owners, scheme, num_rows, range_size, stride)
    if ids.is_cuda:
        _check_cuda_ids(ids, num_rows)
        flat = None if values is None else values.reshape(ids.shape[0], _row_width(values))
        counts, out_ids, out_values, perm = _cuda().partition_rows(ids, flat, num_owners, scheme_code,
                                                                   range_size, stride)
        if out_values is not None:
            out_values = out_values.view(values.shape)
        return Partition(counts, out_ids, out_values, perm)
    n = ids.shape[0]
    counts = torch.empty(num_owners, dtype=torch.int64)
    out_ids = torch.empty_like(ids)
    perm = torch.empty(n, dtype=torch.int64)
    out_values = None if values is None else torch.empty_like(values)
    row_bytes = 0 if values is None else _row_width(values) * values.element_size()
    _C.partition_rows(ids.data_ptr(), _INDEX_CODE[ids.dtype], n, bound,
                      0 if values is None else values.data_ptr(), row_bytes, scheme_code, num_owners,
                      range_size, stride, counts.data_ptr(), out_ids.data_ptr(),
                      0 if out_values is None else out_values.data_ptr(), perm.data_ptr(), _threads())
    return Partition(counts, out_ids, out_values, perm)


def row_owners(ids: torch.Tensor, num_owners: int, scheme: str = "hash", num_rows: Optional[int] = None, *,
               range_size: Optional[int] = None, stride: int = 1) -> torch.Tensor:
    """Return the owner of each id under the same map as :func:`partition_rows`.

    Returns:
        ``(n,)`` int64 owners.
    """
    part = partition_rows(ids, None, num_owners, scheme, num_rows, range_size=range_size, stride=stride)
    owners = torch.repeat_interleave(torch.arange(num_owners, device=ids.device), part.counts)
    out = torch.empty_like(owners)
    out[part.perm] = owners
    return out


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
    _check_ids(ids)
    _check_values(table, "table", None, ids.device)
    num_rows = table.shape[0]
    if ids.is_cuda:
        _check_cuda_ids(ids, num_rows)
        flat = table.reshape(num_rows, _row_width(table))
        return _cuda().gather_rows(flat, ids).view((ids.shape[0], *table.shape[1:]))
    out = torch.empty((ids.shape[0], *table.shape[1:]), dtype=table.dtype)
    _C.gather_rows(table.data_ptr(), num_rows, _row_width(table) * table.element_size(), ids.data_ptr(),
                   _INDEX_CODE[ids.dtype], ids.shape[0], out.data_ptr(), _threads())
    return out


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
    _check_ids(ids)
    _check_values(table, "table", None, ids.device)
    _check_values(values, "values", ids.shape[0], ids.device)
    if values.dtype != table.dtype:
        raise TypeError(f"values dtype {values.dtype} differs from table dtype {table.dtype}")
    if values.shape[1:] != table.shape[1:]:
        raise ValueError(f"values rows have shape {tuple(values.shape[1:])} but table rows have "
                         f"{tuple(table.shape[1:])}")
    _check_no_overlap(table, values, "values")
    _check_no_overlap(table, ids, "ids")
    base = table._base if table._base is not None else table  # a no_grad view of a leaf counts as the leaf
    if torch.is_grad_enabled() and (table.requires_grad or base.requires_grad or values.requires_grad):
        which = "values" if values.requires_grad and not (table.requires_grad or base.requires_grad) else "table"
        raise RuntimeError(f"scatter_add_rows is not differentiable but {which} requires grad: a leaf that "
                           f"requires grad cannot be updated in place, and a gradient through the update would "
                           f"be wrong; call it under torch.no_grad()")
    num_rows = table.shape[0]
    if ids.is_cuda:
        _check_cuda_ids(ids, num_rows)
        width = _row_width(table)
        _cuda().scatter_add_rows(table.view(num_rows, width), ids, values.reshape(ids.shape[0], width))
    else:
        _C.scatter_add_rows(table.data_ptr(), num_rows, _VALUE_CODE[table.dtype], _row_width(table),
                            ids.data_ptr(), _INDEX_CODE[ids.dtype], ids.shape[0], values.data_ptr(), _threads())
    # Written through a raw pointer: tell autograd, as an in-place op would.
    torch.autograd.graph.increment_version(table)
    return table
