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

import time
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from sparsecomm.collectives import methods
from sparsecomm.collectives.fused import fused_exchange
from sparsecomm.collectives.futures import then
from sparsecomm.collectives.groups import node_groups, run_async, twin_group
from sparsecomm.collectives.methods.base import SyncPath
from sparsecomm.collectives.sync_plan import SyncOptions, SyncPlan, TensorRows, prepare, unlinear
from sparsecomm.collectives.sync_wire import exchange_meta
from sparsecomm.types import PartitionScheme, ReduceOp, SparseSyncStats, SyncMethod

__all__ = ["sparse_allreduce", "sparse_allreduce_coalesced", "last_stats"]

_last_stats: Optional[SparseSyncStats] = None


def last_stats() -> Optional[SparseSyncStats]:
    """Statistics of the most recent :func:`sparse_allreduce` completed in this process."""
    return _last_stats


def sparse_allreduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                     op: Union[str, ReduceOp] = "sum", async_op: bool = False, *,
                     scheme: Union[str, PartitionScheme] = "hash", local_world_size: Optional[int] = None,
                     local_aggregation: bool = True, method: Union[str, SyncMethod] = "partitioned",
                     nonfinite: str = "raise", stats: Optional[SparseSyncStats] = None,
                     compression: Optional[str] = None) -> Union[torch.Tensor, torch.futures.Future]:
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
            ``all_reduce``, gloo only, then coalesced) or ``"tree"``
            (recursive doubling, merging rows at each of log2 N stages:
            fewest bytes when ranks' rows barely overlap, most so between
            hosts; 2 + 2 log2 N messages) or ``"runs"`` (an allgather of
            the input as it is, each run of equal consecutive rows sent once
            with its length: a sum-pooled ``EmbeddingBag``'s gradient, whose
            bags repeat one row per id, in fewer bytes than coalesced rows).
            All give the same rows and, up to floating-point summation
            order, the same sums.
        nonfinite: ``"raise"`` (default): any NaN/Inf in any rank's values
            raises ``ValueError`` on every rank before the exchange (checked
            with one sum over the coalesced rows, exactly only when that sum
            is not finite); ``"propagate"``: sum them like ``all_reduce``
            does (e.g. for AMP's overflow detection).
        stats: a :class:`SparseSyncStats` to fill (bytes, rows, phase times).
        compression: None (default: exact) or ``"bf16"`` / ``"fp16"``: the
            value rows travel in that dtype (half the bytes of float32) on
            the partitioned, allgather, runs, two-level and tree paths; owners (and
            the tree's merges) sum them in float32 and round the sums once to
            the wire dtype for the way back; the result has the input's dtype.
            Every element is then within ``2 u sum_i |x_i|`` of the exact sum
            (u: the wire dtype's unit roundoff, 2**-8 for bf16, 2**-11 for
            fp16; two-level and tree paths round once per level or stage
            more), and fp16 overflows beyond 65504. densify and torch ignore
            it (their sums are the backend's). Every rank must pass the same.

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
                                     method=method, nonfinite=nonfinite, stats=None if stats is None else [stats],
                                     compression=compression)
    if async_op:
        return then(out, lambda f: f.value()[0])
    return out[0]


def sparse_allreduce_coalesced(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                               op: Union[str, ReduceOp] = "sum", async_op: bool = False, *,
                               scheme: Union[str, PartitionScheme] = "hash",
                               local_world_size: Optional[int] = None, local_aggregation: bool = True,
                               method: Union[str, SyncMethod, Sequence[Union[str, SyncMethod]]] = "partitioned",
                               nonfinite: str = "raise", stats: Optional[Sequence[SparseSyncStats]] = None,
                               capacity: Optional[Sequence[int]] = None,
                               compression: Union[Optional[str], Sequence[Optional[str]]] = None
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
        capacity: when every tensor takes the allgather path, rows to reserve
            per rank and tensor (the same on every rank, e.g. from the last
            call's ``rows_local_max``): metadata and rows then travel in ONE
            all-to-all, each rank's rows zero-padded to the capacity. If any
            rank holds more, every rank sees it and the call falls back to
            the two-collective path (correct either way).
        compression: as for :func:`sparse_allreduce`, for all tensors, or
            one per tensor (None keeps that tensor exact).
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
    plan = SyncPlan.build(tensors, group, SyncOptions(op, scheme, local_world_size, local_aggregation, methods,
                                                      nonfinite, capacity, compression))
    paths = _paths(plan, group)
    hierarchical = any(p.hierarchical for p in paths)
    if hierarchical:
        node_groups(group, plan.local_world_size)  # collective creation, in the caller's program order

    def job(g=group) -> List[torch.Tensor]:
        global _last_stats
        out = _sync(tensors, paths, plan.on(g), stats)
        _last_stats = stats[-1] if stats else None
        return out

    if not async_op:
        return job()
    twin = twin_group(group)
    if hierarchical:
        node_groups(twin, plan.local_world_size)
    return run_async(lambda: job(twin), group=twin, device=plan.device)


# ------------------------------------------------------------------- the call


def _paths(plan: SyncPlan, group: Optional[dist.ProcessGroup]) -> List[SyncPath]:
    """Each tensor's path (flat, or its hierarchical variant when the call aggregates in nodes), checked."""
    paths = [methods.path_for(m, plan.aggregates_in_nodes) for m in plan.methods]
    for p in paths:
        if p.backend is not None and dist.get_backend(group) != p.backend:
            raise ValueError(f"method={p.method.value!r} ({p.name} path) needs a {p.backend} group")
    return paths


def _one_collective(tensors: List[TensorRows], plan: SyncPlan):
    """Metadata and rows in one collective, where every tensor's path offers it and capacities were given."""
    if not tensors or plan.capacity is None:
        return None
    first = tensors[0].path
    if first.with_metadata is None or any(t.path is not first for t in tensors):
        return None
    return first.with_metadata(tensors, plan)


def _sync(tensors: List[torch.Tensor], paths: List[SyncPath], plan: SyncPlan, stats: List[SparseSyncStats]
          ) -> List[torch.Tensor]:
    clock = time.perf_counter
    t0 = clock()
    wire = plan.wire_dtypes or [None] * len(tensors)
    rows = [prepare(t, p, plan, s, w) for t, p, s, w in zip(tensors, paths, stats, wire)]
    t1 = clock()
    results: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(rows)
    one = _one_collective(rows, plan)
    if one is not None:  # metadata and rows in one collective
        peers, results = one
    else:
        peers = exchange_meta(rows, plan) if rows else []
    for t, p in zip(rows, peers):
        t.stats.rows_local_sum, t.stats.rows_local_max = sum(p.k), max(p.k)
        t.stats.rows_in_sum, t.stats.runs_local_sum = sum(p.ids), sum(p.runs)
    t2 = clock()
    fused = [i for i, t in enumerate(rows) if t.fused]
    if fused and one is None:
        for i, out in zip(fused, fused_exchange([rows[i] for i in fused], [peers[i] for i in fused], plan)):
            results[i] = out
    t3 = clock()
    for i, t in enumerate(rows):
        if results[i] is None:
            results[i] = t.path.run(t, peers[i], plan)
    t4 = clock()
    outs = []
    for t, (ids, values) in zip(rows, results):
        t.stats.rows_out = ids.shape[0]
        outs.append(torch.sparse_coo_tensor(unlinear(ids.long(), t.sparse_shape), values.to(t.tensor.dtype),
                                            tuple(t.tensor.shape), dtype=t.tensor.dtype, device=t.tensor.device,
                                            is_coalesced=True, check_invariants=False))
    t5 = clock()
    share = 1.0 / max(1, len(rows))  # shared phases are split evenly between the tensors
    for t in rows:
        t.stats.add_time("coalesce", (t1 - t0) * share)
        t.stats.add_time("metadata", (t2 - t1) * share)
        t.stats.add_time("exchange", ((t3 - t2) * share if t.fused else 0.0))
        t.stats.add_time("assemble", (t5 - t4) * share)
    for t in rows:
        if not t.fused:
            t.stats.add_time("exchange", (t4 - t3) / max(1, len(rows) - len(fused)))
    return outs
