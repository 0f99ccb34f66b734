"""Settings, decisions and counters of the DDP hook (:class:`SparseCommState`).

Shaped like PyTorch's ``PowerSGDState``: one state object per DDP model holds
the hook's settings (a :class:`~sparsecomm.hooks.config.HookConfig`), its
internal state (per-table decisions, the tuners, the step in flight) and its
statistics (per-path counters); it pickles without its process group.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from sparsecomm.collectives.dense import max_over_ranks, ring_allreduce_bytes
from sparsecomm.collectives.groups import comm_device, node_groups, twin_group
from sparsecomm.collectives.launchers import env_local_world_size
from sparsecomm.collectives.methods import InputRuns
from sparsecomm.collectives.probe import LinkProbe, measure_link
from sparsecomm.collectives.step_order import JoinShadow
from sparsecomm.hooks.classifier import Decision, choose_method, host_layout, method_costs
from sparsecomm.hooks.config import HookConfig
from sparsecomm.hooks.eager_trial import EagerTrial
from sparsecomm.hooks.step import StepWork
from sparsecomm.hooks.tuner import MethodTuner, candidates_near
from sparsecomm.hooks.unused import install_unused_table_hook
from sparsecomm.types import SparseSyncStats, SyncMethod

__all__ = ["SparseCommState", "PathStats"]

logger = logging.getLogger("sparsecomm")

_FUSABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_FUSED_DENSE_BYTES = 4 << 20  # above this, a ring allreduce's bytes win whatever the latency


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


class _Counters(collections.defaultdict):
    """``{path: PathStats}`` that prints as a table, not a defaultdict repr."""

    def __init__(self) -> None:
        super().__init__(PathStats)

    def __repr__(self) -> str:
        rows = [f"  {k:<22} calls={v.calls:<6} sent={v.bytes_sent / 1e6:.3f} MB  recv={v.bytes_recv / 1e6:.3f} MB  "
                f"time={v.seconds * 1e3:.1f} ms" for k, v in sorted(self.items())]
        return "sparsecomm paths:\n" + ("\n".join(rows) if rows else "  (no calls yet)")

    def __reduce__(self):
        return (_Counters, (), None, None, iter(self.items()))


class _Decisions(dict):
    """``{parameter name: Decision}`` that prints as one line per table: its path and why."""

    def __repr__(self) -> str:
        if not self:
            return "sparsecomm decisions: (none yet: a sparse=True table's first sync takes the partitioned path and measures)"
        width = max(len(k) for k in self)
        rows = [f"  {k:<{width}} -> {d.method.value:<11} {d.reason}" for k, d in sorted(self.items())]
        return "sparsecomm decisions:\n" + "\n".join(rows)


def _setting(name: str) -> property:
    """``state.<name>``: the config's setting; assigning one re-validates (a new config, as the old one is frozen)."""

    def get(self: "SparseCommState") -> Any:
        return getattr(self.config, name)

    def set_(self: "SparseCommState", value: Any) -> None:
        # A state made without __init__ (a decision tested alone) starts from the defaults.
        self.config = replace(getattr(self, "config", None) or HookConfig(), **{name: value})

    return property(get, set_, doc=f"``config.{name}`` (see :class:`HookConfig`).")


class SparseCommState:
    r"""Settings, decisions and counters of :func:`sparsecomm.sparsecomm_hook`.

    Args:
        process_group: the DDP model's group (default group when None).
        model: the DDP model (or its module), to name parameters in logs and
            overrides, find dense-gradient embeddings, and keep embeddings that
            a step does not use from breaking DDP (a forward hook), and,
            under ``Join``, find the model's sharded tables for a joined
            rank to shadow. Without it, all sparse buckets of a step are
            still synchronized together, but a sparse table unused in a
            step fails inside DDP as it does without the hook.
        config: the tunable settings (:class:`HookConfig`; default: its defaults).
        link: the link this job already measured on the same group (an
            earlier state's ``link``, as ``sparsecomm.replan`` passes when it
            builds DDP again): taken instead of measuring again.
        **options: :class:`HookConfig` fields (``compression="bf16"``, ...),
            applied over ``config``.

    The settings read as ``state.config`` and, as attributes, ``state.compression``
    and the like. ``local_world_size`` and ``latency_bytes`` are the values
    in use: the launcher's node size where the config leaves it None, the
    measured price of a collective where the config has none.

    Raises:
        ValueError: a bad setting (see :class:`HookConfig`), or an override
            the group's backend cannot run.
        TypeError: an option that is not a :class:`HookConfig` field.
    """

    __slots__ = (
        # tunable settings
        "config", "process_group",
        # internal state
        "world_size", "local_world_size", "latency_bytes", "link", "_backend", "_sparse_group", "_tuners",
        "param_names", "dense_embedding_names", "row_tables", "decisions", "iteration", "_decided_at", "_calls",
        "_suggested",
        "step", "_capacity", "_lock", "_module", "eager_trial",
        # statistics
        "stats", "step_stats", "history",
    )

    compression = _setting("compression")
    sparse_compression = _setting("sparse_compression")
    overrides = _setting("overrides")
    sparse_dense_embeddings = _setting("sparse_dense_embeddings")
    scheme = _setting("scheme")
    local_aggregation = _setting("local_aggregation")
    nonfinite = _setting("nonfinite")
    reclassify_every = _setting("reclassify_every")
    overlap_sparse = _setting("overlap_sparse")
    eager_sparse = _setting("eager_sparse")
    fuse_dense = _setting("fuse_dense")
    tune = _setting("tune")
    tune_samples = _setting("tune_samples")
    tune_every = _setting("tune_every")

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, model: Optional[nn.Module] = None,
                 config: Optional[HookConfig] = None, link: Optional[LinkProbe] = None, **options: Any) -> None:
        config = replace(config, **options) if config is not None else HookConfig(**options)
        self.config = config
        self.process_group = process_group
        self._backend = dist.get_backend(process_group)
        if self._backend != "gloo" and "torch" in config.overrides.values():
            raise ValueError("override 'torch' (the backend's sparse all_reduce) needs a gloo group")
        self.world_size = dist.get_world_size(process_group)
        local_world_size = config.local_world_size
        if local_world_size is None and (process_group is None or process_group is dist.GroupMember.WORLD):
            local_world_size = env_local_world_size()  # what the launcher says, as sparse_allreduce does
        self.local_world_size = local_world_size
        self._sparse_group = None
        self.sparse_group  # collective: create the hook's groups now, on every rank, not mid-backward
        self.link: Optional[LinkProbe] = link
        if config.latency_bytes is None and link is not None:
            self.latency_bytes = link.latency_bytes
        elif config.latency_bytes is None:
            self.link = measure_link(self.sparse_group, ranks_per_host=host_layout(self.world_size,
                                                                                   local_world_size))
            self.latency_bytes = self.link.latency_bytes
        else:
            self.latency_bytes = float(config.latency_bytes)
        self._tuners: Dict[str, MethodTuner] = {}
        self.eager_trial: Optional[EagerTrial] = None   # eager_sparse='auto': the measured mode
        self._module: Optional[weakref.ref] = None
        self._init_runtime()
        self.param_names: Dict[int, str] = {}
        self.dense_embedding_names: Dict[str, Tuple[int, int]] = {}
        # Whether the model has trainable embedding tables, whose rows make a step's sparse exchange (unknown
        # without a model: assumed so). Without them a dense bucket has no exchange to ride in.
        self.row_tables = True
        self.decisions: Dict[str, Decision] = _Decisions()
        self.iteration = 0
        self._decided_at: Dict[str, int] = {}
        self._calls: Dict[str, int] = {}  # sparse syncs per parameter, counted on the autograd thread
        self._suggested: set = set()
        self.stats: Dict[str, PathStats] = _Counters()
        self.step_stats: Dict[str, PathStats] = _Counters()
        self.history: Deque[Dict[str, PathStats]] = collections.deque(maxlen=config.history)
        if model is not None:
            self.attach(model)

    def _init_runtime(self) -> None:
        self.step = StepWork()                # what this backward has in flight (not pickled)
        self._capacity: Dict[Any, List[int]] = {}  # per set of tensors: rows to reserve (one-collective allgather)
        self._lock = threading.Lock()         # counters are updated from the autograd and the worker thread

    @property
    def sparse_group(self) -> dist.ProcessGroup:
        """The hook's own group for sparse work: a twin of ``process_group`` that no other code uses."""
        if self._sparse_group is None:
            self._sparse_group = twin_group(self.process_group, purpose="ddp-hook")
            lws = self.local_world_size
            if lws and self.config.local_aggregation and 1 < lws < self.world_size and self.world_size % lws == 0:
                node_groups(self._sparse_group, lws)  # collective: build now
        return self._sparse_group

    # ------------------------------------------------------------- model link

    def attach(self, model: nn.Module) -> None:
        """Learn parameter names and embedding kinds from ``model`` (a DDP model or its module).

        Also installs the forward hook that keeps sparse tables a step does not
        use from breaking DDP (see :mod:`sparsecomm.hooks.unused`).
        """
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        unknown = set(self.config.overrides)
        for name, p in module.named_parameters():
            self.param_names[p.data_ptr()] = name
            unknown.discard(name)
        if unknown:
            raise ValueError(f"overrides name parameters the model does not have: {sorted(unknown)}")
        tables = [(mod_name, mod) for mod_name, mod in module.named_modules()
                  if isinstance(mod, (nn.Embedding, nn.EmbeddingBag))]
        for mod_name, mod in tables:
            if not mod.sparse:
                self.dense_embedding_names[f"{mod_name}.weight" if mod_name else "weight"] = tuple(mod.weight.shape)
        self.row_tables = any(mod.weight.requires_grad for _, mod in tables)
        self.step.clears_empty = install_unused_table_hook(module) > 0
        self._module = weakref.ref(module)

    def shadow_join(self) -> None:
        """On a rank that joined (uneven inputs), take part in the collectives its peers' step makes outside DDP:
        every lookup-round set of the model's sharded tables, in module order (collective).

        The hook calls it at a joined rank's first shadowed bucket, before its own fused sync, which is
        the order the peers' step issues them in.
        """
        module = self._module() if self._module is not None else None
        if module is None:
            return
        seen = set()
        for m in module.modules():
            rounds = getattr(m, "table_set", None)
            if isinstance(rounds, JoinShadow) and id(rounds) not in seen:
                seen.add(id(rounds))
                rounds.shadow_step()

    def summary(self) -> str:
        """Describe what the hook did so far, for a person: steps, bytes and time per path, each table's path.

        ``print(state.stats)`` and ``print(state.decisions)`` show the two
        halves alone; the counters and ``Decision`` objects stay available as
        data (``state.stats["allgather"].bytes_sent``,
        ``state.decisions["emb.weight"].method``).

        Example::

            print(state.summary())
            # sparsecomm hook: 20 steps, world size 2, one collective ~ 3.2e+04 bytes
            # sparsecomm paths:
            #   allgather              calls=20     sent=0.655 MB  recv=0.655 MB  time=41.0 ms
            # sparsecomm decisions:
            #   emb.weight -> allgather   est. bytes/rank: partitioned 3.3e+04, allgather 3.3e+04, ...
        """
        link = (f", latency {self.link.latency_s * 1e3:.3g} ms, link {self.link.bytes_per_s / 1e6:.3g} MB/s "
                f"(L={self.link.ranks_per_host})" if self.link is not None else "")
        lines = [f"sparsecomm hook: {self.iteration} steps, world size {self.world_size}, "
                 f"one collective ~ {self.latency_bytes:.3g} bytes{link}", repr(self.stats), repr(self.decisions)]
        if self.eager_trial is not None:
            mode = {None: "fused per step until measured", True: "per bucket (eager)", False: "fused per step"}
            lines.append(f"sparse syncs: {mode[self.eager_trial.eager]} ({self.eager_trial.reason})")
        lines += self._dense_table_lines()
        forced = {k: v for k, v in self.config.overrides.items() if v != "auto"}
        if forced:
            lines.append("overrides (no decision): " + ", ".join(f"{k} -> {v}" for k, v in sorted(forced.items())))
        return "\n".join(lines)

    def _dense_table_lines(self) -> List[str]:
        """What the summary says of ``sparse=False`` tables: their gradient is the whole table, so no sparse path."""
        if not self.dense_embedding_names:
            return []
        if self.config.sparse_dense_embeddings:
            how = "their non-zero rows take the sparse path (sparse_dense_embeddings=True, path 'dense-embedding-rows')"
        else:
            how = ("each gradient is the whole table, allreduced with the dense buckets; build the table with "
                   "sparse=True for the sparse paths, or pass sparse_dense_embeddings=True to send only its "
                   "non-zero rows")
        names = ", ".join(f"{k} ({v[0]} x {math.prod(v[1:])})" for k, v in sorted(self.dense_embedding_names.items()))
        return [f"sparsecomm tables built with sparse=False: {names}:", f"  {how}"]

    def __repr__(self) -> str:
        return (f"SparseCommState(world_size={self.world_size}, steps={self.iteration}, "
                f"paths={sorted(self.stats)}, decisions={ {k: d.method.value for k, d in self.decisions.items()} })")

    # ---------------------------------------------------------------- pickling

    def __getstate__(self) -> Dict[str, Any]:
        # Like PowerSGDState: process groups do not pickle; the restored state
        # uses the default group. Parameter names are keyed by this process's
        # tensor addresses: call attach(model) again after unpickling.
        skip = {"process_group", "_sparse_group", "step", "_capacity", "_lock", "param_names", "_module"}
        return {k: getattr(self, k) for k in self.__slots__ if k not in skip}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.process_group = None
        self._sparse_group = None  # created on first use (a collective), not while unpickling
        self.param_names = {}
        self._module = None
        self._init_runtime()
        self.eager_trial = state.get("eager_trial")  # absent from states pickled before it existed
        if self.eager_trial is not None:
            self.eager_trial.pause()   # its clock was another process's: a phase cut here runs again

    # ------------------------------------------------------------- decisions

    def method_for(self, name: str) -> SyncMethod:
        """The path the next call for parameter ``name`` takes."""
        forced = self.config.overrides.get(name, "auto")
        if forced != "auto":
            return SyncMethod(forced)
        tuner = self._tuners.get(name)
        if tuner is not None:  # the call about to be counted by next_call: the same number on every rank
            chosen = tuner.method(self._calls.get(name, 0) + 1)
            if chosen is not None:
                return chosen
        decision = self.decisions.get(name)
        return decision.method if decision else SyncMethod.PARTITIONED  # measure first

    def maybe_decide(self, name: str, s: SparseSyncStats, elem_bytes: int, call: int,
                     seconds: Optional[float] = None) -> None:
        """Decide ``name``'s path from a completed sync's global counts (same numbers on every rank).

        ``seconds``: the sync's time on this rank, for the tuner (default: the
        sync's own measured phases, ``s.total_seconds``).
        """
        # `call` is this parameter's sync count, taken on the autograd thread in
        # program order: the same on every rank, unlike `iteration`.
        if self.config.overrides.get(name, "auto") != "auto":
            return
        tuner = self._tuners.get(name)
        if tuner is not None:
            if tuner.record(call, s.total_seconds if seconds is None else seconds):
                self._settle(name, tuner, s)
            return
        last = self._decided_at.get(name)
        if last is not None and not (self.config.reclassify_every and call - last >= self.config.reclassify_every):
            return
        n = s.world_size
        allowed = [m for m in SyncMethod if m is not SyncMethod.TORCH or self._backend == "gloo"]
        lws = host_layout(n, self.local_world_size)
        shape = (n, s.num_rows, s.row_bytes // elem_bytes, elem_bytes, s.index_bytes, s.rows_local_sum / max(1, n),
                 s.rows_out)
        # The input's ids and runs (every path counts them), to price the runs path.
        runs = InputRuns(s.rows_in_sum / max(1, n), s.runs_local_sum / max(1, n)) if s.rows_in_sum else None
        decision = choose_method(*shape, self.latency_bytes, allowed=allowed, link=self.link, ranks_per_host=lws,
                                 local_aggregation=self.config.local_aggregation, runs=runs)
        if self.config.tune and n > 1:
            costs = method_costs(*shape, allowed, self.latency_bytes, self.link, lws,
                                 local_aggregation=self.config.local_aggregation, runs=runs)
            candidates = candidates_near(costs, 4.0, allowed)
            if decision.method not in candidates:  # a fitted model's pick
                candidates.insert(0, decision.method)
            if len(candidates) > 1:
                self._tuners[name] = MethodTuner(candidates, start=call + 1, warmup=1,
                                                 samples=self.config.tune_samples, every=self.config.tune_every)
        previous = self.decisions.get(name)
        self.decisions[name] = decision
        self._decided_at[name] = call
        if previous is None or previous.method != decision.method:
            logger.info("sparsecomm: %s -> %s path: %s", name, decision.method.value, decision.reason)

    def _settle(self, name: str, tuner: MethodTuner, s: SparseSyncStats) -> None:
        """End an exploration phase: every rank's median per candidate, the slowest rank's counts (collective)."""
        group = self.sparse_group
        agreed = max_over_ranks(tuner.local_times(), group, self._agreement_device())  # under the group's timeout
        tried = list(tuner.trying)
        best = tuner.settle(agreed)
        previous = self.decisions.get(name)
        reason = ("measured ms/sync (slowest rank, median of %d): " % tuner.samples
                  + ", ".join(f"{m.value} {1e3 * t:.3g}" for m, t in zip(tried, agreed))
                  + f" (N={s.world_size}, k={s.rows_local_sum / max(1, s.world_size):.0f}, U={s.rows_out})")
        self.decisions[name] = Decision(best, reason, previous.estimated_bytes if previous else {})
        if previous is None or previous.method != best:
            logger.info("sparsecomm: %s -> %s path: %s", name, best.value, reason)

    def _agreement_device(self) -> torch.device:
        """Where a small agreement collective on the hook's group runs (a CUDA device for NCCL groups)."""
        like = torch.device("cuda", torch.cuda.current_device()) if self._backend != "gloo" and \
            torch.cuda.is_available() else torch.device("cpu")
        return comm_device(self.sparse_group, like)

    def fuses_dense(self, buffer: torch.Tensor) -> bool:
        """Should this dense bucket ride in the step's sparse exchange? (Same answer on every rank.)

        A model without embedding tables for the hook to sync (every table sharded, say) has no sparse
        exchange: the bucket would make one of its own. That pays only where the group's all-to-alls
        bypass the backend (shared memory, one host: 15% off the step at world 4 against gloo's
        all-reduce); through the backend it costs more CPU than the all-reduce (1.4 ms a step at 2 and 4
        emulated hosts, docs/DESIGN.md).
        """
        # With sparse_compression the fused bucket stays exact (the call compresses per tensor).
        if not self.config.fuse_dense or self.config.compression is not None or buffer.dtype not in _FUSABLE:
            return False
        link = self.link
        bypasses = link is not None and link.backend_latency_s is not None
        if not self.row_tables and not bypasses:
            return False
        n, nbytes = self.world_size, buffer.numel() * buffer.element_size()
        extra = (n - 1) * nbytes - ring_allreduce_bytes(buffer.numel(), buffer.element_size(), n)
        # Fusing saves the bucket's own all-reduce: on a group whose all-to-alls bypass the backend (shared
        # memory), that all-reduce costs the backend's latency, not the probe's all-to-all.
        saved = link.other_latency_s * link.bytes_per_s if bypasses else self.latency_bytes
        return nbytes <= _MAX_FUSED_DENSE_BYTES and extra <= saved

    def capacity_for(self, key: Any) -> Optional[List[int]]:
        """Rows to reserve per tensor for this set of tensors, from the last step (same on every rank)."""
        return self._capacity.get(key)

    def learn_capacity(self, key: Any, stats: List[SparseSyncStats]) -> None:
        """Next step's reservation: the largest k any rank had, plus 1/16 and 8 rows of slack."""
        self._capacity[key] = [s.rows_local_max + s.rows_local_max // 16 + 8 for s in stats]

    def hint_once(self, name: str) -> bool:
        """True the first time ``name`` asks: a hint about a table is logged once (kept when pickled)."""
        if name in self._suggested:
            return False
        self._suggested.add(name)
        return True

    def next_call(self, name: str) -> int:
        """Count a sync of parameter ``name`` (on the autograd thread, in program order) and return its number."""
        call = self._calls[name] = self._calls.get(name, 0) + 1
        return call

    @property
    def _measures_sync_mode(self) -> bool:
        """Whether ``eager_sparse='auto'`` applies: only where eager steps are safe to try. On NCCL the worker
        thread's syncs would interleave with DDP's allreduces on another communicator in an order that may differ
        between ranks; at world size 1 there is nothing to sync."""
        return self.config.eager_sparse == "auto" and self.world_size > 1 and self._backend == "gloo"

    @property
    def eager_undecided(self) -> bool:
        """Whether ``eager_sparse='auto'`` applies here and has not kept a mode yet (its first trial runs)."""
        return self._measures_sync_mode and (self.eager_trial is None or self.eager_trial.eager is None)

    @property
    def sync_mode_measuring(self) -> bool:
        """Whether ``eager_sparse='auto'`` is timing its modes around now (steps slower or faster than usual)."""
        return self._measures_sync_mode and (self.eager_trial is None or
                                             self.eager_trial.measuring(self.iteration + 1))

    def begin_step(self) -> bool:
        """At a step's first bucket, on every rank: does this step sync each sparse bucket as it arrives?"""
        step = self.iteration + 1   # steps close on every rank: the same number
        if not self._measures_sync_mode:
            if self.eager_trial is not None:
                self.eager_trial.pause()
            return self.config.eager_sparse is True
        if self.eager_trial is None:
            self.eager_trial = EagerTrial(self.config.tune_every, first_step=step)
        return self.eager_trial.begin(step)

    def end_step(self) -> None:
        """Close the step's counters into ``history`` (after all of its work has completed); where the
        eager/fused trial has timed its last step, agree on the mode (collective)."""
        with self._lock:
            self.history.append(dict(self.step_stats))
            self.step_stats = _Counters()
            self.iteration += 1   # first: the step numbers stay aligned across ranks even if the agreement fails
        if self.eager_trial is not None and self._measures_sync_mode:
            self.eager_trial.end(self.sparse_group, self._agreement_device())

    def record(self, path: str, sent: int, recv: int, seconds: float) -> None:
        """Add one call's bytes and time to ``path``'s counters, total and this step's."""
        with self._lock:
            self.stats[path].add(sent, recv, seconds)
            self.step_stats[path].add(sent, recv, seconds)
