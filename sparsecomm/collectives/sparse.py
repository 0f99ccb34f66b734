"""Sparse allreduce over a partitioned parameter-server path, for one tensor or many at once.

Per call (docs/DESIGN.md): coalesce locally -> one metadata all-to-all that
every rank checks (shapes, ids, counts) -> push ids and rows to their owners
(one all-to-all for every tensor of the call) -> owners sum what they
received -> owners share the summed rows with every rank (one count exchange,
one all-to-all) -> assemble coalesced COO tensors. Per rank this moves about
(N-1)/N (k + U) rows instead of the (N-1) k rows of an allgather, and never
allocates anything the size of the table.

:func:`sparse_allreduce_coalesced` synchronizes several tensors (say every
embedding table of a model) in those same four collectives: at 2-4 ranks a
collective costs 0.5-3 ms, so their number, not the bytes, decides the time.
Tensors on the allgather path ride in the same push all-to-all (two
collectives in all when no tensor takes the partitioned path).

With several ranks per node (``local_world_size``), the push and the share are
done in two levels (Parallax's local aggregation): rows are first summed
inside the node, then exchanged between nodes by the rank of each node that
owns them, so each row crosses between nodes once per node.

Trust model: ranks of one job run the same code, but what a peer sends is
still checked before it sizes a buffer or indexes a tensor (counts
non-negative, consistent with the sender's stated total and the table; ids in
range), and every rank reaches the same verdict from the same numbers, so a
bad peer makes every rank raise ``ValueError`` instead of writing out of bounds.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.exchange import (allgather_rows, count_bytes, exchange_tables, kernel_ids,
                                             push_to_owners, wire_index_dtype)
from sparsecomm.collectives.dense import all_finite
from sparsecomm.collectives.groups import comm_device, env_local_world_size, node_groups, run_async, twin_group
from sparsecomm.types import PartitionScheme, ReduceOp, SparseSyncStats, SyncMethod

__all__ = ["sparse_allreduce", "sparse_allreduce_coalesced", "last_stats"]

_MAGIC = 0x5C0DE
_ERR_OK, _ERR_RANGE, _ERR_NONFINITE, _ERR_COUNTS = 0, 1, 2, 3
_HEADER = 17                                  # magic .. method: must be equal on every rank
_ERR_SLOT, _K_SLOT, _COUNTS_SLOT = 17, 18, 19  # then one push count per peer
_last_stats: Optional[SparseSyncStats] = None


def last_stats() -> Optional[SparseSyncStats]:
    """Statistics of the most recent :func:`sparse_allreduce` completed in this process."""
    return _last_stats


def sparse_allreduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                     op: Union[str, ReduceOp] = "sum", async_op: bool = False, *,
                     scheme: Union[str, PartitionScheme] = "hash", local_world_size: Optional[int] = None,
                     local_aggregation: bool = True, method: Union[str, SyncMethod] = "partitioned",
                     nonfinite: str = "raise", stats: Optional[SparseSyncStats] = None
                     ) -> Union[torch.Tensor, torch.futures.Future]:
    """Sum (or average) a sparse COO tensor over all ranks of ``group``.

    The result is coalesced, has the input's shape and dtype, and is bitwise
    the same on every rank (each row is summed once, by its owner, adding the
    ranks' contributions in rank order).

    Args:
        tensor: sparse COO tensor, coalesced or not, e.g. an embedding's
            ``(V, d)`` gradient. Values float32/float64/float16/bfloat16
            (fp16/bf16 are summed in float32 at each owner and rounded once
            per level: once flat, twice with two-level aggregation).
        group: process group (default: the default group). gloo with CPU
            tensors; NCCL with CUDA tensors.
        op: ``"sum"`` or ``"avg"`` (divide by the group size, like DDP).
        async_op: return a ``torch.futures.Future`` of the result instead of
            waiting. The work runs on the worker thread of a twin of
            ``group`` (see ``groups.twin_group``), in submission order.
        scheme: row ownership, ``"hash"`` (balanced under skew) or ``"range"``.
        local_world_size: ranks per node for two-level aggregation. Default:
            what the launcher says (``LOCAL_WORLD_SIZE``, Open MPI, MPICH,
            Slurm) for the default group, else 1. Must divide the group
            size (else the exchange is flat); every rank must pass the same value.
        local_aggregation: with several ranks per node, sum inside the node
            before crossing nodes (default). False: one flat exchange (the
            node layout still splits the byte counts into intra/inter-node).
        method: ``"partitioned"`` (default, the path above), ``"allgather"``
            (every rank gathers all rows and sums locally, as Horovod does:
            cheaper for tiny batches), ``"densify"`` (scatter into the
            dense table and allreduce it with a row mask: cheaper when most
            rows are touched; the table travels in the tensor's dtype, as a
            dense allreduce would) or ``"torch"`` (the backend's own sparse
            ``all_reduce``, gloo only, then coalesced). All give the same
            rows and, up to floating-point summation order, the same sums.
        nonfinite: ``"raise"`` (default): any NaN/Inf in any rank's values
            raises ``ValueError`` on every rank before the exchange (checked
            with one sum over the coalesced rows, exactly only when that sum
            is not finite); ``"propagate"``: sum them like ``all_reduce``
            does (e.g. for AMP's overflow detection).
        stats: a :class:`SparseSyncStats` to fill (bytes, rows, phase times).

    Note:
        The first async call, and the first two-level call, for a group
        create process groups (a twin of ``group``, node groups); like
        ``dist.new_group`` that is collective over every process of the
        default group, so make those first calls on all processes, with the
        same ``local_world_size`` everywhere. Created groups get ``group``'s timeout.

    Returns:
        The reduced sparse tensor, or a Future of it when ``async_op``.

    Raises:
        TypeError: ``tensor`` is not a sparse COO tensor of a float dtype.
        ValueError: on every rank, when ranks disagree on shape, dtype, op,
            scheme or method, any rank has ids out of range or
            (``nonfinite="raise"``) non-finite values, or a peer's counts are
            inconsistent.
        RuntimeError: a peer died or hung (after the group's timeout).

    Example::

        >>> grad = emb.weight.grad            # sparse (V, d)
        >>> total = sparse_allreduce(grad, op="avg")
    """
    out = sparse_allreduce_coalesced([tensor], group, op, async_op, scheme=scheme,
                                     local_world_size=local_world_size, local_aggregation=local_aggregation,
                                     method=method, nonfinite=nonfinite, stats=None if stats is None else [stats])
    if async_op:
        return out.then(lambda f: f.value()[0])
    return out[0]


def sparse_allreduce_coalesced(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                               op: Union[str, ReduceOp] = "sum", async_op: bool = False, *,
                               scheme: Union[str, PartitionScheme] = "hash",
                               local_world_size: Optional[int] = None, local_aggregation: bool = True,
                               method: Union[str, SyncMethod, Sequence[Union[str, SyncMethod]]] = "partitioned",
                               nonfinite: str = "raise", stats: Optional[Sequence[SparseSyncStats]] = None
                               ) -> Union[List[torch.Tensor], torch.futures.Future]:
    """:func:`sparse_allreduce` of several sparse tensors in one set of collectives.

    Like ``dist.all_reduce_coalesced``: the tensors may differ in shape and
    dtype; every rank passes the same number of tensors, in the same order,
    with the same shapes. Flat partitioned and allgather tensors share one
    metadata all-to-all, one push all-to-all and (partitioned only) one pull;
    densify, torch and two-level tensors follow one by one.

    Args:
        tensors: sparse COO tensors, all on one device.
        method: one method for all tensors, or one per tensor.
        stats: one :class:`SparseSyncStats` per tensor to fill, or None.
        (others): as for :func:`sparse_allreduce`.

    Returns:
        The reduced tensors, in order (or a Future of that list when ``async_op``).
    """
    tensors = list(tensors)
    methods = [method] * len(tensors) if isinstance(method, (str, SyncMethod)) else list(method)
    if len(methods) != len(tensors):
        raise ValueError(f"method: got {len(methods)} methods for {len(tensors)} tensors")
    stats = [SparseSyncStats() for _ in tensors] if stats is None else list(stats)
    if len(stats) != len(tensors):
        raise ValueError(f"stats: got {len(stats)} for {len(tensors)} tensors")
    plan = SyncPlan.build(tensors, group, op, scheme, local_world_size, local_aggregation, methods, nonfinite)
    if plan.hierarchical_any:
        node_groups(group, plan.local_world_size)  # collective creation, in the caller's program order

    def job(g=group) -> List[torch.Tensor]:
        global _last_stats
        out = _sync(tensors, plan.on(g), stats)
        _last_stats = stats[-1] if stats else None
        return out

    if not async_op:
        return job()
    twin = twin_group(group)
    if plan.hierarchical_any:
        node_groups(twin, plan.local_world_size)
    return run_async(lambda: job(twin), group=twin, device=plan.device)


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

    @staticmethod
    def build(tensors: Sequence[torch.Tensor], group, op, scheme, local_world_size, local_aggregation, methods,
              nonfinite) -> "SyncPlan":
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
        device = devices.pop() if devices else torch.device("cpu")
        return SyncPlan(op, scheme.value, methods, local_world_size, local_aggregation, nonfinite, device,
                        group, n, dist.get_rank(group))

    def on(self, group: Optional[dist.ProcessGroup]) -> "SyncPlan":
        """This plan bound to the group it runs on (the caller's or its twin)."""
        return SyncPlan(self.op, self.scheme, self.methods, self.local_world_size, self.local_aggregation,
                        self.nonfinite, self.device, group, dist.get_world_size(group), dist.get_rank(group),
                        comm_device(group, self.device))

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
class _Rows:
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
    err: int = _ERR_OK
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


def _prepare(tensor: torch.Tensor, method: SyncMethod, plan: SyncPlan, stats: SparseSyncStats) -> _Rows:
    """Linearize, check and coalesce one tensor's rows; partition them for a flat push."""
    sparse_shape = tuple(tensor.shape[: tensor.sparse_dim()])
    num_rows = math.prod(sparse_shape)
    indices, values = tensor._indices(), tensor._values().contiguous()
    rows = _Rows(tensor, method, plan.hierarchical(method), stats, sparse_shape, num_rows,
                 wire_index_dtype(num_rows), _linear_ids(indices, sparse_shape), values)
    stats.world_size, stats.rows_in, stats.num_rows, stats.method = plan.world_size, indices.shape[1], num_rows, method.value
    stats.row_bytes = math.prod(values.shape[1:]) * values.element_size()
    stats.index_bytes = torch.empty(0, dtype=rows.wire_ids).element_size()
    stats.hierarchical = rows.hierarchical
    # Bad input is found locally but reported through the metadata exchange,
    # so every rank raises together instead of the others hanging.
    if len(sparse_shape) > 1 and not _indices_in_range(indices, sparse_shape):
        rows.err = _ERR_RANGE
    else:
        try:
            # The kernel checks [0, num_rows) in its pass over the ids: no extra scan, no host sync.
            rows.ids, rows.values = ops.coalesce_rows(rows.ids, values, num_rows)
        except ValueError:
            rows.err = _ERR_RANGE
    if rows.err == _ERR_OK and plan.nonfinite == "raise" and not all_finite(rows.values):
        rows.err = _ERR_NONFINITE
    if rows.err != _ERR_OK:
        rows.ids, rows.values = rows.ids[:0], values[:0]
    stats.rows_local = rows.ids.shape[0]
    if rows.method is SyncMethod.PARTITIONED and not rows.hierarchical:
        rows.part = ops.partition_rows(rows.ids, rows.values, plan.world_size, plan.scheme, num_rows,
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


def _unlinear(ids: torch.Tensor, sparse_shape: Sequence[int]) -> torch.Tensor:
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


def _header(rows: _Rows, plan: SyncPlan) -> List[int]:
    shape = list(rows.tensor.shape)
    dims = (shape + [-1] * 8)[:8]
    digest = zlib.crc32(repr((shape, str(rows.tensor.dtype))).encode())
    return [_MAGIC, ops.VALUE_DTYPES.index(rows.tensor.dtype), len(shape), rows.tensor.sparse_dim(), digest, *dims,
            ["sum", "avg"].index(plan.op.value), ["hash", "range"].index(plan.scheme),
            plan.local_world_size if rows.hierarchical else 1, list(SyncMethod).index(rows.method)]


def _describe(row: Sequence[int]) -> str:
    dims = [d for d in row[5:13] if d >= 0][: row[2]]
    methods = list(SyncMethod)
    return (f"shape={tuple(dims)}, dtype={ops.VALUE_DTYPES[row[1]] if 0 <= row[1] < 4 else row[1]}, "
            f"sparse_dim={row[3]}, op={['sum', 'avg'][row[13] % 2]}, scheme={['hash', 'range'][row[14] % 2]}, "
            f"local_world_size={row[15]}, method={methods[row[16]].value if 0 <= row[16] < len(methods) else row[16]}")


@dataclass
class _Peers:
    """What the metadata exchange taught about one tensor: every rank's k and push counts."""

    k: List[int]                 # rows each rank holds after coalescing
    push: List[List[int]]        # push[i][j]: rows rank i sends to owner j (flat partitioned)


def _exchange_meta(tables: List[_Rows], plan: SyncPlan) -> List[_Peers]:
    """One all-to-all: each rank's header, error, k and full push-count vector per tensor, to every rank.

    Every rank receives the same numbers from a peer (its full count vector,
    not just the count meant for it), so every rank checks them the same way
    and raises together.
    """
    n, width = plan.world_size, _COUNTS_SLOT + plan.world_size
    counts = [t.part.counts for t in tables if t.part is not None]
    flat_counts = torch.stack(counts).tolist() if counts else []  # one host sync for every tensor
    meta: List[int] = []
    it = iter(flat_counts)
    for t in tables:
        meta += _header(t, plan) + [t.err, t.ids.shape[0]] + (next(it) if t.part is not None else [0] * n)
    send = torch.tensor(meta * n, dtype=torch.int64, device=plan.comm_device).view(n, -1)
    recv = torch.empty_like(send)
    # all_to_all, not all_gather: on gloo a tiny all-gather costs several times
    # the latency of an all-to-all of the same bytes.
    dist.all_to_all_single(recv, send, group=plan.group)
    got = recv.view(n, len(tables), width).tolist()
    for i, t in enumerate(tables):
        t.stats.bytes_sent += 8 * width * (n - 1)
        t.stats.bytes_recv += 8 * width * (n - 1)
    return [_check_meta([got[r][i] for r in range(n)], t, plan) for i, t in enumerate(tables)]


def _check_meta(rows: List[List[int]], t: _Rows, plan: SyncPlan) -> _Peers:
    """Every rank runs this on the same numbers: the same verdict everywhere."""
    me, num_rows = plan.rank, t.num_rows
    for r, row in enumerate(rows):
        if row[0] != _MAGIC:
            raise ValueError(f"sparse_allreduce: rank {r} is not in a sparse_allreduce call "
                             f"(collective calls differ between ranks)")
    for r, row in enumerate(rows):
        if row[_ERR_SLOT] == _ERR_RANGE:
            raise ValueError(f"sparse_allreduce: rank {r} passed row ids outside [0, {num_rows}); "
                             f"nothing was exchanged")
        if row[_ERR_SLOT] == _ERR_NONFINITE:
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
        bad = not 0 <= k[r] <= num_rows or rows[r][_ERR_SLOT] != _ERR_OK
        if t.part is not None:
            bad = bad or min(push[r]) < 0 or sum(push[r]) != k[r]
        if bad:
            raise ValueError(f"sparse_allreduce: rank {r} sent inconsistent row counts (k={k[r]}, per owner "
                             f"{push[r] if t.part is not None else '-'}, table of {num_rows} rows): a bug or a "
                             f"version mismatch between ranks; nothing was exchanged")
    return _Peers(k, push)


# ------------------------------------------------------------------- the call


def _sync(tensors: List[torch.Tensor], plan: SyncPlan, stats: List[SparseSyncStats]) -> List[torch.Tensor]:
    clock = time.perf_counter
    t0 = clock()
    tables = [_prepare(t, m, plan, s) for t, m, s in zip(tensors, plan.methods, stats)]
    t1 = clock()
    peers = _exchange_meta(tables, plan) if tables else []
    for t, p in zip(tables, peers):
        t.stats.rows_local_sum, t.stats.rows_local_max = sum(p.k), max(p.k)
    t2 = clock()
    results: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(tables)
    fused = [i for i, t in enumerate(tables) if t.fused]
    if fused:
        for i, out in zip(fused, _fused_exchange([tables[i] for i in fused], [peers[i] for i in fused], plan)):
            results[i] = out
    t3 = clock()
    for i, t in enumerate(tables):
        if results[i] is None:
            results[i] = _one_by_one(t, peers[i], plan)
    t4 = clock()
    outs = []
    for t, (ids, values) in zip(tables, results):
        t.stats.rows_out = ids.shape[0]
        outs.append(torch.sparse_coo_tensor(_unlinear(ids.long(), t.sparse_shape), values.to(t.tensor.dtype),
                                            tuple(t.tensor.shape), dtype=t.tensor.dtype, device=t.tensor.device,
                                            is_coalesced=True, check_invariants=False))
    t5 = clock()
    share = 1.0 / max(1, len(tables))  # shared phases are split evenly between the tensors
    for t in tables:
        t.stats.add_time("coalesce", (t1 - t0) * share)
        t.stats.add_time("metadata", (t2 - t1) * share)
        t.stats.add_time("exchange", ((t3 - t2) * share if t.fused else 0.0))
        t.stats.add_time("assemble", (t5 - t4) * share)
    for i, t in enumerate(tables):
        if not t.fused:
            t.stats.add_time("exchange", (t4 - t3) / max(1, len(tables) - len(fused)))
    return outs


def _fused_exchange(tables: List[_Rows], peers: List[_Peers], plan: SyncPlan
                    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Push (partitioned) and gather (allgather) every fused tensor in one all-to-all; pull the owned sums in one more."""
    n, me, group, cdev = plan.world_size, plan.rank, plan.group, plan.comm_device
    # Push: to peer j, partitioned tensors send the rows j owns, allgather tensors all their rows.
    send_parts, send_counts, recv_counts = [], [], []
    for t, p in zip(tables, peers):
        if t.method is SyncMethod.PARTITIONED:
            ids, values = t.part.ids, t.part.values
            send_counts.append(p.push[me])
            recv_counts.append([p.push[i][me] for i in range(n)])
        else:
            ids, values = t.ids, t.values
            send_counts.append([p.k[me]] * n)
            recv_counts.append(list(p.k))
        send_parts.append((ids.to(t.wire_ids), values))
    received = _all_to_all_tables(send_parts, send_counts, recv_counts, [t.stats for t in tables], plan,
                                  repeat=[t.method is SyncMethod.ALLGATHER for t in tables])
    out: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(tables)
    owned, owned_idx, errors = [], [], []
    for i, (t, (ids, values)) in enumerate(zip(tables, received)):
        ids = kernel_ids(ids).to(t.ids.device)
        values = values.to(device=t.values.device, dtype=t.sum_dtype)
        try:
            # Ids from peers are bounds-checked by the kernel before it indexes with them.
            ids, values = ops.coalesce_rows(ids, values, t.num_rows)
            err = _ERR_OK
        except ValueError:
            ids, values, err = ids[:0], values[:0], _ERR_RANGE
        if plan.op is ReduceOp.AVG:
            values.div_(n)
        values = values.to(t.values.dtype)
        if t.method is SyncMethod.ALLGATHER:
            if err != _ERR_OK:  # every rank received the same rows: every rank raises
                raise ValueError(f"sparse_allreduce: a peer sent row ids outside [0, {t.num_rows}) "
                                 f"(inconsistent data between ranks)")
            out[i] = (ids, values)
        else:
            owned.append((ids, values))
            owned_idx.append(i)
            errors.append(err)
    if owned:
        pulled = _pull(owned, errors, [tables[i] for i in owned_idx], [peers[i] for i in owned_idx], plan)
        for i, res in zip(owned_idx, pulled):
            out[i] = res
    return out


def _pull(owned, errors, tables: List[_Rows], peers: List[_Peers], plan: SyncPlan
          ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Every owner shares its summed rows with every rank: one count exchange, one all-to-all."""
    n, me = plan.world_size, plan.rank
    # A count below zero carries an owner's error to every rank (same verdict everywhere).
    mine = [ids.shape[0] if err == _ERR_OK else -1 - err for (ids, _), err in zip(owned, errors)]
    send = torch.tensor(mine * n, dtype=torch.int64, device=plan.comm_device).view(n, -1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=plan.group)
    got = recv.tolist()
    for t in tables:
        count_bytes(t.stats, [8] * n, [8] * n, me, plan.peer_node)
    recv_counts = []
    for j, (t, p) in enumerate(zip(tables, peers)):
        counts = [got[r][j] for r in range(n)]
        for r, c in enumerate(counts):
            if c == -1 - _ERR_RANGE:
                raise ValueError(f"sparse_allreduce: owner rank {r} received row ids outside [0, {t.num_rows}) "
                                 f"(inconsistent data between ranks); nothing was shared")
            # An owner holds at most the rows pushed to it, and no more than the table.
            if c < 0 or c > min(t.num_rows, sum(p.push[i][r] for i in range(n))):
                raise ValueError(f"sparse_allreduce: owner rank {r} announced {c} summed rows, inconsistent with "
                                 f"the {sum(p.push[i][r] for i in range(n))} rows pushed to it; nothing was shared")
        recv_counts.append(counts)
    send_parts = [(ids.to(t.wire_ids), values) for (ids, values), t in zip(owned, tables)]
    send_counts = [[ids.shape[0]] * n for ids, _ in owned]
    received = _all_to_all_tables(send_parts, send_counts, recv_counts, [t.stats for t in tables], plan,
                                  repeat=[True] * len(tables))
    out = []
    for t, (ids, values) in zip(tables, received):
        # Owners' rows arrive owner by owner, disjoint: one sort makes the result coalesced.
        ids, values = ops.coalesce_rows(kernel_ids(ids).to(t.ids.device), values.to(t.values.device), t.num_rows)
        out.append((ids, values))
    return out


def _all_to_all_tables(parts: List[Tuple[torch.Tensor, torch.Tensor]], send_counts: List[List[int]],
                       recv_counts: List[List[int]], stats: List[SparseSyncStats], plan: SyncPlan,
                       repeat: List[bool]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """One all-to-all carrying (ids, rows) of several tensors; returns each tensor's received rows in rank order.

    ``repeat[t]``: tensor t sends all of its rows to every peer (an allgather);
    else ``send_counts[t][j]`` consecutive rows go to peer j.
    """
    n, me = plan.world_size, plan.rank
    row_bytes = [[ids.element_size(), math.prod(v.shape[1:]) * v.element_size()] for ids, v in parts]
    for t, s in enumerate(stats):
        row = sum(row_bytes[t])
        count_bytes(s, [c * row for c in send_counts[t]], [c * row for c in recv_counts[t]], me, plan.peer_node)
    return exchange_tables(parts, send_counts, recv_counts, repeat, plan.group, plan.comm_device)


# --------------------------------------------------- paths taken one by one


def _one_by_one(t: _Rows, p: _Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    n = plan.world_size
    ids, values = t.ids, t.values
    if t.method is SyncMethod.PARTITIONED:  # two-level
        ids, values = _two_level(t, p, plan)
    elif t.method is SyncMethod.DENSIFY:
        if plan.op is ReduceOp.AVG:
            # Divide before the sum, as DDP does: fp16 overflows otherwise.
            values = values.to(t.sum_dtype).div_(n).to(values.dtype)
        ids, values = _densify_allreduce(ids, values, t.num_rows, plan.group, plan.comm_device, t.stats)
    else:  # the backend's own sparse all_reduce (gloo: an allgather of sizes, ids and values)
        ids, values = _torch_allreduce(t, plan)
    return ids, values


def _two_level(t: _Rows, p: _Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Push inside the node, then across nodes; share back across nodes, then inside the node."""
    n, lws, dtype = plan.world_size, plan.local_world_size, t.values.dtype
    local_pg, cross_pg = node_groups(plan.group, lws)
    nodes_local = [0] * lws                    # every peer in my node group is on my node
    nodes_cross = list(range(n // lws))        # every peer in my cross group is on another node
    common = dict(scheme=plan.scheme, num_rows=t.num_rows, range_size=plan.range_size(t.num_rows),
                  wire_ids=t.wire_ids, device=plan.comm_device, stats=t.stats, sum_dtype=t.sum_dtype)
    ids, values = push_to_owners(t.ids, t.values, local_pg, num_owners=lws, stride=1, peer_node=nodes_local,
                                 **common)
    ids, values = push_to_owners(ids, values.to(dtype), cross_pg, num_owners=n // lws, stride=lws,
                                 peer_node=nodes_cross, **common)
    if plan.op is ReduceOp.AVG:
        values.div_(n)
    values = values.to(dtype)
    ids, values = allgather_rows(ids, values, cross_pg, wire_ids=t.wire_ids, device=plan.comm_device,
                                 stats=t.stats, peer_node=nodes_cross, max_rows=t.num_rows)
    ids, values = allgather_rows(ids, values, local_pg, wire_ids=t.wire_ids, device=plan.comm_device,
                                 stats=t.stats, peer_node=nodes_local, max_rows=t.num_rows)
    return ops.coalesce_rows(ids, values, t.num_rows)


def _torch_allreduce(t: _Rows, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    n = plan.world_size
    local = torch.sparse_coo_tensor(t.ids.long()[None], t.values, (t.num_rows, *t.value_shape()),
                                    is_coalesced=True, check_invariants=False).to(plan.comm_device)
    dist.all_reduce(local, group=plan.group)
    row = t.stats.row_bytes + 8
    t.stats.bytes_sent += (n - 1) * t.ids.shape[0] * row
    t.stats.bytes_recv += (t.stats.rows_local_sum - t.ids.shape[0]) * row
    ids, values = local._indices()[0], local._values()
    # Same rows in the same (rank) order on every rank: identical sums everywhere.
    ids, values = ops.coalesce_rows(ids.to(t.ids.device), values.to(t.values.device).to(t.sum_dtype), t.num_rows)
    if plan.op is ReduceOp.AVG:
        values.div_(n)
    return ids, values.to(t.values.dtype)


def _densify_allreduce(ids, values, num_rows, group, cdev, stats) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows into the dense table, allreduce it and a row mask; return the union's rows."""
    n = dist.get_world_size(group)
    dense = torch.zeros((num_rows, *values.shape[1:]), dtype=values.dtype, device=cdev)
    # The mask keeps rows whose sum is exactly zero: optimizers like SparseAdam
    # treat "row present with zero gradient" differently from "row absent".
    mask = torch.zeros(num_rows, dtype=torch.uint8, device=cdev)
    dense[ids.to(cdev).long()] = values.to(cdev)
    mask[ids.to(cdev).long()] = 1
    works = [dist.all_reduce(dense, group=group, async_op=True),
             dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group, async_op=True)]
    for w in works:
        w.wait()
    ring = 2 * (n - 1) / n if n > 1 else 0.0
    for t in (dense, mask):
        stats.bytes_sent += int(ring * t.numel() * t.element_size())
        stats.bytes_recv += int(ring * t.numel() * t.element_size())
    union = mask.nonzero().view(-1)
    return union.to(ids.device), dense.index_select(0, union).to(values.device)
