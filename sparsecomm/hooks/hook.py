"""DDP communication hook: dense buckets -> allreduce, all sparse buckets of a step -> one fused sparse sync.

Shaped like PyTorch's ``torch/distributed/algorithms/ddp_comm_hooks``: the hook
is a plain function ``sparsecomm_hook(state, bucket) -> Future[Tensor]``; all
settings and counters live in :class:`~sparsecomm.hooks.state.SparseCommState`.

DDP gives every sparse parameter a bucket of its own and calls the hook once
per bucket, in bucket order, on every rank. Instead of one synchronization
(four collectives) per table, the hook holds the sparse buckets of a step and
synchronizes them together with :func:`sparse_allreduce_coalesced`: four
collectives per step whatever the number of tables, two when every table
takes the allgather path. Small dense buckets ride in the same exchange (see
``HookConfig.fuse_dense``). DDP only waits for the futures in its finalize,
after the graph; embeddings are the last gradients backward produces, so
holding them costs (almost) no overlap.

When the fused sync runs depends on where DDP calls the hook from:

- from the backward's graph (a bucket became ready): once the graph has run,
  from the engine callback of :mod:`sparsecomm.collectives.step_order`, after
  the sharded tables' gradient pushes and before DDP's finalize. Every rank
  then issues it at the same point, whatever the order in which its graph
  made the gradients ready (a table unused on one rank, a sharded table
  beside a replicated one);
- from DDP's first ``static_graph=True`` iteration, which calls the hook for
  every bucket from an engine callback, each with ``index() == 0`` and none
  ``is_last()``, and waits for the futures right after: each bucket at once;
- from DDP's ``Join`` hook on a rank that ran out of inputs (no backward
  pass, zero buckets in the peers' order): that rank first shadows its
  peers' sharded lookup rounds (:class:`~sparsecomm.collectives.step_order.JoinShadow`),
  then joins the fused sync at the last bucket with empty tensors.

Errors reach the user with their own type and message. A Future completed
with ``set_exception`` reaches DDP's C++ reducer as a *value* ("Unable to
cast ... to Tensor"), so the hook completes every future with a tensor
(the local one when the sync failed), records the error, and raises it when
the step closes: from ``loss.backward()`` after DDP's finalize (the model
stays usable; the failed gradients are reset to None), or from the joined
rank's last bucket.

Example::

    ddp = DistributedDataParallel(model)
    state = sparsecomm.register(ddp)                   # or, the PyTorch way:
    # ddp.register_comm_hook(SparseCommState(model=ddp), sparsecomm_hook)
"""

# No `from __future__ import annotations`: DDP checks that the hook's bucket
# annotation *is* dist.GradBucket, which string annotations fail.
import enum
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from sparsecomm.collectives.dense import COMPRESSION_DTYPES, all_finite, allreduce_mean_async, ring_allreduce_bytes
from sparsecomm.collectives.futures import then
from sparsecomm.collectives.groups import run_async
from sparsecomm.collectives.sparse import sparse_allreduce_coalesced
from sparsecomm.collectives.step_order import SYNC, after_backward, at_backward_end, current_backward, in_graph
from sparsecomm.hooks.dense_rows import dense_embedding_slices, nonzero_rows, param_name, write_rows
from sparsecomm.hooks.state import SparseCommState
from sparsecomm.hooks.step import PendingSync
from sparsecomm.hooks.unused import clear_empty_grads
from sparsecomm.types import SparseSyncStats, SyncMethod

__all__ = ["sparsecomm_hook", "register"]

DENSE = "dense"
DENSE_FUSED = "dense-fused"
SPARSE_ROWS = "dense-embedding-rows"


class _Mode(enum.Enum):
    """Where DDP calls the hook from."""

    GRAPH = "graph"        # a backward's graph (a gradient became ready): sync once the graph has run
    CALLBACK = "callback"  # the engine's final callbacks (DDP's first static-graph iteration): sync each bucket now
    JOINED = "joined"      # no backward: a rank that joined (uneven inputs) shadows its peers' collectives


def sparsecomm_hook(state: SparseCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP gradient bucket: sparse buckets join the step's fused sparse sync, dense ones allreduce.

    Args:
        state: the :class:`SparseCommState`.
        bucket: the DDP bucket.

    Returns:
        A Future of the averaged bucket (a coalesced sparse tensor for sparse buckets).

    Raises:
        Exception: on a joined rank, the step's error (inside a backward
            pass, it is raised from ``loss.backward()`` once DDP has finalized).
    """
    buffer = bucket.buffer()
    mode = _open_step(state)
    state.step.keep(bucket, buffer)   # their last reference goes on this thread (StepWork.keep)
    fut = _sparse_bucket(state, bucket, buffer) if buffer.is_sparse else _dense_bucket(state, bucket, buffer)
    state.step.track(fut)
    if mode is _Mode.CALLBACK:
        # Every bucket arrives with index 0 and none is last, and DDP's finalize waits for the
        # futures right after the last one: nothing can wait for a later bucket.
        _flush(state)
    elif buffer.is_sparse and state.step.eager:
        # This bucket now, on the worker thread, while the graph goes on; a joined rank's shadow
        # does the same, so every rank runs one sync per sparse bucket, in bucket order.
        _flush(state)
    if mode is _Mode.JOINED and bucket.is_last():
        _flush(state, wait=True)
        _close(state, joined=True)
    return fut


def _open_step(state: SparseCommState) -> _Mode:
    """Where the hook runs; at a step's first bucket, schedule the step's fused sync and its close."""
    backward = current_backward()
    mode = _Mode.JOINED if backward is None else _Mode.GRAPH if in_graph() else _Mode.CALLBACK
    if state.step.open(backward):
        state.step.eager = state.begin_step()  # every rank, this step's first bucket: the same answer
        if mode is _Mode.JOINED:
            try:
                state.shadow_join()  # the peers' sharded rounds come before the hook's sync
            except BaseException:
                state.step.close()  # the next shadowed step starts afresh
                raise
            return mode
        if mode is _Mode.GRAPH:
            # After every collective of the graph (sharded pushes) on every rank, before DDP's finalize.
            at_backward_end(SYNC, (), lambda: _flush(state))
        after_backward(lambda: _close(state))
    return mode


def _close(state: SparseCommState, joined: bool = False) -> None:
    """End the step (after DDP's finalize, or a joined rank's last bucket): counters, empty tables, its error."""
    step = state.step
    futures = step.take_futures()
    failed: Optional[BaseException] = None
    if joined:  # DDP waits for the futures after the last bucket: the dense allreduces' errors must be in
        try:
            torch.futures.wait_all(futures)
        except Exception as exc:  # the step still closes and counts: step numbers stay aligned with the peers
            failed = exc
    closed = step.close()
    if not joined:  # a joined rank's DDP assigns no gradient
        if step.claim_cleanup():
            clear_empty_grads(step.end_cleanup())
        for p in closed.failed:  # not synchronized: nothing to step with by mistake
            p.grad = None
    state.end_step()
    if closed.error is not None:
        raise closed.error
    if failed is not None:
        raise failed


def _fail(state: SparseCommState, item: PendingSync, error: BaseException) -> None:
    state.step.fail(error, item.params)
    item.future.set_result(item.fallback if item.fallback is not None else item.grad)


def _sparse_bucket(state: SparseCommState, bucket: dist.GradBucket, grad: torch.Tensor) -> torch.futures.Future:
    params = bucket.parameters()
    name = param_name(state, params[0], bucket, 0)
    method = state.method_for(name)

    def finish(out: torch.Tensor) -> torch.Tensor:
        if out._nnz() == 0:
            # No rank touched the table: like single-process training, leave
            # its .grad None (see hooks.unused).
            state.step.note_empty(params[0])
        return out

    return state.step.hold(PendingSync(name, grad, method, method.value, state.next_call(name), finish, params))


def _flush(state: SparseCommState, wait: bool = False) -> None:
    """Synchronize every sparse tensor held this step in one call; complete each one's future.

    A failure completes the futures with their fallback values and is
    recorded: the step raises it when it closes (see :func:`_close`).
    ``wait``: return only once the futures are complete.
    """
    items = state.step.take_held()
    if not items:
        return
    tensors = [it.grad for it in items]
    stats = [SparseSyncStats() for _ in items]
    group = state.sparse_group
    start = time.perf_counter()
    # All on the allgather path (the common case at a few ranks): metadata and
    # rows in one collective, each rank's rows padded to last step's largest k.
    key = tuple((it.name, it.method) for it in items)
    allgather = all(it.method is SyncMethod.ALLGATHER for it in items)
    capacity = state.capacity_for(key) if allgather else None
    if capacity is not None:   # a fused dense bucket is one row on every rank, every step: no slack (a row is big)
        capacity = [1 if it.path == DENSE_FUSED else c for it, c in zip(items, capacity)]

    config = state.config

    def job() -> List[torch.Tensor]:
        return sparse_allreduce_coalesced(tensors, group, op="avg", method=[it.method for it in items],
                                          scheme=config.scheme, local_world_size=state.local_world_size or 1,
                                          local_aggregation=config.local_aggregation, nonfinite=config.nonfinite,
                                          stats=stats, capacity=capacity,
                                          compression=[None if it.path == DENSE_FUSED else config.sparse_compression
                                                       for it in items])

    state.step.keep(items, tensors, stats)
    if config.overlap_sparse or state.step.eager:   # eager: every sync of the group on its worker thread
        fut = run_async(job, group=group, device=tensors[0].device)
    else:
        fut = torch.futures.Future()
        try:
            fut.set_result(job())
        except Exception as exc:  # delivered like an async failure
            fut.set_exception(exc)

    def deliver(f: torch.futures.Future) -> None:
        try:
            outs = f.value()
        except Exception as exc:
            for it in items:
                _fail(state, it, exc)
            return
        state.step.keep(outs)
        share = (time.perf_counter() - start) / len(items)
        if allgather:
            state.learn_capacity(key, stats)
        for it, out, s in zip(items, outs, stats):
            try:
                state.record(it.path, s.bytes_sent, s.bytes_recv, share)
                if it.decide:
                    state.maybe_decide(it.name, s, it.grad.element_size(), it.call, seconds=share)
                value = it.finish(out)
            except Exception as exc:
                _fail(state, it, exc)
            else:
                it.future.set_result(value)

    # Not through futures.then: ``fut`` completes on the hook group's worker (its job, counted until the
    # future is complete: sparsecomm.collectives.futures) or is complete already (deliver runs here).
    fut.add_done_callback(deliver)
    if wait:
        torch.futures.wait_all([it.future for it in items])


def _dense_bucket(state: SparseCommState, bucket: dist.GradBucket, buffer: torch.Tensor) -> torch.futures.Future:
    start = time.perf_counter()
    slices = dense_embedding_slices(state, bucket, buffer)
    if slices:
        return _dense_with_rows(state, bucket, buffer, slices, start)
    params = bucket.parameters()
    if state.fuses_dense(buffer):
        # A small bucket rides in the step's sparse exchange as one row every
        # rank sends to every rank: no collective of its own.
        row = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long, device=buffer.device), buffer.view(1, -1),
                                      (1, buffer.numel()), is_coalesced=True, check_invariants=False)
        return state.step.hold(PendingSync(f"bucket{bucket.index()}", row, SyncMethod.ALLGATHER, DENSE_FUSED, 0,
                                           lambda out: _finish_dense(state, buffer.copy_(out._values().view(-1)),
                                                                     bucket, None, start),
                                           params, buffer, decide=False))
    fut = allreduce_mean_async(buffer, state.process_group, state.config.compression)
    wire = COMPRESSION_DTYPES[state.config.compression]
    elem = wire.itemsize if wire is not None else buffer.element_size()
    nbytes = ring_allreduce_bytes(buffer.numel(), elem, state.world_size)
    return _then(state, fut, params, buffer, lambda f: _finish_dense(state, f.value(), bucket, nbytes, start))


def _then(state: SparseCommState, fut: torch.futures.Future, params: Sequence[torch.Tensor], buffer: torch.Tensor,
          fn: Callable[[torch.futures.Future], torch.Tensor]) -> torch.futures.Future:
    """``fut.then(fn)``, with an error of ``fn`` recorded for the step (raised when it closes) instead of
    completing the future with it: DDP reads a failed future's error as its value ("Unable to cast")."""

    def guarded(f: torch.futures.Future) -> torch.Tensor:
        try:
            return fn(f)
        except Exception as exc:
            state.step.fail(exc, params)
            return buffer

    return then(fut, guarded)


def _dense_with_rows(state: SparseCommState, bucket: dist.GradBucket, buffer: torch.Tensor,
                     slices: List[Tuple[str, int, int, int]], start: float) -> torch.futures.Future:
    """Embeddings with dense gradients: their non-zero rows join the step's sparse sync; everything else in
    the bucket goes through one allreduce."""
    params = bucket.parameters()
    rest_parts, futs = [], []
    cursor = 0
    for name, offset, num_rows, dim in slices:
        if offset > cursor:
            rest_parts.append((cursor, offset))
        cursor = offset + num_rows * dim
        table = buffer[offset:cursor].view(num_rows, dim)
        futs.append(state.step.hold(PendingSync(name, nonzero_rows(table), SyncMethod.PARTITIONED, SPARSE_ROWS,
                                                state.next_call(name), lambda out, table=table: write_rows(table, out),
                                                params, decide=False)))
    if cursor < buffer.numel():
        rest_parts.append((cursor, buffer.numel()))
    rest = torch.cat([buffer[a:b] for a, b in rest_parts]) if rest_parts else buffer.new_zeros(0)
    state.step.keep(rest)
    futs.append(allreduce_mean_async(rest, state.process_group, state.config.compression))

    def combine(f: torch.futures.Future) -> torch.Tensor:
        reduced = f.value()[-1].value()
        pos = 0
        for a, b in rest_parts:
            buffer[a:b].copy_(reduced[pos:pos + b - a])
            pos += b - a
        nbytes = ring_allreduce_bytes(rest.numel(), rest.element_size(), state.world_size)
        return _finish_dense(state, buffer, bucket, nbytes, start)

    return _then(state, torch.futures.collect_all(futs), params, buffer, combine)


def _finish_dense(state: SparseCommState, result: torch.Tensor, bucket: dist.GradBucket, nbytes: Optional[int],
                  start: float) -> torch.Tensor:
    if state.config.nonfinite == "raise" and not all_finite(result):
        # Checked on the reduced bucket, which is the same on every rank: all ranks raise together.
        names = [param_name(state, p, bucket, i) for i, p in enumerate(bucket.parameters())]
        raise ValueError(f"sparsecomm: NaN/Inf in the averaged gradients of {names} (some rank produced a "
                         f"non-finite gradient). Use nonfinite='propagate' (the default) to let them through "
                         f"(e.g. with AMP's GradScaler).")
    if nbytes is not None:  # a fused bucket is counted with the step's sparse sync
        state.record(DENSE, nbytes, nbytes, time.perf_counter() - start)
    return result


def register(ddp_model: nn.parallel.DistributedDataParallel, process_group: Optional[dist.ProcessGroup] = None,
             **options: Any) -> SparseCommState:
    """Register :func:`sparsecomm_hook` on a DDP model and return its state.

    The same as ``ddp_model.register_comm_hook(SparseCommState(process_group, model=ddp_model, **options),
    sparsecomm_hook)``, plus a check that no sparsecomm hook is registered yet.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        process_group: the group DDP uses (default: the default group).
        **options: :class:`SparseCommState` options: ``config=HookConfig(...)`` and/or its fields
            (compression, overrides, ...).

    Returns:
        The :class:`SparseCommState`: decisions and counters live there.

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel model.
        RuntimeError: a communication hook is already registered on it.
        ValueError: a bad option.

    Example::

        >>> ddp = DistributedDataParallel(model)
        >>> state = sparsecomm.register(ddp, compression="bf16")
        >>> ... train ...; print(state.stats)
    """
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(f"sparsecomm.register needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}; wrap it first: DistributedDataParallel(model)")
    if getattr(ddp_model, "_sparsecomm_state", None) is not None:
        raise RuntimeError("sparsecomm.register: a sparsecomm hook is already registered on this DDP model "
                           "(DDP allows one communication hook per model)")
    state = SparseCommState(process_group, model=ddp_model, **options)
    ddp_model.register_comm_hook(state, sparsecomm_hook)
    ddp_model._sparsecomm_state = state
    return state
