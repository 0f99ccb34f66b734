"""The plan of one sparse synchronization and its metadata round: what every rank checks before any row moves.

:class:`SyncPlan` holds what a call decided (op, scheme, methods, node
layout, group); :func:`prepare` turns each input tensor into coalesced,
checked, partitioned rows (:class:`Rows`); :func:`exchange_meta` is the one
all-to-all in which every rank tells every rank its header, error code, row
count k and full push-count vector per tensor, so every rank validates the
same numbers (the trust model in docs/DESIGN.md) and raises together.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.dense import all_finite
from sparsecomm.collectives.exchange import all_to_all, wire_index_dtype
from sparsecomm.collectives.groups import comm_device, env_local_world_size
from sparsecomm.types import PartitionScheme, ReduceOp, SparseSyncStats, SyncMethod

__all__ = ["SyncPlan", "Rows", "Peers", "prepare", "exchange_meta", "meta_width", "meta_row", "check_peers",
           "unlinear", "ERR_OK", "ERR_RANGE"]

_MAGIC = 0x5C0DE
ERR_OK, ERR_RANGE, ERR_NONFINITE = 0, 1, 2
_HEADER = 17                                  # magic .. method: must be equal on every rank
_ERR_SLOT, _K_SLOT, _COUNTS_SLOT = 17, 18, 19  # then one push count per peer

# ------------------------------------------------------------------- the plan


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

    @staticmethod
    def build(tensors: Sequence[torch.Tensor], group, op, scheme, local_world_size, local_aggregation, methods,
              nonfinite, capacity: Optional[Sequence[int]] = None) -> "SyncPlan":
        op, scheme = ReduceOp(op), PartitionScheme(scheme)
        methods = [SyncMethod(m) for m in methods]
        if nonfinite not in ("raise", "propagate"):
            raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
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
        if SyncMethod.TORCH in methods and dist.get_backend(group) != "gloo":
            raise ValueError("method='torch' (the backend's sparse all_reduce) needs a gloo group")
        if capacity is not None:
            capacity = [int(c) for c in capacity]
            if len(capacity) != len(tensors) or min(capacity, default=0) < 0:
                raise ValueError(f"capacity: one non-negative row count per tensor, got {capacity}")
        device = devices.pop() if devices else torch.device("cpu")
        return SyncPlan(op, scheme.value, methods, local_world_size, local_aggregation, nonfinite, device,
                        group, n, dist.get_rank(group), capacity=capacity)

    def on(self, group: Optional[dist.ProcessGroup]) -> "SyncPlan":
        """This plan bound to the group it runs on (the caller's or its twin)."""
        return replace(self, group=group, world_size=dist.get_world_size(group), rank=dist.get_rank(group),
                       comm_device=comm_device(group, self.device))

    @property
    def capped(self) -> bool:
        """One collective for the whole call: capacities given and every tensor on the flat allgather path."""
        return self.capacity is not None and all(m is SyncMethod.ALLGATHER for m in self.methods)

    def hierarchical(self, method: SyncMethod) -> bool:
        """Does a tensor on ``method`` take the two-level path?"""
        return (method is SyncMethod.PARTITIONED and self.local_aggregation
                and 1 < self.local_world_size < self.world_size)

    @property
    def hierarchical_any(self) -> bool:
        return any(self.hierarchical(m) for m in self.methods)

    @property
    def peer_node(self) -> Optional[List[int]]:
        """Node of each rank (for inter-node byte counts), None on one node."""
        lws = self.local_world_size
        return [r // lws for r in range(self.world_size)] if lws > 1 else None

    def range_size(self, num_rows: int) -> int:
        return max(1, -(-num_rows // self.world_size))


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
class Rows:
    """One tensor's rows on their way through a call."""

    tensor: torch.Tensor
    method: SyncMethod
    hierarchical: bool
    stats: SparseSyncStats
    sparse_shape: Tuple[int, ...]
    num_rows: int
    wire_ids: torch.dtype
    ids: torch.Tensor
    values: torch.Tensor
    err: int = ERR_OK
    part: Optional[ops.Partition] = None

    @property
    def fused(self) -> bool:
        """Travels in the call's shared push all-to-all."""
        return not self.hierarchical and self.method in (SyncMethod.PARTITIONED, SyncMethod.ALLGATHER)

    @property
    def sum_dtype(self) -> torch.dtype:
        return torch.float32 if self.values.dtype in (torch.float16, torch.bfloat16) else self.values.dtype

    def value_shape(self) -> Tuple[int, ...]:
        return tuple(self.values.shape[1:])


def prepare(tensor: torch.Tensor, method: SyncMethod, plan: SyncPlan, stats: SparseSyncStats) -> Rows:
    """Linearize, check and coalesce one tensor's rows; partition them for a flat push."""
    sparse_shape = tuple(tensor.shape[: tensor.sparse_dim()])
    num_rows = math.prod(sparse_shape)
    indices, values = tensor._indices(), tensor._values().contiguous()
    rows = Rows(tensor, method, plan.hierarchical(method), stats, sparse_shape, num_rows,
                 wire_index_dtype(num_rows), _linear_ids(indices, sparse_shape), values)
    stats.world_size, stats.rows_in, stats.num_rows, stats.method = plan.world_size, indices.shape[1], num_rows, method.value
    stats.row_bytes = math.prod(values.shape[1:]) * values.element_size()
    stats.index_bytes = torch.empty(0, dtype=rows.wire_ids).element_size()
    stats.hierarchical = rows.hierarchical
    # Bad input is found locally but reported through the metadata exchange,
    # so every rank raises together instead of the others hanging.
    if len(sparse_shape) > 1 and not _indices_in_range(indices, sparse_shape):
        rows.err = ERR_RANGE
    else:
        try:
            # The kernel checks [0, num_rows) in its pass over the ids: no extra scan, no host sync.
            rows.ids, rows.values = ops.coalesce_rows(rows.ids, values, num_rows)
        except ValueError:
            rows.err = ERR_RANGE
    if rows.err == ERR_OK and plan.nonfinite == "raise" and not all_finite(rows.values):
        rows.err = ERR_NONFINITE
    if rows.err != ERR_OK:
        rows.ids, rows.values = rows.ids[:0], values[:0]
    stats.rows_local = rows.ids.shape[0]
    if rows.method is SyncMethod.PARTITIONED and not rows.hierarchical:
        # Ids, counts and perm only: the push packs the value rows through perm straight into the send
        # buffer (exchange.Gathered), so permuted rows are never written anywhere else.
        rows.part = ops.partition_rows(rows.ids, None, plan.world_size, plan.scheme, num_rows,
                                       range_size=plan.range_size(num_rows))
    return rows


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


# ----------------------------------------------------------------- metadata


def _header(rows: Rows, plan: SyncPlan) -> List[int]:
    shape = list(rows.tensor.shape)
    dims = (shape + [-1] * 8)[:8]
    digest = zlib.crc32(repr((shape, str(rows.tensor.dtype))).encode())
    return [_MAGIC, ops.VALUE_DTYPES.index(rows.tensor.dtype), len(shape), rows.tensor.sparse_dim(), digest, *dims,
            ["sum", "avg"].index(plan.op.value), ["hash", "range"].index(plan.scheme),
            plan.local_world_size if rows.hierarchical or rows.method is SyncMethod.TREE else 1,
            list(SyncMethod).index(rows.method)]


def _describe(row: Sequence[int]) -> str:
    dims = [d for d in row[5:13] if d >= 0][: row[2]]
    methods = list(SyncMethod)
    return (f"shape={tuple(dims)}, dtype={ops.VALUE_DTYPES[row[1]] if 0 <= row[1] < 4 else row[1]}, "
            f"sparse_dim={row[3]}, op={['sum', 'avg'][row[13] % 2]}, scheme={['hash', 'range'][row[14] % 2]}, "
            f"local_world_size={row[15]}, method={methods[row[16]].value if 0 <= row[16] < len(methods) else row[16]}")


@dataclass
class Peers:
    """What the metadata exchange taught about one tensor: every rank's k and push counts."""

    k: List[int]                 # rows each rank holds after coalescing
    push: List[List[int]]        # push[i][j]: rows rank i sends to owner j (flat partitioned)


def exchange_meta(tables: List[Rows], plan: SyncPlan) -> List[Peers]:
    """One all-to-all: each rank's header, error, k and full push-count vector per tensor, to every rank.

    Every rank receives the same numbers from a peer (its full count vector,
    not just the count meant for it), so every rank checks them the same way
    and raises together.
    """
    n, width = plan.world_size, meta_width(plan)
    send = torch.tensor(meta_row(tables, plan) * n, dtype=torch.int64, device=plan.comm_device).view(n, -1)
    recv = torch.empty_like(send)
    # all_to_all, not all_gather: on gloo a tiny all-gather costs several times
    # the latency of an all-to-all of the same bytes.
    all_to_all(recv, send, group=plan.group)
    got = recv.view(n, len(tables), width).tolist()
    for i, t in enumerate(tables):
        t.stats.bytes_sent += 8 * width * (n - 1)
        t.stats.bytes_recv += 8 * width * (n - 1)
    return [check_peers([got[r][i] for r in range(n)], t, plan) for i, t in enumerate(tables)]


def meta_width(plan: SyncPlan) -> int:
    """int64 per tensor in a rank's metadata: header, error, k, one push count per rank."""
    return _COUNTS_SLOT + plan.world_size


def meta_row(tables: List[Rows], plan: SyncPlan) -> List[int]:
    """This rank's metadata for every tensor of the call (one host sync for all push counts)."""
    n = plan.world_size
    counts = [t.part.counts for t in tables if t.part is not None]
    flat_counts = torch.stack(counts).tolist() if counts else []
    meta: List[int] = []
    it = iter(flat_counts)
    for t in tables:
        meta += _header(t, plan) + [t.err, t.ids.shape[0]] + (next(it) if t.part is not None else [0] * n)
    return meta


def check_peers(rows: List[List[int]], t: Rows, plan: SyncPlan) -> Peers:
    """Every rank runs this on the same numbers: the same verdict everywhere."""
    me, num_rows = plan.rank, t.num_rows
    for r, row in enumerate(rows):
        if row[0] != _MAGIC:
            raise ValueError(f"sparse_allreduce: rank {r} is not in a sparse_allreduce call "
                             f"(collective calls differ between ranks)")
    for r, row in enumerate(rows):
        if row[_ERR_SLOT] == ERR_RANGE:
            raise ValueError(f"sparse_allreduce: rank {r} passed row ids outside [0, {num_rows}); "
                             f"nothing was exchanged")
        if row[_ERR_SLOT] == ERR_NONFINITE:
            raise ValueError(f"sparse_allreduce: rank {r} passed NaN or Inf values (nonfinite='raise'); "
                             f"nothing was exchanged")
    mine = rows[me][:_HEADER]
    for r, row in enumerate(rows):
        if row[:_HEADER] != mine:
            raise ValueError(f"sparse_allreduce: ranks disagree on the tensor: rank {me} has {_describe(mine)} "
                             f"but rank {r} has {_describe(row)}")
    k = [row[_K_SLOT] for row in rows]
    push = [row[_COUNTS_SLOT:] for row in rows]
    for r in range(len(rows)):
        bad = not 0 <= k[r] <= num_rows or rows[r][_ERR_SLOT] != ERR_OK
        if t.part is not None:
            bad = bad or min(push[r]) < 0 or sum(push[r]) != k[r]
        if bad:
            raise ValueError(f"sparse_allreduce: rank {r} sent inconsistent row counts (k={k[r]}, per owner "
                             f"{push[r] if t.part is not None else '-'}, table of {num_rows} rows): a bug or a "
                             f"version mismatch between ranks; nothing was exchanged")
    return Peers(k, push)
