"""The plan of one sparse synchronization, and each tensor's rows on their way through it.

:class:`SyncPlan` holds what a call decided (op, scheme, methods, node
layout, group); :func:`prepare` turns each input tensor into coalesced,
checked rows (:class:`TensorRows`), partitioned by owner when its path pushes
to owners; :class:`Peers` is what the metadata round
(:mod:`sparsecomm.collectives.sync_wire`) taught about every rank's rows.
A problem found here is recorded in the rows' status, not raised: it travels
in the metadata so that every rank raises together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.dense import all_finite
from sparsecomm.collectives.groups import comm_device
from sparsecomm.collectives.launchers import env_local_world_size
from sparsecomm.collectives.transport import wire_index_dtype
from sparsecomm.ownership import range_size, scheme_of
from sparsecomm.types import PartitionScheme, ReduceOp, SparseSyncStats, SyncMethod, WireStatus

__all__ = ["SyncOptions", "SyncPlan", "TensorRows", "Peers", "prepare", "unlinear", "WIRE_DTYPES"]

# compression= -> the values' dtype on the wire.
WIRE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}

# ------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class SyncOptions:
    """What the caller asked of one call (``sparse_allreduce_coalesced``'s options), before validation.

    ``compression``: None (the tensors' dtype on the wire: exact) or
    ``"bf16"`` / ``"fp16"``: value rows travel in that dtype on the paths
    that sum at an owner or a merge (``SyncPath.compresses``), summed in
    float32 there and rounded once to it again for the way back. A sequence
    gives one per tensor (e.g. a dense bucket kept exact beside compressed
    embedding gradients).
    """

    op: object = "sum"
    scheme: object = "hash"
    local_world_size: Optional[int] = None
    local_aggregation: bool = True
    methods: Sequence[object] = ()
    nonfinite: str = "raise"
    capacity: Optional[Sequence[int]] = None
    compression: Union[Optional[str], Sequence[Optional[str]]] = None


@dataclass
class SyncPlan:
    """What one call does, decided once before any byte moves (every rank decides the same)."""

    op: ReduceOp
    scheme: str
    methods: List[SyncMethod]
    local_world_size: int
    local_aggregation: bool
    nonfinite: str
    device: torch.device
    group: Optional[dist.ProcessGroup] = None
    world_size: int = 1
    rank: int = 0
    comm_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    capacity: Optional[List[int]] = None  # rows reserved per rank and tensor: one-collective allgather
    wire_dtypes: Optional[List[Optional[torch.dtype]]] = None  # per tensor: values' dtype on the wire (None: own)

    @staticmethod
    def build(tensors: Sequence[torch.Tensor], group, options: SyncOptions) -> "SyncPlan":
        op, scheme = ReduceOp(options.op), scheme_of(options.scheme)
        if scheme is PartitionScheme.TABLE:
            raise ValueError("scheme='table' places a sharded table on one rank; a sparse allreduce owns rows by "
                             "'hash' or 'range'")
        methods = [SyncMethod(m) for m in options.methods]
        nonfinite, capacity = options.nonfinite, options.capacity
        local_world_size, local_aggregation = options.local_world_size, options.local_aggregation
        if nonfinite not in ("raise", "propagate"):
            raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
        compression = options.compression
        compression = list(compression) if isinstance(compression, (list, tuple)) else [compression] * len(tensors)
        if len(compression) != len(tensors) or any(c not in WIRE_DTYPES for c in compression):
            raise ValueError(f"compression must be 'bf16', 'fp16' or None, or one of those per tensor, "
                             f"got {options.compression!r} for {len(tensors)} tensors")
        for t in tensors:
            _check_tensor(t)
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"sparse_allreduce_coalesced: all tensors must be on one device, got {sorted(map(str, devices))}")
        if local_world_size is None:
            is_world = group is None or group is dist.GroupMember.WORLD
            local_world_size = (env_local_world_size() or 1) if is_world else 1
        n = dist.get_world_size(group)
        if local_world_size < 1 or n % local_world_size:
            local_world_size = 1  # uneven nodes: flat exchange is always correct
        if capacity is not None:
            capacity = [int(c) for c in capacity]
            if len(capacity) != len(tensors) or min(capacity, default=0) < 0:
                raise ValueError(f"capacity: one non-negative row count per tensor, got {capacity}")
        device = devices.pop() if devices else torch.device("cpu")
        return SyncPlan(op, scheme.value, methods, local_world_size, local_aggregation, nonfinite, device,
                        group, n, dist.get_rank(group), capacity=capacity,
                        wire_dtypes=[WIRE_DTYPES[c] for c in compression])

    def on(self, group: Optional[dist.ProcessGroup]) -> "SyncPlan":
        """This plan bound to the group it runs on (the caller's or its twin)."""
        return replace(self, group=group, world_size=dist.get_world_size(group), rank=dist.get_rank(group),
                       comm_device=comm_device(group, self.device))

    @property
    def aggregates_in_nodes(self) -> bool:
        """Paths with a hierarchical variant take it: several ranks per node, local aggregation on."""
        return self.local_aggregation and 1 < self.local_world_size < self.world_size

    @property
    def peer_node(self) -> Optional[List[int]]:
        """Node of each rank (for inter-node byte counts), None on one node."""
        lws = self.local_world_size
        return [r // lws for r in range(self.world_size)] if lws > 1 else None

    def range_size(self, num_rows: int) -> int:
        return range_size(num_rows, self.world_size)


def _check_tensor(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"sparse_allreduce expects a sparse COO tensor, got "
                        f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    if tensor.dtype not in ops.VALUE_DTYPES:
        raise TypeError(f"sparse_allreduce supports float32/float64/float16/bfloat16 values, got {tensor.dtype}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"sparse_allreduce supports CPU and CUDA tensors, got a {tensor.device.type} tensor")


# ------------------------------------------------------------ one tensor's rows


@dataclass
class TensorRows:
    """One tensor's rows on their way through a call.

    ``path`` is the tensor's :class:`~sparsecomm.collectives.methods.base.SyncPath`
    (its method, flat or hierarchical); ``status`` what this rank found wrong
    with its own rows (reported in the metadata, never raised alone).
    """

    tensor: torch.Tensor
    path: Any
    stats: SparseSyncStats
    sparse_shape: Tuple[int, ...]
    num_rows: int
    wire_ids: torch.dtype
    ids: torch.Tensor
    values: torch.Tensor
    status: WireStatus = WireStatus.OK
    part: Optional[ops.Partition] = None
    input_rows: int = 0                          # n: rows of the input (ids before coalescing)
    runs_count: Union[int, torch.Tensor] = 0     # m: runs of equal consecutive input rows (a tensor until sent)
    distinct: Optional[int] = None               # k when ``ids`` are not coalesced (the runs path)
    run_lengths: Optional[torch.Tensor] = None   # the runs path: ids per run (``values`` holds one row per run)

    @property
    def rows_k(self) -> int:
        """k: this rank's distinct rows."""
        return self.ids.shape[0] if self.distinct is None else self.distinct

    @property
    def method(self) -> SyncMethod:
        return self.path.method

    @property
    def hierarchical(self) -> bool:
        return self.path.hierarchical

    @property
    def fused(self) -> bool:
        """Travels in the call's shared push all-to-all."""
        return self.path.fused

    @property
    def sum_dtype(self) -> torch.dtype:
        return torch.float32 if self.values.dtype in (torch.float16, torch.bfloat16) else self.values.dtype

    def value_shape(self) -> Tuple[int, ...]:
        return tuple(self.values.shape[1:])


@dataclass
class Peers:
    """What the metadata exchange taught about one tensor: every rank's k and push counts."""

    k: List[int]                 # rows each rank holds after coalescing
    push: List[List[int]]        # push[i][j]: rows rank i sends to owner j (flat partitioned)
    ids: List[int] = field(default_factory=list)   # input rows of each rank (n)
    runs: List[int] = field(default_factory=list)  # runs of equal consecutive input rows of each rank (m)


def prepare(tensor: torch.Tensor, path: Any, plan: SyncPlan, stats: SparseSyncStats,
            wire_dtype: Optional[torch.dtype] = None) -> TensorRows:
    """Linearize, check and coalesce one tensor's rows; partition them by owner when ``path`` pushes to owners.

    ``wire_dtype``: the values' dtype on the wire when ``path`` compresses (None: their own).
    """
    sparse_shape = tuple(tensor.shape[: tensor.sparse_dim()])
    num_rows = math.prod(sparse_shape)
    indices, values = tensor._indices(), tensor._values().contiguous()
    rows = TensorRows(tensor, path, stats, sparse_shape, num_rows, wire_index_dtype(num_rows),
                      _linear_ids(indices, sparse_shape), values)
    stats.world_size, stats.rows_in, stats.num_rows = plan.world_size, indices.shape[1], num_rows
    stats.method = path.method.value
    stats.row_bytes = math.prod(values.shape[1:]) * values.element_size()
    stats.index_bytes = rows.wire_ids.itemsize
    stats.hierarchical = rows.hierarchical
    rows.input_rows = indices.shape[1]
    # Bad input is found locally but reported through the metadata exchange,
    # so every rank raises together instead of the others hanging.
    if (len(sparse_shape) > 1 or path.runs) and not _indices_in_range(indices, sparse_shape):
        rows.status = WireStatus.ID_RANGE
    elif path.runs:  # one row per run of equal rows, its ids as they are (methods/runs.py)
        rows.values, rows.run_lengths = _runs(values)
        rows.runs_count, rows.distinct = rows.run_lengths.shape[0], int(torch.unique(rows.ids).numel())
    else:
        rows.runs_count = _first_value_runs(values)  # to price the runs path; read with the metadata
        try:
            # The kernel checks [0, num_rows) in its pass over the ids: no extra scan, no host sync.
            rows.ids, rows.values = ops.coalesce_rows(rows.ids, values, num_rows)
        except ValueError:
            rows.status = WireStatus.ID_RANGE
    if rows.status == WireStatus.OK and plan.nonfinite == "raise" and not all_finite(rows.values):
        rows.status = WireStatus.NONFINITE
    if rows.status != WireStatus.OK:
        rows.ids, rows.values = rows.ids[:0], values[:0]
        rows.input_rows, rows.runs_count, rows.distinct = 0, 0, None
        rows.run_lengths = None if rows.run_lengths is None else rows.run_lengths[:0]
    if wire_dtype is not None and path.compresses and rows.values.dtype != wire_dtype:
        # Rounded once here; the owners (or merges) sum in float32 and round once more for the way back.
        rows.values = rows.values.to(wire_dtype)
    stats.rows_local = rows.rows_k
    if path.partitions:
        # Ids, counts and perm only: the push packs the value rows through perm straight into the send
        # buffer (exchange.Gathered), so permuted rows are never written anywhere else.
        rows.part = ops.partition_rows(rows.ids, None, plan.world_size, plan.scheme, num_rows,
                                       range_size=plan.range_size(num_rows))
    return rows


def _row_words(values: torch.Tensor) -> torch.Tensor:
    """``(n, w)`` integer words holding each row's bytes (the widest integer dtype that divides a row and
    the storage offset; zero-width rows give ``(n, 0)``)."""
    flat = values.reshape(values.shape[0], math.prod(values.shape[1:])).contiguous()
    nbytes, offset = flat.shape[1] * flat.element_size(), flat.storage_offset() * flat.element_size()
    if nbytes == 0:
        return torch.empty((flat.shape[0], 0), dtype=torch.uint8, device=flat.device)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0 and offset % dtype.itemsize == 0 and dtype.itemsize >= flat.element_size():
            return flat.view(dtype)
    return flat.view(torch.uint8)


def _runs(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One row per run of bitwise-equal consecutive rows, and each run's length (int32).

    Bitwise, not ``==``: -0.0 and 0.0, or two NaNs, stay apart, so expanding the runs gives back the rows.
    """
    n = values.shape[0]
    starts = torch.ones(n, dtype=torch.bool, device=values.device)
    if n > 1:
        words = _row_words(values)
        # Which words differ, their flags packed 8/4/2 to an integer so the row reduction reads fewer elements.
        differ = torch.ne(words[1:], words[:-1])
        starts[1:] = _row_words(differ.view(torch.uint8)).any(1)
    first = starts.nonzero().view(-1)
    ends = torch.cat([first[1:], first.new_tensor([n])])
    return values.index_select(0, first), (ends - first).to(torch.int32)


def _first_value_runs(values: torch.Tensor) -> Union[int, torch.Tensor]:
    """Runs of consecutive rows whose first values are bitwise equal: at most the runs, cheap to count.

    A 0-dim tensor where there is something to count, read with the metadata's one host sync
    (``sync_wire.message``), so a CUDA call does not wait here.
    """
    n = values.shape[0]
    if n < 2 or values[0].numel() == 0:
        return min(n, 1)
    first = _row_words(values.reshape(n, -1)[:, :1].contiguous())[:, 0]
    return torch.ne(first[1:], first[:-1]).sum() + 1


def _indices_in_range(indices: torch.Tensor, sparse_shape: Sequence[int]) -> bool:
    # Per dimension: with several sparse dims an index past one dim's size
    # would otherwise linearize into a valid id of another row.
    if indices.numel() == 0:
        return True
    lo, hi = indices.amin(1).tolist(), indices.amax(1).tolist()
    return all(0 <= a and b < size for a, b, size in zip(lo, hi, sparse_shape))


def _linear_ids(indices: torch.Tensor, sparse_shape: Sequence[int]) -> torch.Tensor:
    # One id per row of the sparse dims (row-major), so >1 sparse dim works too.
    if len(sparse_shape) == 1:
        return indices[0]
    ids = indices[0].clone()
    for dim in range(1, len(sparse_shape)):
        ids.mul_(sparse_shape[dim]).add_(indices[dim])
    return ids


def unlinear(ids: torch.Tensor, sparse_shape: Sequence[int]) -> torch.Tensor:
    if len(sparse_shape) == 1:
        return ids.view(1, -1)
    rows = []
    rest = ids
    for size in reversed(sparse_shape[1:]):
        rows.append(rest % size)
        rest = rest // size
    rows.append(rest)
    return torch.stack(rows[::-1])
