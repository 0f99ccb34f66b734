"""Sparse allreduce over a partitioned parameter-server path.

Per call (shared/DESIGN.md): coalesce locally -> check metadata on all ranks
-> partition rows by owner -> push ids and rows to their owners (all-to-all)
-> owners sum what they received -> owners share the summed rows with every
rank -> assemble a coalesced COO tensor. Per rank this moves about
(N-1)/N (k + U) rows instead of the (N-1) k rows of an allgather, and never
allocates anything the size of the table.

With several ranks per node (``local_world_size``), the push and the share are
done in two levels (Parallax's local aggregation): rows are first summed
inside the node, then exchanged between nodes by the rank of each node that
owns them, so each row crosses between nodes once per node.
"""

from __future__ import annotations

import math
import time
import zlib
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.exchange import allgather_rows, push_to_owners, wire_index_dtype
from sparsecomm.collectives.groups import comm_device, env_local_world_size, node_groups, run_async, twin_group
from sparsecomm.types import PartitionScheme, ReduceOp, SparseSyncStats, SyncMethod

__all__ = ["sparse_allreduce", "last_stats"]

_META_LEN = 20
_MAGIC = 0x5C0DE
_ERR_OK, _ERR_RANGE, _ERR_NONFINITE = 0, 1, 2
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
            waiting. The work runs on a worker thread over a twin of
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
            cheaper for tiny batches) or ``"densify"`` (scatter into the
            dense table and allreduce it with a row mask: cheaper when most
            rows are touched; the table travels in the tensor's dtype, as a
            dense allreduce would). All three give the same rows and, up to
            floating-point summation order, the same sums.
        nonfinite: ``"raise"`` (default): any NaN/Inf in any rank's values
            raises ``ValueError`` on every rank before the exchange;
            ``"propagate"``: sum them like ``all_reduce`` does (e.g. for AMP's
            overflow detection).
        stats: a :class:`SparseSyncStats` to fill (bytes, rows, phase times).

    Note:
        The first async call, and the first two-level call, for a group
        create process groups (a twin of ``group``, node groups); like
        ``dist.new_group`` that is collective over every process of the
        default group, so make those first calls on all processes, with the
        same ``local_world_size`` everywhere.

    Returns:
        The reduced sparse tensor, or a Future of it when ``async_op``.

    Raises:
        TypeError: ``tensor`` is not a sparse COO tensor of a float dtype.
        ValueError: on every rank, when ranks disagree on shape, dtype, op or
            scheme, or any rank has ids out of range or (``nonfinite="raise"``)
            non-finite values.
        RuntimeError: a peer died or hung (after the group's timeout).

    Example::

        >>> grad = emb.weight.grad            # sparse (V, d)
        >>> total = sparse_allreduce(grad, op="avg")
    """
    op = ReduceOp(op)
    scheme = PartitionScheme(scheme)
    method = SyncMethod(method)
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    _check_tensor(tensor)
    if local_world_size is None:
        is_world = group is None or group is dist.GroupMember.WORLD
        local_world_size = (env_local_world_size() or 1) if is_world else 1
    n = dist.get_world_size(group)
    if local_world_size < 1 or n % local_world_size:
        local_world_size = 1  # uneven nodes: flat exchange is always correct
    hierarchical = method is SyncMethod.PARTITIONED and local_aggregation and 1 < local_world_size < n
    if hierarchical:
        node_groups(group, local_world_size)  # collective creation, in the caller's program order
    stats = stats if stats is not None else SparseSyncStats()

    def job(g=group) -> torch.Tensor:
        global _last_stats
        out = _sparse_allreduce(tensor, g, op, method, scheme.value, local_world_size, hierarchical, nonfinite,
                                stats)
        _last_stats = stats
        return out

    if not async_op:
        return job()
    twin = twin_group(group)
    if hierarchical:
        node_groups(twin, local_world_size)
    return run_async(lambda: job(twin))


def _check_tensor(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"sparse_allreduce expects a sparse COO tensor, got "
                        f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    if tensor.dtype not in ops.VALUE_DTYPES:
        raise TypeError(f"sparse_allreduce supports float32/float64/float16/bfloat16 values, got {tensor.dtype}")


def _indices_in_range(indices: torch.Tensor, sparse_shape: Sequence[int]) -> bool:
    # Per dimension: with several sparse dims an index past one dim's size
    # would otherwise linearize into a valid id of another row.
    if indices.numel() == 0:
        return True
    lo, hi = indices.amin(1).tolist(), indices.amax(1).tolist()
    return all(0 <= a and b < size for a, b, size in zip(lo, hi, sparse_shape))


def _linear_ids(indices: torch.Tensor, sparse_shape: Sequence[int]) -> torch.Tensor:
    # One id per row of the sparse dims (row-major), so >1 sparse dim works too.
    ids = indices[0].clone()
    for dim in range(1, len(sparse_shape)):
        ids.mul_(sparse_shape[dim]).add_(indices[dim])
    return ids


def _unlinear(ids: torch.Tensor, sparse_shape: Sequence[int]) -> torch.Tensor:
    rows = []
    rest = ids
    for size in reversed(sparse_shape[1:]):
        rows.append(rest % size)
        rest = rest // size
    rows.append(rest)
    return torch.stack(rows[::-1])


def _meta(tensor: torch.Tensor, op: ReduceOp, method: SyncMethod, scheme: str, lws: int, err: int, k: int
          ) -> List[int]:
    shape = list(tensor.shape)
    dims = (shape + [-1] * 8)[:8]
    digest = zlib.crc32(repr((shape, str(tensor.dtype))).encode())
    code = ops.VALUE_DTYPES.index(tensor.dtype)
    meta = [_MAGIC, code, len(shape), tensor.sparse_dim(), digest, *dims,
            ["sum", "avg"].index(op.value), ["hash", "range"].index(scheme), lws,
            list(SyncMethod).index(method), err, k]
    return meta + [0] * (_META_LEN - len(meta))


def _describe(row: Sequence[int]) -> str:
    dims = [d for d in row[5:13] if d >= 0][: row[2]]
    return (f"shape={tuple(dims)}, dtype={ops.VALUE_DTYPES[row[1]] if 0 <= row[1] < 4 else row[1]}, "
            f"sparse_dim={row[3]}, op={['sum', 'avg'][row[13]]}, scheme={['hash', 'range'][row[14]]}, "
            f"local_world_size={row[15]}, method={list(SyncMethod)[row[16]].value}")


_ERR_SLOT, _K_SLOT, _COUNT_SLOT = 17, 18, 19


def _check_meta(all_meta: List[List[int]], me: int, num_rows: int) -> None:
    for r, row in enumerate(all_meta):
        if row[_ERR_SLOT] == _ERR_RANGE:
            raise ValueError(f"sparse_allreduce: rank {r} passed row ids outside [0, {num_rows}); "
                             f"nothing was exchanged")
        if row[_ERR_SLOT] == _ERR_NONFINITE:
            raise ValueError(f"sparse_allreduce: rank {r} passed NaN or Inf values (nonfinite='raise'); "
                             f"nothing was exchanged")
    mine = all_meta[me][:_ERR_SLOT]
    for r, row in enumerate(all_meta):
        if row[0] != _MAGIC:
            raise ValueError(f"sparse_allreduce: rank {r} is not in a sparse_allreduce call "
                             f"(collective calls differ between ranks)")
        if row[:_ERR_SLOT] != mine:
            raise ValueError(f"sparse_allreduce: ranks disagree on the tensor: rank {me} has {_describe(mine)} "
                             f"but rank {r} has {_describe(row)}")


def _sparse_allreduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], op: ReduceOp,
                      method: SyncMethod, scheme: str, lws: int, hierarchical: bool, nonfinite: str,
                      stats: SparseSyncStats) -> torch.Tensor:
    clock = time.perf_counter
    t0 = clock()
    n, me = dist.get_world_size(group), dist.get_rank(group)
    shape = tuple(tensor.shape)
    sparse_shape = shape[: tensor.sparse_dim()]
    num_rows = math.prod(sparse_shape)
    dev = tensor.device
    cdev = comm_device(group, dev)
    indices, values = tensor._indices(), tensor._values().contiguous()
    ids = _linear_ids(indices, sparse_shape)
    stats.world_size, stats.rows_in, stats.num_rows, stats.method = n, ids.shape[0], num_rows, method.value
    stats.row_bytes = math.prod(values.shape[1:]) * values.element_size()
    wire_ids = wire_index_dtype(num_rows)
    stats.index_bytes = torch.empty(0, dtype=wire_ids).element_size()

    # Bad input is found locally but reported through the metadata exchange,
    # so every rank raises together instead of the others hanging.
    err = _ERR_OK
    if not _indices_in_range(indices, sparse_shape):
        err = _ERR_RANGE
    elif nonfinite == "raise" and values.numel() and not bool(torch.isfinite(values).all()):
        err = _ERR_NONFINITE
    if err == _ERR_OK:
        ids, values = ops.coalesce_rows(ids, values, num_rows)
    stats.rows_local = ids.shape[0]
    t1 = clock()
    stats.add_time("coalesce", t1 - t0)

    # Flat partitioned path: partition now, so the push counts travel with the
    # metadata (one all-to-all carries both; it saves a collective per call).
    part = None
    push_counts = [0] * n
    range_size = max(1, -(-num_rows // n))
    if err == _ERR_OK and method is SyncMethod.PARTITIONED and not hierarchical:
        part = ops.partition_rows(ids, values, n, scheme, num_rows, range_size=range_size)
        push_counts = part.counts.tolist()
    meta = _meta(tensor, op, method, scheme, lws if hierarchical else 1, err, ids.shape[0])
    send = torch.tensor([meta[:_COUNT_SLOT] + [c] for c in push_counts], dtype=torch.int64, device=cdev)
    recv = torch.empty_like(send)
    # all_to_all, not all_gather: on gloo a tiny all-gather costs several times
    # the latency of an all-to-all of the same bytes.
    dist.all_to_all_single(recv, send, group=group)
    stats.bytes_sent += 8 * _META_LEN * (n - 1)
    stats.bytes_recv += 8 * _META_LEN * (n - 1)
    rows = recv.tolist()
    _check_meta(rows, me, num_rows)
    all_k = [row[_K_SLOT] for row in rows]
    stats.rows_local_sum, stats.rows_local_max = sum(all_k), max(all_k)
    t2 = clock()
    stats.add_time("metadata", t2 - t1)

    half = values.dtype in (torch.float16, torch.bfloat16)
    sum_dtype = torch.float32 if half else values.dtype
    stats.hierarchical = hierarchical
    if method is SyncMethod.PARTITIONED:
        ids, values = _partitioned(ids, values, group, n, lws, hierarchical, scheme, num_rows, range_size,
                                   wire_ids, sum_dtype, op, cdev, stats, clock, part,
                                   [row[_COUNT_SLOT] for row in rows])
    else:
        if method is SyncMethod.DENSIFY:
            if op is ReduceOp.AVG:
                # Divide before the sum, as DDP does: fp16 overflows otherwise.
                values = values.to(sum_dtype).div_(n).to(values.dtype)
            ids, values = _densify_allreduce(ids, values, num_rows, group, cdev, stats)
        else:
            ids, values = allgather_rows(ids, values, group, wire_ids=wire_ids, device=cdev, stats=stats,
                                         counts=all_k)
            # Every rank sums the same rows in the same (rank) order: identical results everywhere.
            ids, values = ops.coalesce_rows(ids, values.to(sum_dtype), num_rows)
            if op is ReduceOp.AVG:
                values.div_(n)
        stats.add_time("exchange", clock() - t2)
    values = values.to(tensor.dtype)
    t3 = clock()

    stats.rows_out = ids.shape[0]
    out = torch.sparse_coo_tensor(_unlinear(ids.long(), sparse_shape), values, shape, dtype=tensor.dtype,
                                  device=dev, is_coalesced=True, check_invariants=False)
    stats.add_time("assemble", clock() - t3)
    return out


def _partitioned(ids, values, group, n, lws, hierarchical, scheme, num_rows, range_size, wire_ids, sum_dtype, op,
                 cdev, stats, clock, part, recv_counts) -> Tuple[torch.Tensor, torch.Tensor]:
    """Push to owners, sum, share back: the rows of all ranks, summed, sorted."""
    dtype = values.dtype
    common = dict(scheme=scheme, num_rows=num_rows, range_size=range_size, wire_ids=wire_ids, device=cdev,
                  stats=stats)
    t0 = clock()
    if hierarchical:
        local_pg, cross_pg = node_groups(group, lws)
        nodes_local = [0] * lws                    # every peer in my node group is on my node
        nodes_cross = list(range(n // lws))        # every peer in my cross group is on another node
        ids, values = push_to_owners(ids, values, local_pg, num_owners=lws, stride=1, sum_dtype=sum_dtype,
                                     peer_node=nodes_local, **common)
        ids, values = push_to_owners(ids, values.to(dtype), cross_pg, num_owners=n // lws, stride=lws,
                                     sum_dtype=sum_dtype, peer_node=nodes_cross, **common)
    else:
        peer_node = [r // lws for r in range(n)] if lws > 1 else None
        ids, values = push_to_owners(ids, values, group, num_owners=n, stride=1, sum_dtype=sum_dtype,
                                     peer_node=peer_node, part=part, recv_counts=recv_counts, **common)
    if op is ReduceOp.AVG:
        values.div_(n)
    values = values.to(dtype)
    t1 = clock()
    stats.add_time("push+reduce", t1 - t0)
    if hierarchical:
        ids, values = allgather_rows(ids, values, cross_pg, wire_ids=wire_ids, device=cdev, stats=stats,
                                     peer_node=nodes_cross)
        ids, values = allgather_rows(ids, values, local_pg, wire_ids=wire_ids, device=cdev, stats=stats,
                                     peer_node=nodes_local)
    else:
        ids, values = allgather_rows(ids, values, group, wire_ids=wire_ids, device=cdev, stats=stats,
                                     peer_node=peer_node)
    # Owners' rows arrive owner by owner; one sort makes the result coalesced.
    ids, values = ops.coalesce_rows(ids, values, num_rows)
    stats.add_time("pull", clock() - t1)
    return ids, values


def _densify_allreduce(ids, values, num_rows, group, cdev, stats) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows into the dense table, allreduce it and a row mask; return the union's rows."""
    n = dist.get_world_size(group)
    dense = torch.zeros((num_rows, *values.shape[1:]), dtype=values.dtype, device=cdev)
    # The mask keeps rows whose sum is exactly zero: optimizers like SparseAdam
    # treat "row present with zero gradient" differently from "row absent".
    mask = torch.zeros(num_rows, dtype=torch.uint8, device=cdev)
    dense[ids.to(cdev)] = values.to(cdev)
    mask[ids.to(cdev)] = 1
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
