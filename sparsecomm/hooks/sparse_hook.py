"""DDP communication hook: dense buckets -> allreduce, sparse buckets -> the partitioned PS path.

Shaped like PyTorch's ``torch/distributed/algorithms/ddp_comm_hooks``: the hook
is a plain function ``sparsecomm_hook(state, bucket) -> Future[Tensor]``; all
settings and counters live in :class:`SparseCommState`.

Example::

    ddp = DistributedDataParallel(model)
    state = sparsecomm.register(ddp)                   # or, the PyTorch way:
    # ddp.register_comm_hook(SparseCommState(model=ddp), sparsecomm_hook)
"""

# No `from __future__ import annotations`: DDP checks that the hook's bucket
# annotation *is* dist.GradBucket, which string annotations fail.
import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from sparsecomm.collectives.dense import COMPRESSION_DTYPES, allreduce_mean_async, ring_allreduce_bytes
from sparsecomm.collectives.groups import env_local_world_size, node_groups, twin_group
from sparsecomm.collectives.sparse import sparse_allreduce
from sparsecomm.hooks.classifier import Decision, choose_method
from sparsecomm.types import PartitionScheme, SparseSyncStats, SyncMethod

__all__ = ["SparseCommState", "PathStats", "sparsecomm_hook", "register"]

logger = logging.getLogger("sparsecomm")

_OVERRIDES = {"auto", *(m.value for m in SyncMethod)}
DENSE = "dense"
SPARSE_ROWS = "dense-embedding-rows"


@dataclass
class PathStats:
    """Counters of one communication path."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0

    def add(self, sent: int, recv: int, seconds: float) -> None:
        self.calls += 1
        self.bytes_sent += sent
        self.bytes_recv += recv
        self.seconds += seconds


class SparseCommState:
    r"""Settings, decisions and counters of :func:`sparsecomm_hook`.

    Args:
        process_group: the DDP model's group (default group when None).
        model: the DDP model (or its module), to name parameters in logs and
            overrides, find dense-gradient embeddings, and keep embeddings that
            a step does not use from breaking DDP. :func:`register` passes it.
        compression: None, "fp16" or "bf16": dense buckets travel in half
            precision (sparse rows always travel in their own dtype).
        overrides: ``{parameter name: "partitioned" | "allgather" | "densify" | "auto"}``.
        sparse_dense_embeddings: for embeddings trained with dense gradients
            (``sparse=False``), send only their non-zero rows through the
            sparse path (exact: zero rows stay zero). Off by default.
        scheme: row ownership of the partitioned path, "hash" or "range".
        local_world_size, local_aggregation: node layout for two-level
            aggregation (see :func:`sparsecomm.sparse_allreduce`); default:
            what the launcher says for the default group, else 1.
        nonfinite: "raise" (default: NaN/Inf in any gradient raises
            ``ValueError`` on every rank) or "propagate" (needed with AMP's
            ``GradScaler``, which looks for Inf itself).
        latency_bytes: the classifier's price of one collective, in bytes.
        reclassify_every: re-decide auto paths every this many steps (0: decide once).
        history: how many past steps of per-path counters to keep.
        overlap_sparse: run sparse syncs on sparsecomm's worker thread,
            overlapping the rest of backward (off by default: on the
            autograd thread they cost the same here, since embeddings are
            the last gradients backward produces, and keep torch and gloo
            work in one thread per process).

    Raises:
        ValueError: an unknown compression, override or scheme.
    """

    __slots__ = (
        # tunable settings
        "process_group", "compression", "overrides", "sparse_dense_embeddings", "scheme", "local_world_size",
        "local_aggregation", "nonfinite", "latency_bytes", "reclassify_every", "overlap_sparse",
        # internal state
        "world_size", "sparse_group", "param_names", "dense_embedding_names", "decisions", "iteration",
        "_decided_at", "_calls", "_suggested", "_empty_sparse", "_clear_empty", "_cleanup_queued", "_lock",
        # statistics
        "stats", "step_stats", "history",
    )

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, model: Optional[nn.Module] = None,
                 compression: Optional[str] = None, overrides: Optional[Dict[str, str]] = None,
                 sparse_dense_embeddings: bool = False, scheme: str = "hash",
                 local_world_size: Optional[int] = None, local_aggregation: bool = True,
                 nonfinite: str = "raise", latency_bytes: float = 64 * 1024, reclassify_every: int = 0,
                 history: int = 100, overlap_sparse: bool = False) -> None:
        if compression not in COMPRESSION_DTYPES:
            raise ValueError(f"compression must be 'fp16', 'bf16' or None, got {compression!r}")
        overrides = dict(overrides or {})
        for name, path in overrides.items():
            if path not in _OVERRIDES:
                raise ValueError(f"override for {name!r} must be one of {sorted(_OVERRIDES)}, got {path!r}")
        PartitionScheme(scheme)
        if nonfinite not in ("raise", "propagate"):
            raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
        if reclassify_every < 0:
            raise ValueError("reclassify_every must be >= 0")
        self.process_group = process_group
        self.compression = None if compression == "none" else compression
        self.overrides = overrides
        self.sparse_dense_embeddings = sparse_dense_embeddings
        self.scheme = scheme
        self.local_aggregation = local_aggregation
        self.nonfinite = nonfinite
        self.latency_bytes = latency_bytes
        self.reclassify_every = reclassify_every
        self.overlap_sparse = overlap_sparse

        self.world_size = dist.get_world_size(process_group)
        if local_world_size is None and (process_group is None or process_group is dist.GroupMember.WORLD):
            local_world_size = env_local_world_size()  # what the launcher says, as sparse_allreduce does
        self.local_world_size = local_world_size
        # The sparse path runs off the autograd thread: give it a group of its
        # own so its collectives never interleave with the dense allreduces.
        self.sparse_group = twin_group(process_group)
        lws = local_world_size
        if lws and local_aggregation and 1 < lws < self.world_size and self.world_size % lws == 0:
            node_groups(self.sparse_group, lws)  # collective: build now, not mid-backward
        self.param_names: Dict[int, str] = {}
        self.dense_embedding_names: Dict[str, Tuple[int, int]] = {}
        self.decisions: Dict[str, Decision] = {}
        self.iteration = 0
        self._decided_at: Dict[str, int] = {}
        self._calls: Dict[str, int] = {}  # sparse syncs per parameter, counted on the autograd thread
        self._lock = threading.Lock()     # counters are updated from the autograd and the worker thread
        self._suggested: set = set()
        self._empty_sparse: List[nn.Parameter] = []
        self._clear_empty = False
        self._cleanup_queued = False

        self.stats: Dict[str, PathStats] = collections.defaultdict(PathStats)
        self.step_stats: Dict[str, PathStats] = collections.defaultdict(PathStats)
        self.history: Deque[Dict[str, PathStats]] = collections.deque(maxlen=history)
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------- model link

    def attach(self, model: nn.Module) -> None:
        """Learn parameter names and embedding kinds from ``model`` (a DDP model or its module)."""
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        unknown = set(self.overrides)
        for name, p in module.named_parameters():
            self.param_names[p.data_ptr()] = name
            unknown.discard(name)
        if unknown:
            raise ValueError(f"overrides name parameters the model does not have: {sorted(unknown)}")
        for mod_name, mod in module.named_modules():
            if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and not mod.sparse:
                self.dense_embedding_names[f"{mod_name}.weight" if mod_name else "weight"] = tuple(mod.weight.shape)

    # ---------------------------------------------------------------- pickling

    def __getstate__(self) -> Dict[str, Any]:
        # Like PowerSGDState: process groups do not pickle; the restored state uses the default group.
        skip = {"process_group", "sparse_group", "_empty_sparse", "_cleanup_queued", "_lock"}
        return {k: getattr(self, k) for k in self.__slots__ if k not in skip}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.process_group = None
        self.sparse_group = twin_group(None)
        self._empty_sparse = []
        self._cleanup_queued = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------- decisions

    def method_for(self, name: str) -> SyncMethod:
        """The path the next call for parameter ``name`` takes."""
        forced = self.overrides.get(name, "auto")
        if forced != "auto":
            return SyncMethod(forced)
        decision = self.decisions.get(name)
        return decision.method if decision else SyncMethod.PARTITIONED  # measure first

    def _maybe_decide(self, name: str, s: SparseSyncStats, elem_bytes: int, call: int) -> None:
        # `call` is this parameter's sync count, taken on the autograd thread in
        # program order: the same on every rank, unlike `iteration`, which the
        # worker thread advances.
        if self.overrides.get(name, "auto") != "auto":
            return
        last = self._decided_at.get(name)
        if last is not None and not (self.reclassify_every and call - last >= self.reclassify_every):
            return
        n = s.world_size
        decision = choose_method(n, s.num_rows, s.row_bytes // elem_bytes, elem_bytes, s.index_bytes,
                                 s.rows_local_sum / max(1, n), s.rows_out, self.latency_bytes)
        previous = self.decisions.get(name)
        self.decisions[name] = decision
        self._decided_at[name] = call
        if previous is None or previous.method != decision.method:
            logger.info("sparsecomm: %s -> %s path: %s", name, decision.method.value, decision.reason)

    def _end_step(self) -> None:
        with self._lock:
            self.history.append(dict(self.step_stats))
            self.step_stats = collections.defaultdict(PathStats)
            self.iteration += 1

    def _record(self, path: str, sent: int, recv: int, seconds: float) -> None:
        with self._lock:
            self.stats[path].add(sent, recv, seconds)
            self.step_stats[path].add(sent, recv, seconds)


# --------------------------------------------------------------------- hook


def sparsecomm_hook(state: SparseCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP gradient bucket: sparse buckets on the partitioned path, dense ones by allreduce.

    Args:
        state: the :class:`SparseCommState`.
        bucket: the DDP bucket.

    Returns:
        A Future of the averaged bucket (a coalesced sparse tensor for sparse buckets).
    """
    buffer = bucket.buffer()
    if bucket.is_last():
        # Counters close when the last bucket's work completes.
        fut = _sparse_bucket(state, bucket, buffer) if buffer.is_sparse else _dense_bucket(state, bucket, buffer)

        def close(f: torch.futures.Future) -> torch.Tensor:
            value = f.value()
            state._end_step()
            return value

        return fut.then(close)
    return _sparse_bucket(state, bucket, buffer) if buffer.is_sparse else _dense_bucket(state, bucket, buffer)


def _param_name(state: SparseCommState, p: torch.Tensor, bucket: dist.GradBucket, i: int) -> str:
    return state.param_names.get(p.data_ptr(), f"bucket{bucket.index()}.param{i}")


def _sparse_bucket(state: SparseCommState, bucket: dist.GradBucket, grad: torch.Tensor) -> torch.futures.Future:
    params = bucket.parameters()
    name = _param_name(state, params[0], bucket, 0)
    method = state.method_for(name)
    call = state._calls[name] = state._calls.get(name, 0) + 1
    if state._clear_empty and not state._cleanup_queued:
        # DDP queues its finalize (which waits for our futures and assigns the
        # gradients) after the last bucket's hook, i.e. after this callback.
        # Callbacks queued while the engine runs callbacks run after all those
        # already queued, so re-queue once to run after DDP's finalize.
        state._cleanup_queued = True
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(lambda: _clear_empty_grads(state)))
    s = SparseSyncStats()
    start = time.perf_counter()
    options = dict(op="avg", method=method, scheme=state.scheme, local_world_size=state.local_world_size or 1,
                   local_aggregation=state.local_aggregation, nonfinite=state.nonfinite, stats=s)
    if state.overlap_sparse:
        fut = sparse_allreduce(grad, state.sparse_group, async_op=True, **options)
    else:
        fut = torch.futures.Future()
        try:
            fut.set_result(sparse_allreduce(grad, state.sparse_group, **options))
        except Exception as exc:  # raised through DDP's backward like an async failure
            fut.set_exception(exc)

    def done(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()
        state._record(method.value, s.bytes_sent, s.bytes_recv, time.perf_counter() - start)
        state._maybe_decide(name, s, grad.element_size(), call)
        if out._nnz() == 0:
            # No rank touched the table: like single-process training, leave
            # its .grad None (see register's end-of-backward callback).
            state._empty_sparse.append(params[0])
        return out

    return fut.then(done)


def _dense_bucket(state: SparseCommState, bucket: dist.GradBucket, buffer: torch.Tensor) -> torch.futures.Future:
    start = time.perf_counter()
    group, n = state.process_group, state.world_size
    slices = _dense_embedding_slices(state, bucket, buffer)
    if not slices:
        fut = allreduce_mean_async(buffer, group, state.compression)
        wire = COMPRESSION_DTYPES[state.compression]
        elem = torch.empty(0, dtype=wire).element_size() if wire is not None else buffer.element_size()
        nbytes = ring_allreduce_bytes(buffer.numel(), elem, n)
        return fut.then(lambda f: _finish_dense(state, f.value(), bucket, DENSE, nbytes, nbytes, start))
    # Embeddings with dense gradients: their non-zero rows go through the sparse
    # path; everything else in the bucket through one allreduce.
    rest_parts, futs, row_stats = [], [], []
    cursor = 0
    for name, offset, num_rows, dim in slices:
        if offset > cursor:
            rest_parts.append((cursor, offset))
        cursor = offset + num_rows * dim
        table = buffer[offset:cursor].view(num_rows, dim)
        ids = (table != 0).any(dim=1).nonzero().view(-1)
        sp = torch.sparse_coo_tensor(ids[None], table.index_select(0, ids), (num_rows, dim), is_coalesced=True,
                                     check_invariants=False)
        s = SparseSyncStats()
        futs.append(sparse_allreduce(sp, state.sparse_group, op="avg", async_op=True, scheme=state.scheme,
                                     local_world_size=state.local_world_size or 1,
                                     local_aggregation=state.local_aggregation, nonfinite=state.nonfinite, stats=s))
        row_stats.append((table, s))
    if cursor < buffer.numel():
        rest_parts.append((cursor, buffer.numel()))
    rest = torch.cat([buffer[a:b] for a, b in rest_parts]) if rest_parts else buffer.new_zeros(0)
    futs.append(allreduce_mean_async(rest, group, state.compression))

    def combine(f: torch.futures.Future) -> torch.Tensor:
        results = [x.value() for x in f.value()]
        for (table, s), reduced in zip(row_stats, results[:-1]):
            table.zero_()
            table.index_copy_(0, reduced._indices()[0], reduced._values())
            state._record(SPARSE_ROWS, s.bytes_sent, s.bytes_recv, s.total_seconds)
        pos = 0
        for a, b in rest_parts:
            buffer[a:b].copy_(results[-1][pos:pos + b - a])
            pos += b - a
        nbytes = ring_allreduce_bytes(rest.numel(), rest.element_size(), n)
        return _finish_dense(state, buffer, bucket, DENSE, nbytes, nbytes, start)

    return torch.futures.collect_all(futs).then(combine)


def _dense_embedding_slices(state: SparseCommState, bucket: dist.GradBucket, buffer: torch.Tensor
                            ) -> List[Tuple[str, int, int, int]]:
    """(name, offset, rows, dim) of dense-gradient embedding weights in this bucket, by offset."""
    if not state.dense_embedding_names:
        return []
    out = []
    base = buffer.data_ptr()
    for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
        name = _param_name(state, p, bucket, i)
        if name not in state.dense_embedding_names or p.dim() != 2:
            continue
        offset = (g.data_ptr() - base) // buffer.element_size()
        if not state.sparse_dense_embeddings:
            _suggest_sparse_rows(state, name, buffer[offset:offset + p.numel()].view(p.shape))
            continue
        out.append((name, offset, p.shape[0], p.shape[1]))
    return sorted(out, key=lambda t: t[1])


def _suggest_sparse_rows(state: SparseCommState, name: str, grad: torch.Tensor) -> None:
    # Detection only (the first step): most rows zero means the sparse path would move far fewer bytes.
    if name in state._suggested:
        return
    state._suggested.add(name)
    touched = float((grad != 0).any(dim=1).float().mean())
    if touched < 0.1:
        logger.info("sparsecomm: %s has dense gradients but only %.2f%% of its rows are non-zero; "
                    "SparseCommState(sparse_dense_embeddings=True) sends only those rows (exact)",
                    name, 100 * touched)


def _finish_dense(state: SparseCommState, result: torch.Tensor, bucket: dist.GradBucket, path: str, sent: int,
                  recv: int, start: float) -> torch.Tensor:
    if state.nonfinite == "raise" and not bool(torch.isfinite(result).all()):
        # Checked on the reduced bucket, which is the same on every rank: all ranks raise together.
        names = [_param_name(state, p, bucket, i) for i, p in enumerate(bucket.parameters())]
        raise ValueError(f"sparsecomm: NaN/Inf in the averaged gradients of {names} (some rank produced a "
                         f"non-finite gradient). Pass nonfinite='propagate' to let them through (e.g. with AMP).")
    state._record(path, sent, recv, time.perf_counter() - start)
    return result


# ----------------------------------------------------------------- register


def _sparse_params(module: nn.Module) -> List[nn.Parameter]:
    return [m.weight for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]


def _touch_sparse_params(params: List[nn.Parameter]):
    """Forward hook: make every sparse table part of the graph with an empty lookup.

    DDP fails ("Expected sparse gradient to be defined") when a sparse
    embedding gets no gradient in a step, even with find_unused_parameters.
    An empty lookup adds exactly 0.0 to the output and gives the table an
    empty sparse gradient, so every rank takes part in its exchange.
    """

    def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
        target = _first_grad_tensor(output)
        if target is None:
            return output
        zero = sum(nn.functional.embedding(torch.zeros(0, dtype=torch.long, device=p.device), p, sparse=True).sum()
                   for p in params)
        return _replace_first_grad_tensor(output, target + zero.to(target.dtype))

    return hook


def _first_grad_tensor(obj: Any) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad and obj.is_floating_point() else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for x in items:
        t = _first_grad_tensor(x)
        if t is not None:
            return t
    return None


def _replace_first_grad_tensor(obj: Any, new: torch.Tensor) -> Any:
    done = [False]

    def walk(x: Any) -> Any:
        if done[0]:
            return x
        if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_floating_point():
                done[0] = True
                return new
            return x
        if isinstance(x, dict):
            return type(x)((k, walk(v)) for k, v in x.items())
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)


def register(ddp_model: nn.parallel.DistributedDataParallel, process_group: Optional[dist.ProcessGroup] = None,
             **options: Any) -> SparseCommState:
    """Register :func:`sparsecomm_hook` on a DDP model and return its state.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        process_group: the group DDP uses (default: the default group).
        **options: :class:`SparseCommState` settings (compression, overrides, ...).

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
    sparse = _sparse_params(ddp_model.module)
    if sparse:
        ddp_model.module.register_forward_hook(_touch_sparse_params(sparse))
        state._clear_empty = True
    return state


def _clear_empty_grads(state: SparseCommState) -> None:
    """Tables no rank touched this step get ``.grad = None``, as in single-process training.

    Optimizers treat an empty sparse gradient differently from none (SparseAdam
    and Adagrad count a step), so the empty gradient the forward hook created
    must not survive the step.
    """
    for p in state._empty_sparse:
        g = p.grad
        if g is not None and g.is_sparse and g._nnz() == 0:
            p.grad = None
    state._empty_sparse.clear()
    state._cleanup_queued = False
