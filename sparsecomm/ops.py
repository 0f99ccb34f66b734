"""Typed, validated row kernels: coalesce, partition by owner, gather, scatter-add, packing.

The public face of the operators registered in :mod:`sparsecomm._library`
(``torch.ops.sparsecomm.*``): these functions validate, then call the op, and
PyTorch's dispatcher runs the C++ (OpenMP) kernel for CPU tensors or the CUDA
kernel (CuPy, torch's current stream) for CUDA tensors. Both work under
``torch.compile(fullgraph=True)``: the ops have fake implementations.

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
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from sparsecomm import _library, ownership

__all__ = [
    "INDEX_DTYPES",
    "VALUE_DTYPES",
    "Partition",
    "coalesce_rows",
    "partition_rows",
    "row_owners",
    "gather_rows",
    "scatter_add_rows",
    "coalesce_partition_rows",
    "pack_rows",
    "coalesce_segments",
    "rowwise_adagrad_",
    "PooledPlan",
    "empty_rows",
    "group_by",
    "bag_groups",
    "unique_inverse",
    "pooled_request",
]

INDEX_DTYPES = (torch.int32, torch.int64)
VALUE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)



_MUTATES = {"scatter_add_": (0,), "pack_rows_": (0,), "rowwise_adagrad_": (0, 1)}  # op -> the arguments it writes


def _run(name: str, *args):
    """Run registered op ``name``: straight into its CPU kernel when nothing needs the dispatcher.

    The dispatcher's Python layers cost ~30 us a call here (the kernel itself
    takes a few us on the small inputs a training step passes many times), so
    plain CPU tensors outside ``torch.compile`` and outside autograd call the
    kernel directly; compiling, autograd, CUDA, fake or other tensors go
    through ``torch.ops.sparsecomm.<name>``. An op that writes a tensor bumps
    its version counter either way, as torch's in-place ops do.
    """
    if not torch.compiler.is_compiling():
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        grad = torch.is_grad_enabled()
        if all(type(t) is torch.Tensor and t.device.type == "cpu" and not (grad and t.requires_grad)
               for t in tensors):
            out = getattr(_library, name)._init_fn(*args)
            for i in _MUTATES.get(name, ()):
                torch.autograd.graph.increment_version(args[i])
            return out
    return getattr(torch.ops.sparsecomm, name)(*args)

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


def _check_size(value, name: str) -> int:
    """``value`` as an int >= 0 (TypeError / ValueError naming ``name`` otherwise)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def _check_num_rows(num_rows) -> int:
    """``num_rows`` as the kernels take it: a bound >= 0, or -1 for "no upper bound" (None)."""
    # The kernels read a negative bound as "none": a negative one must never get there.
    return -1 if num_rows is None else _check_size(num_rows, "num_rows")


def _row_width(values: torch.Tensor) -> int:
    return math.prod(values.shape[1:])


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
    out_ids, sums = _run("coalesce", ids, values.reshape(ids.shape[0], _row_width(values)), bound)
    return out_ids, sums.view((out_ids.shape[0], *values.shape[1:]))


def _owner_map(num_owners: int, scheme: str, num_rows: Optional[int], range_size: Optional[int],
               stride: int) -> Tuple[int, int]:
    """``(scheme code, range_size)`` of the owner map these arguments name (ValueError otherwise)."""
    owners = ownership.OwnerMap.of(num_owners, scheme, num_rows, range_size, stride)
    return owners.scheme, owners.range_size


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
    flat = None if values is None else values.reshape(ids.shape[0], _row_width(values))
    counts, out_ids, out_values, perm = _run("partition", ids, flat, bound, num_owners, scheme_code,
                                                                       range_size, stride)
    return Partition(counts, out_ids, None if values is None else out_values.view(values.shape), perm)


def coalesce_partition_rows(ids: torch.Tensor, values: torch.Tensor, num_owners: int, scheme: str = "hash",
                            num_rows: Optional[int] = None, *, range_size: Optional[int] = None, stride: int = 1
                            ) -> Partition:
    """Coalesce rows and group the sums by owner, in one pass over the values.

    The same result as ``partition_rows(*coalesce_rows(ids, values, num_rows),
    num_owners, ...)`` (bitwise), without writing the sums twice: each sum is
    written once, straight to its owner's place.

    Args:
        ids, values, num_rows: as for :func:`coalesce_rows`.
        num_owners, scheme, range_size, stride: the owner map of :func:`partition_rows`.

    Returns:
        A :class:`Partition` whose ``ids`` are unique (ascending inside each
        owner), ``values`` their sums, and ``perm`` None.

    Raises:
        TypeError, ValueError: as for :func:`coalesce_rows` and :func:`partition_rows`.
    """
    _check_ids(ids)
    _check_values(values, "values", ids.shape[0], ids.device)
    bound = _check_num_rows(num_rows)
    scheme_code, range_size = _owner_map(num_owners, scheme, num_rows, range_size, stride)
    counts, out_ids, sums = _run("coalesce_partition",
        ids, values.reshape(ids.shape[0], _row_width(values)), bound, num_owners, scheme_code, range_size, stride)
    return Partition(counts, out_ids, sums.view((out_ids.shape[0], *values.shape[1:])), None)


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
    flat = table.reshape(table.shape[0], _row_width(table))
    return _run("gather", flat, ids).view((ids.shape[0], *table.shape[1:]))


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
    # a no_grad view of a leaf counts as the leaf
    base = table if torch.compiler.is_compiling() or table._base is None else table._base
    if torch.is_grad_enabled() and (table.requires_grad or base.requires_grad or values.requires_grad):
        which = "values" if values.requires_grad and not (table.requires_grad or base.requires_grad) else "table"
        raise RuntimeError(f"scatter_add_rows is not differentiable but {which} requires grad: a leaf that "
                           f"requires grad cannot be updated in place, and a gradient through the update would "
                           f"be wrong; call it under torch.no_grad()")
    width = _row_width(table)
    # The op declares that it writes `table`: the dispatcher bumps its version as for any in-place op.
    _run("scatter_add_", table.view(table.shape[0], width), ids, values.reshape(ids.shape[0], width))
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
    _check_ids(slots, "slots")
    _check_values(weight, "weight", None, slots.device)
    if weight.dtype not in (torch.float32, torch.float64) or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-D float32/float64 tensor, got {weight.dtype} {tuple(weight.shape)}")
    _check_values(acc, "acc", weight.shape[0], slots.device)
    _check_values(grad, "grad", slots.shape[0], slots.device)
    if slots.dtype != torch.int64:
        raise TypeError(f"slots must be int64, got {slots.dtype}")
    if acc.dtype != weight.dtype or grad.dtype != weight.dtype:
        raise TypeError(f"acc ({acc.dtype}) and grad ({grad.dtype}) must have weight's dtype {weight.dtype}")
    if acc.dim() != 1 or grad.dim() != 2 or grad.shape[1] != weight.shape[1]:
        raise ValueError(f"acc must be (V,) and grad (k, {weight.shape[1]}), got {tuple(acc.shape)} and "
                         f"{tuple(grad.shape)}")
    if slots.device.type == "cuda" and slots.numel() > 1 and not bool((slots[1:] > slots[:-1]).all()):
        raise ValueError("slots must be strictly increasing (coalesced)")
    _run("rowwise_adagrad_", weight, acc, slots, grad, float(lr), float(eps))


# ------------------------------------------- owner pooling's index kernels


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


def _check_int64_ids(ids, name: str) -> None:
    _check_ids(ids, name)
    if ids.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {ids.dtype}")


def empty_rows(shape: Tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.empty`` for a table read and updated at random rows (a shard, its optimizer state): on the
    CPU backed by transparent huge pages where the OS allows it (:func:`sparsecomm._library.empty_rows`)."""
    return _library.empty_rows(tuple(shape), dtype, device)


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
    _check_int64_ids(index, "index")
    return _run("group_by", index, _check_size(size, "size"))


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
    _check_int64_ids(key, "key")
    _check_int64_ids(positions, "positions")
    _check_int64_ids(lengths, "lengths")
    for t, name in ((positions, "positions"), (lengths, "lengths")):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device} but key is on {key.device}")
    return _run("bag_groups", key, positions, lengths, _check_size(size, "size"))


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
    _check_int64_ids(ids, "ids")
    return _run("unique_inverse", ids, _check_num_rows(num_rows))


def pooled_request(ids: torch.Tensor, bag_of: torch.Tensor, num_owners: int, scheme: str = "hash",
                   num_rows: Optional[int] = None, range_size: Optional[int] = None, *,
                   num_bags: Optional[int] = None, stride: int = 1) -> PooledPlan:
    """The requester side of owner pooling, in one kernel call: what each owner gets for a bag lookup.

    Owners are those of :func:`partition_rows` (same ``num_owners``, ``scheme``, ``num_rows``,
    ``range_size``, ``stride``). Exactly what these torch ops give (``n = num_owners``)::

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
        num_owners, scheme, num_rows, range_size, stride: the owner map of :func:`partition_rows`.
        num_bags: bound on ``bag_of`` (None: only non-negative).

    Returns:
        A :class:`PooledPlan`.

    Raises:
        TypeError, ValueError: bad types, shapes or owner map; an id or bag out of range, or ``bag_of``
            decreasing (named; nothing is written).
    """
    _check_int64_ids(ids, "ids")
    _check_int64_ids(bag_of, "bag_of")
    if bag_of.shape[0] != ids.shape[0]:
        raise ValueError(f"bag_of has {bag_of.shape[0]} entries but ids has {ids.shape[0]}")
    if bag_of.device != ids.device:
        raise ValueError(f"bag_of is on {bag_of.device} but ids is on {ids.device}")
    bound = _check_num_rows(num_rows)
    bags = -1 if num_bags is None else _check_size(num_bags, "num_bags")
    scheme_code, range_size = _owner_map(num_owners, scheme, num_rows, range_size, stride)
    return PooledPlan(*_run("pooled_request", ids, bag_of, bound, num_owners, scheme_code, range_size, stride, bags))


# ------------------------------------------------------ wire buffers (fused)


def _check_buffer(buffer, name: str) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buffer).__name__}")
    _check_device(buffer, name)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")


def _wire_id_bytes(dtype: torch.dtype, name: str) -> int:
    sizes = {torch.int16: 2, torch.int32: 4, torch.int64: 8}
    if dtype not in sizes:
        raise TypeError(f"{name} must be int16, int32 or int64, got {dtype}")
    return sizes[dtype]


def pack_rows(buffer: torch.Tensor, src: torch.Tensor, index: Optional[torch.Tensor],
              segments: Sequence[Tuple[int, int, int]], wire_ids: Optional[torch.dtype] = None) -> None:
    """Copy rows of ``src`` straight into their places in a byte buffer (one copy, no staging).

    Segment ``(start, count, offset)`` copies rows ``index[start:start+count]``
    of ``src`` (rows ``start:start+count`` when ``index`` is None) back to back
    to ``buffer[offset:]``. This is how a send buffer is packed: a partition's
    ``perm`` as ``index`` and one segment per peer packs partitioned rows
    without materializing them first.

    Args:
        buffer: 1-D uint8 destination, same device as ``src``.
        src: ``(n, *row_shape)`` rows of any dtype, or ``(n,)`` int32/int64 ids
            when ``wire_ids`` is given.
        index: optional ``(m,)`` int32/int64 rows of ``src`` in ``[0, n)``.
        segments: ``(start, count, byte_offset)`` triples.
        wire_ids: write ids as this dtype (int16/int32/int64); each must fit.

    Raises:
        TypeError, ValueError: bad arguments, an index or id out of range, or a
            segment outside ``src``/``index`` or ``buffer`` (nothing is written).
    """
    _check_buffer(buffer, "buffer")
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
    _check_device(src, "src")
    if src.device != buffer.device:
        raise ValueError(f"src is on {src.device} but buffer is on {buffer.device}")
    if not src.is_contiguous() or src.dim() < 1:
        raise ValueError("src must be contiguous with a leading row dimension")
    if index is not None:
        _check_ids(index, "index")
        if index.device != buffer.device:
            raise ValueError(f"index is on {index.device} but buffer is on {buffer.device}")
    wire = 0
    if wire_ids is not None:
        if src.dtype not in INDEX_DTYPES or src.dim() != 1:
            raise TypeError(f"with wire_ids, src must be 1-D int32/int64 ids, got {src.dtype} {tuple(src.shape)}")
        wire = _wire_id_bytes(wire_ids, "wire_ids")
    flat = [int(v) for seg in segments for v in seg]
    if len(flat) != 3 * len(segments):
        raise ValueError("segments must be (start, count, byte_offset) triples")
    rows = src if src.dim() == 1 else src.reshape(src.shape[0], _row_width(src))
    _run("pack_rows_", buffer, rows, index, flat, wire)


def coalesce_segments(buffer: torch.Tensor, segments: Sequence[Tuple[int, int, int]], wire_ids: torch.dtype,
                      value_dtype: torch.dtype, row_shape: Sequence[int], num_rows: Optional[int] = None, *,
                      ids_dtype: torch.dtype = torch.int64, accumulate_dtype: bool = False
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Coalesce rows straight out of a byte buffer holding several segments (a receive buffer).

    Segment ``(count, id_offset, value_offset)`` holds ``count`` ids of
    ``wire_ids`` at byte ``id_offset`` and their value rows at byte
    ``value_offset``. The result is :func:`coalesce_rows` of all segments'
    rows concatenated in order (summed in that order, so deterministic),
    without first copying them out of the buffer.

    Args:
        buffer: 1-D uint8 tensor; every segment must lie inside it, aligned to
            its element size.
        segments: ``(count, id_byte_offset, value_byte_offset)`` triples.
        wire_ids: dtype of the ids in the buffer: int16, int32 or int64.
        value_dtype: dtype of the value rows (one of :data:`VALUE_DTYPES`).
        row_shape: shape of one value row.
        num_rows: ids must lie in ``[0, num_rows)`` (checked: they came from peers).
        ids_dtype: dtype of the returned ids (int32 or int64).
        accumulate_dtype: return the sums in float32 for fp16/bf16 rows (not
            rounded), for a caller that divides before rounding.

    Returns:
        ``(unique_ids, sums)`` as for :func:`coalesce_rows`.

    Raises:
        TypeError, ValueError: bad arguments, a segment outside the buffer or
            misaligned, or an id out of range.
    """
    _check_buffer(buffer, "buffer")
    id_bytes = _wire_id_bytes(wire_ids, "wire_ids")
    if value_dtype not in VALUE_DTYPES:
        raise TypeError(f"value_dtype must be float32, float64, float16 or bfloat16, got {value_dtype}")
    if ids_dtype not in INDEX_DTYPES:
        raise TypeError(f"ids_dtype must be int32 or int64, got {ids_dtype}")
    bound = _check_num_rows(num_rows)
    flat = [int(v) for seg in segments for v in seg]
    if len(flat) != 3 * len(segments):
        raise ValueError("segments must be (count, id_byte_offset, value_byte_offset) triples")
    d = math.prod(row_shape)
    ids, sums = _run("coalesce_segments", buffer, flat, id_bytes, value_dtype, d, bound, ids_dtype,
                                                       bool(accumulate_dtype))
    return ids, sums.view((ids.shape[0], *row_shape))
