"""Where each embedding table of a model lives: replicated under DDP, row-sharded, or whole on one rank.

:func:`plan` decides one :class:`TablePlan` per ``nn.Embedding`` /
``nn.EmbeddingBag`` of a single-process model, with its reason in numbers
(docs/PARALLELIZE.md):

- ``replicate``: the table stays a parameter under DDP; the sparsecomm hook
  synchronizes its gradient (fused with every other replicated table and the
  small dense buckets: no collective of its own).
- ``shard``: a :class:`~sparsecomm.sharded.ShardedEmbedding(Bag)` holds ~V/N
  rows per rank (scheme ``"hash"`` or ``"range"``) or the whole table on one
  rank (scheme ``"table"``, its ``owner``: table-wise) and updates them on
  their owner; every sharded table of the model shares one lookup round per
  step (4 all-to-alls in all).

The rule, in order (the first that applies):

1. a module option only a replica honours (``max_norm``,
   ``scale_grad_by_freq``), a frozen table, or one world rank: replicate;
2. a table whose replica does not fit ``memory_budget`` (tables placed
   largest first): shard; none fits: ``ValueError``;
3. smaller than ``small_table_bytes``: replicate (a replica is cheap and its
   rows ride in the hook's fused sync);
4. with a sample batch: the tables predicted cheaper sharded (lookup ids +
   rows + gradients, and the optimizer on U/N rows) than replicated (the
   hook's cheaper path: allgather or partitioned, and the optimizer on all U
   rows; the optimizer's time per row measured in the job, in link bytes:
   :mod:`sparsecomm.prices`) are sharded together when their summed saving beats the price of
   the lookup round's own collectives (2 all-to-alls a step, priced with the
   measured latency of one in bytes); without one: shard (large tables).

Then the sharded bag tables are placed table-wise (:func:`place_tables`)
when that moves fewer bytes through the busiest rank than row-sharding them:
an owner pools whole bags, so a rank receives one row per bag from one owner
instead of a partial bag from each of the N owners, and the tables spread
over the ranks (largest first, on the least loaded rank that has the memory).

A sample batch is measured with one collective: every rank's distinct ids per
table go to every rank, which computes the same union and skew, so every rank
reaches the same plan. Ranks whose models differ get ``ValueError`` on every rank;
a model already wrapped (DDP, FSDP1, or ``fully_shard`` at its root) gets
``TypeError`` on every rank (:func:`refuse_wrapped`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from sparsecomm.collectives.objects import all_gather_objects, world
from sparsecomm.ownership import owner_range_size, scheme_of
from sparsecomm.prices import ROUND_COLLECTIVES, measure_prices, predict
from sparsecomm.sample_batch import Sample, sample_ids, sample_problem
from sparsecomm.table_wise import ROWS_SPREAD, place_tables, pools_at_owner

__all__ = ["Plan", "TablePlan", "plan", "refuse_wrapped", "PLACEMENTS", "PLAN_FORMAT"]

PLACEMENTS = ("replicate", "shard")
PLAN_FORMAT = "sparsecomm.plan/1"
# Optimizer state per element of a table: SGD none, Adagrad one sum, Adam two moments.
_STATE_FACTOR = {"SGD": 0, "Adagrad": 1, "Adam": 2, "SparseAdam": 2}


@dataclasses.dataclass
class TablePlan:
    """One table's placement and the numbers behind it (per rank; bytes per step)."""

    name: str
    kind: str                        # "Embedding" or "EmbeddingBag"
    num_embeddings: int
    embedding_dim: int
    dtype: str
    placement: str = "replicate"     # "replicate" or "shard"
    scheme: str = "hash"             # row ownership when sharded ("hash", "range"; "table": all on ``owner``)
    owner: Optional[int] = None      # the rank holding the whole table under scheme "table"
    reason: str = ""
    memory_replicated: int = 0       # rows + optimizer state, one full replica
    memory_sharded: int = 0          # this rank's ~V/N rows + state + ownership map
    bytes_replicated: Optional[float] = None   # the hook's cheaper path, for the sample batch
    bytes_sharded: Optional[float] = None      # ids + rows + gradients of the sample batch
    bags: Optional[float] = None                # bags a rank looks up per step (bag tables, in the sample)
    bag_length: Optional[float] = None          # ids per bag (bag tables, in the sample)
    distinct: Optional[Tuple[int, ...]] = None  # distinct ids per rank in the sample batch
    union: Optional[int] = None
    optimizer_row_bytes: Optional[float] = None  # one row's optimizer work, in link bytes (sparsecomm.prices)
    measured_optimizer: bool = False             # that price was timed in the job (else a constant's)
    overridden: bool = False
    blocker: str = ""                # why this table cannot be sharded ("" when it can)

    @property
    def memory(self) -> int:
        """Bytes on the rank holding the most of it (a table-wise table's owner holds a whole replica)."""
        if self.placement != "shard":
            return self.memory_replicated
        return self.memory_replicated if self.scheme == "table" else self.memory_sharded

    def memory_on(self, rank: int) -> int:
        """Bytes of the table and its optimizer state on ``rank``."""
        if self.placement == "shard" and self.scheme == "table":
            return self.memory_replicated if rank == self.owner else 0
        return self.memory

    @property
    def where(self) -> str:
        """The placement in a few words: ``replicate``, ``shard (hash)``, ``shard (table: rank 1)``."""
        if self.placement != "shard":
            return self.placement
        return f"shard (table: rank {self.owner})" if self.scheme == "table" else f"shard ({self.scheme})"

    def owner_problem(self, world_size: int) -> Optional[str]:
        """Why this table's owner cannot hold it in a group of ``world_size`` ranks (table-wise only), or None."""
        if self.placement != "shard" or self.scheme != "table":
            return None
        try:
            owner_range_size("table", world_size, None, owner=self.owner)
        except ValueError as exc:
            return f"table {self.name!r} is planned whole on one rank: {exc}"
        return None

    @property
    def skew(self) -> Optional[float]:
        """Largest rank's distinct ids over the mean (1.0: balanced)."""
        if not self.distinct or not sum(self.distinct):
            return None
        return max(self.distinct) * len(self.distinct) / sum(self.distinct)


def _mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


@dataclasses.dataclass
class Plan:
    """Placements of every embedding table of a model (print it for the table and the reasons)."""

    tables: Dict[str, TablePlan]
    world_size: int
    optimizer: str = "SGD"
    memory_budget: Optional[int] = None
    latency_bytes: Optional[float] = None    # one collective's latency, in bytes of a large one

    def __getitem__(self, name: str) -> TablePlan:
        if name not in self.tables:
            raise KeyError(f"no table {name!r} in the plan (tables: {sorted(self.tables)})")
        return self.tables[name]

    def sharded(self) -> List[str]:
        """Names of the tables the plan shards, in model order."""
        return [n for n, t in self.tables.items() if t.placement == "shard"]

    def override(self, name: str, placement: str, scheme: Optional[str] = None, owner: Optional[int] = None
                 ) -> "Plan":
        """Place table ``name`` by hand; returns the plan.

        ``plan.override("t", "shard", "table", owner=1)`` puts the whole table
        on rank 1 (table-wise); ``"hash"`` / ``"range"`` shard its rows;
        without a scheme the table keeps its scheme (and owner).

        Raises:
            KeyError: no such table.
            ValueError: an unknown placement or scheme, a table that cannot
                be sharded (the reason names the module option), the table
                scheme without an owner in ``[0, world_size)``, or an owner
                with another scheme.
        """
        t = self[name]
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if scheme is not None:
            scheme = scheme_of(scheme).value
        if placement == "shard" and t.blocker:
            raise ValueError(f"table {name!r} cannot be sharded: {t.blocker}")
        if scheme is None:
            scheme = t.scheme
            owner = t.owner if owner is None and scheme == "table" and placement == "shard" else owner
        if placement == "shard" and scheme == "table":
            problem = dataclasses.replace(t, placement=placement, scheme=scheme, owner=owner).owner_problem(
                self.world_size)
            if problem:
                raise ValueError(problem)
        elif owner is not None:
            raise ValueError(f"table {name!r}: owner is for scheme 'table' (placement 'shard'); got owner={owner!r} "
                             f"with placement {placement!r}, scheme {scheme!r}")
        t.placement, t.overridden = placement, True
        t.scheme, t.owner = scheme, owner if scheme == "table" else None
        t.reason = "set by plan.override"
        return self

    def adopt_optimizer(self, optimizer: Any, modules: Dict[str, nn.Module], world_size: int) -> Optional[str]:
        """Make this the plan for training with ``optimizer`` (``parallelize``'s), in place; the former name.

        Placements stay; each table's memory and blockers are derived again
        for that optimizer's state and the memory budget checked again. Costs
        predicted from a sample batch keep the former optimizer's price (the
        caller warns). Returns None when the plan was already made for it.

        Raises:
            ValueError: the placements no longer fit the memory budget.
        """
        name, former = optimizer_name(optimizer), self.optimizer
        if name == former:
            return None
        for table, t in self.tables.items():
            fresh = _describe(table, modules[table], world_size, name)
            t.memory_replicated, t.memory_sharded, t.blocker = fresh.memory_replicated, fresh.memory_sharded, \
                fresh.blocker
        self.optimizer = name
        if self.memory_budget is not None and self.memory_per_rank() > self.memory_budget:
            raise ValueError(f"sparsecomm.parallelize: the plan was made for {former}; with {name}'s optimizer state "
                             f"its tables take {_mib(self.memory_per_rank())} MiB per rank, over the memory budget of "
                             f"{_mib(self.memory_budget)} MiB: make the plan with optimizer={name}")
        return former

    def memory_per_rank(self) -> int:
        """Bytes of tables and their optimizer state on the rank holding the most under this plan."""
        return max(self.memory_on(r) for r in range(max(1, self.world_size)))

    def memory_on(self, rank: int) -> int:
        """Bytes of tables and their optimizer state on ``rank`` under this plan."""
        return sum(t.memory_on(rank) for t in self.tables.values())

    def to_dict(self) -> Dict[str, Any]:
        return {"format": PLAN_FORMAT, "world_size": self.world_size, "optimizer": self.optimizer,
                "memory_budget": self.memory_budget, "latency_bytes": self.latency_bytes,
                "tables": {n: dataclasses.asdict(t) for n, t in self.tables.items()}}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise ValueError(f"not a sparsecomm plan (format {d.get('format') if isinstance(d, dict) else d!r})")
        tables = {}
        for n, t in d["tables"].items():
            t = dict(t)
            if t.get("distinct") is not None:
                t["distinct"] = tuple(t["distinct"])
            tables[n] = TablePlan(**t)
        return cls(tables, d["world_size"], d.get("optimizer", "SGD"), d.get("memory_budget"), d.get("latency_bytes"))

    @classmethod
    def from_checkpoint(cls, directory: str) -> "Plan":
        """The plan recorded by ``sparsecomm.sharded.save`` (to parallelize at another world size alike).

        Raises:
            ValueError: the checkpoint holds no plan.
        """
        with open(os.path.join(directory, "manifest.json")) as f:
            manifest = json.load(f)
        if not manifest.get("plan"):
            raise ValueError(f"{directory}: the checkpoint records no plan (saved without parallelize)")
        return cls.from_dict(manifest["plan"])

    def __str__(self) -> str:
        """A table that fits 120 columns: one line per table, each reason numbered below it, wrapped."""
        head = ("table", "kind", "rows x dim", "placement", "MiB/rank", "MB repl", "MB shard", "ids/rank", "union", "")
        rows, notes = [head], []
        for i, (n, t) in enumerate(self.tables.items(), 1):
            place = t.where
            distinct = "-" if t.distinct is None else f"{sum(t.distinct) / max(1, len(t.distinct)):.0f}"
            rows.append((_short(n, 24), "bag" if t.kind == "EmbeddingBag" else "emb",
                         f"{t.num_embeddings} x {t.embedding_dim}", place, _mib(t.memory), _mb(t.bytes_replicated),
                         _mb(t.bytes_sharded), distinct, "-" if t.union is None else str(t.union), f"[{i}]"))
            notes.append(textwrap.fill(f"[{i}] {n}: {t.reason}", 118, initial_indent="  ", subsequent_indent="      "))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
        title = (f"sparsecomm plan: {self.world_size} rank{'s' if self.world_size != 1 else ''}, "
                 f"optimizer {self.optimizer}, "
                 f"{_mib(self.memory_per_rank())} MiB of tables per rank"
                 + (f" (budget {_mib(self.memory_budget)} MiB)" if self.memory_budget is not None else ""))
        lines = textwrap.wrap(title, 120) + ["  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                                            for r in rows]
        lines.append("  (MB repl / shard: what a rank moves per step with the table replicated / sharded; "
                     "ids/rank: distinct, in the sample)")
        return "\n".join(lines + notes)


def _short(name: str, width: int) -> str:
    """``name`` cut to ``width`` columns, from the left (the end of a dotted name tells tables apart)."""
    return name if len(name) <= width else "..." + name[-(width - 3):]


def _mb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e6:.3g}"


def embedding_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if type(m) in (nn.Embedding, nn.EmbeddingBag)]


def _blocker(m: nn.Module) -> str:
    """Why a sharded table could not do what this module does, or ""."""
    if m.max_norm is not None:
        return f"max_norm={m.max_norm} renormalizes rows in place at lookup (only a replica does that)"
    if m.scale_grad_by_freq:
        return "scale_grad_by_freq=True scales by the batch's id counts (only a replica does that)"
    return ""


def optimizer_name(optimizer: Any) -> str:
    """An optimizer class's name (``torch.optim.Adagrad`` -> ``"Adagrad"``); a string as it is."""
    return optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", str(optimizer))


def _wrapper_problem(model: nn.Module) -> Optional[str]:
    """What wraps ``model`` (DDP or FSDP1 anywhere, ``fully_shard`` at its root), or None."""
    if isinstance(model, FSDPModule):
        return ("the model is fully_shard-ed at its root: pass it before fully_shard(model) (submodules may be "
                "fully_shard-ed already); parallelize(..., dense='fsdp') applies fully_shard to the root itself, "
                "around the sharded tables")
    for name, m in model.named_modules():
        if isinstance(m, (DistributedDataParallel, FullyShardedDataParallel)):
            what = (f"the model is a {type(m).__name__}: pass the unwrapped model (its .module)" if not name else
                    f"its submodule {name!r} is a {type(m).__name__}: pass the model with {name!r} unwrapped "
                    f"(its .module in its place)")
            return f"{what}; parallelize wraps the dense part itself (DDP, or fully_shard with dense='fsdp')"
    return None


def refuse_wrapped(model: nn.Module, group: Optional[dist.ProcessGroup], who: str) -> None:
    """Raise ``TypeError`` on every rank when some rank's model is already wrapped; collective.

    A wrapped model would have its wrapper's names (``module.``), its
    hooks and its collectives under the ones :func:`plan` and ``parallelize``
    add: DDP in DDP fails at the second step with torch's "Expected to have
    finished reduction" error, DDP around ``fully_shard`` at construction.
    Nothing is run or modified before the check.

    Raises:
        TypeError: naming the wrapper and saying to pass the unwrapped model.
    """
    for r, problem in enumerate(all_gather_objects(_wrapper_problem(model), group)):
        if problem:
            raise TypeError(f"{who}: {problem}" if group is None else f"{who}: rank {r}: {problem}")


def _describe(name: str, m: nn.Module, n: int, optimizer: str) -> TablePlan:
    v, d = m.weight.shape
    esz = m.weight.element_size()
    state = _STATE_FACTOR.get(optimizer, 2)
    row = d * esz
    # Hash ownership keeps a bitmap of V bits plus a prefix count per 64-bit word.
    owner_map = 0 if n == 1 else v // 8 + (v // 64 + 1) * 8
    t = TablePlan(name, type(m).__name__, v, d, str(m.weight.dtype).replace("torch.", ""),
                  memory_replicated=v * row * (1 + state),
                  memory_sharded=math.ceil(v / n) * row * (1 + state) + owner_map,
                  blocker=_blocker(m))
    if not t.blocker and not m.weight.requires_grad:
        t.blocker = "the table is frozen (requires_grad=False): nothing to update on its owners"
    if not t.blocker and optimizer in ("Adam",) and not m.sparse:
        t.blocker = ("sparse=False under Adam: Adam moves every row every step (momentum), a sharded table's Adam "
                     "is lazy (SparseAdam's rule)")
    return t


def plan(model: nn.Module, sample_batch: Any = None, *, process_group: Optional[dist.ProcessGroup] = None,
         memory_budget: Optional[int] = None, optimizer: Any = "SGD", small_table_bytes: int = 4 << 20,
         latency_bytes: Optional[float] = None, sample: Optional[Sample] = None) -> Plan:
    """Decide where each embedding table of ``model`` lives; collective (every rank, same model).

    Args:
        model: the single-process model (not wrapped in DDP or FSDP; submodules
            may be ``fully_shard``-ed).
        sample_batch: optional: one batch of this rank's data, what the
            training loop passes as ``model(batch)`` (a tensor, a tuple, a
            dict...), or a function ``f(model)`` that calls the model on one
            (for a forward with several arguments); run once without gradients to measure
            the distinct ids, union and skew per table.
        process_group: the ranks that will train (default: the whole world).
        memory_budget: bytes per rank for tables and their optimizer state.
        optimizer: the optimizer class or its name (sizes the optimizer state).
        small_table_bytes: tables smaller than this stay replicated.
        latency_bytes: the price of one collective in bytes (default: measured
            with a few all-to-alls when a sample batch is given).
        sample: instead of ``sample_batch``, what one was seen to look up on
            this rank (:class:`~sparsecomm.sample_batch.IdCapture`); when
            given, ``sample_batch`` is not run.

    Returns:
        The :class:`Plan`, the same on every rank.

    Raises:
        TypeError: on every rank, before the model runs, when it is already
            wrapped (DDP, FSDP1, ``fully_shard`` at its root): pass the
            unwrapped model.
        ValueError: on every rank, when the ranks' models differ, or no
            placement fits the memory budget.
    """
    opt = optimizer_name(optimizer)
    _, n = world(process_group)
    group = (process_group or dist.group.WORLD) if n > 1 else None
    refuse_wrapped(model, group, "sparsecomm.plan")
    modules = embedding_modules(model)
    tables = {name: _describe(name, m, n, opt) for name, m in modules}
    problem = None
    if sample is None and sample_batch is not None and modules:
        try:
            sample = sample_ids(model, modules, sample_batch)
        except Exception as e:  # told to every rank below: no rank is left waiting in the exchange
            problem = sample_problem(e, sample_batch)
    mine = [(t.name, t.kind, t.num_embeddings, t.embedding_dim, t.dtype, bool(t.blocker)) for t in tables.values()]
    gathered = all_gather_objects((mine, sample, problem), group)
    for r, (_, _, their_problem) in enumerate(gathered):
        if their_problem:
            raise ValueError(f"sparsecomm.plan: rank {r}: {their_problem}")
    gathered = [(theirs, their_sample) for theirs, their_sample, _ in gathered]
    for r, (theirs, _) in enumerate(gathered):
        if theirs != mine:
            raise ValueError(f"sparsecomm.plan: rank {r}'s model has embedding tables {theirs} but this rank's has "
                             f"{mine}: every rank must pass the same model")
    prices = None
    if sample is not None and group is not None and all(s is not None for _, s in gathered):
        # the slowest rank's numbers: the same on every rank
        prices = measure_prices(group, opt, {(m.embedding_dim, m.weight.dtype) for _, m in modules})
        latency_bytes = prices.latency_bytes if latency_bytes is None else latency_bytes
    if sample is not None:
        for name, m in modules:
            ids = [s.ids[name] for _, s in gathered]
            predict(tables[name], m.embedding_dim * m.weight.element_size(), n, [x.numel() for x in ids],
                    int(torch.unique(torch.cat(ids)).numel()), opt, prices)
            if name in sample.bags:
                counts = [s.bags[name] for _, s in gathered]
                bags = sum(b for b, _ in counts)
                tables[name].bags = bags / n
                tables[name].bag_length = sum(k for _, k in counts) / bags if bags else 0.0
    result = Plan(tables, n, opt, memory_budget, latency_bytes)
    _decide(result, small_table_bytes)
    place_tables(result, {name: pools_at_owner(m) for name, m in modules})
    return result


def _row_price(t: TablePlan) -> str:
    how = "measured" if t.measured_optimizer else "priced by a constant"
    return f"{t.optimizer_row_bytes:.3g} link B/row, {how}"


def _decide(p: Plan, small_table_bytes: int) -> None:
    tables = list(p.tables.values())
    for t in tables:
        if t.blocker:
            t.placement, t.reason = "replicate", f"cannot shard: {t.blocker}"
        elif p.world_size == 1:
            t.placement, t.reason = "replicate", "one rank: it holds every row either way"
        elif t.memory_replicated < small_table_bytes:
            t.placement = "replicate"
            t.reason = (f"small ({_mib(t.memory_replicated)} MiB < {_mib(small_table_bytes)} MiB): its rows ride in "
                        f"the hook's fused sync")
        elif t.bytes_sharded is not None:
            if t.bytes_sharded < t.bytes_replicated:
                t.placement = "shard"
                t.reason = (f"predicted {t.bytes_sharded:.3g} B/step sharded < {t.bytes_replicated:.3g} replicated "
                            f"(optimizer on {t.union}/{p.world_size} rows at {_row_price(t)})")
            else:
                t.placement = "replicate"
                t.reason = (f"predicted {t.bytes_replicated:.3g} B/step replicated <= {t.bytes_sharded:.3g} sharded "
                            f"(optimizer on {t.union} rows at {_row_price(t)})")
        else:
            t.placement = "shard"
            t.reason = f"large ({_mib(t.memory_replicated)} MiB replicated): {ROWS_SPREAD.format(n=p.world_size)}"
    # The lookup round's own collectives are paid once for all sharded tables: shard only when the
    # tables' summed saving (with a sample batch) beats them.
    chosen = [t for t in tables if t.placement == "shard" and t.bytes_sharded is not None]
    if chosen and p.latency_bytes:
        saving = sum(t.bytes_replicated - t.bytes_sharded for t in chosen)
        price = ROUND_COLLECTIVES * p.latency_bytes
        if saving <= price:
            for t in chosen:
                t.placement = "replicate"
                t.reason = (f"the sharded tables would save {saving:.3g} B/step, less than the {ROUND_COLLECTIVES} "
                            f"collectives of their lookup round ({price:.3g} B of latency): the hook's one fused "
                            f"sync is cheaper")
    if p.memory_budget is None or p.memory_per_rank() <= p.memory_budget:
        return
    # Over budget: shard what still can be, largest replica first, until it fits.
    for t in sorted(tables, key=lambda t: -t.memory_replicated):
        if p.memory_per_rank() <= p.memory_budget:
            break
        if t.placement == "replicate" and not t.blocker and p.world_size > 1:
            t.placement = "shard"
            t.reason = f"its replica ({_mib(t.memory_replicated)} MiB) does not fit the memory budget"
    if p.memory_per_rank() > p.memory_budget:
        raise ValueError(f"sparsecomm.plan: no placement fits the memory budget of {_mib(p.memory_budget)} MiB per "
                         f"rank: the tables need {_mib(p.memory_per_rank())} MiB even sharded where possible "
                         f"(tables that cannot be sharded: "
                         f"{[t.name for t in tables if t.blocker] or 'none'}; world size {p.world_size})\n{p}")
