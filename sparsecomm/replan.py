"""``sparsecomm.replan``: move tables between placements during training, with their optimizer state, exactly.

A model from :func:`sparsecomm.parallelize` holds each embedding table in one
of these placements: replicated (an ``nn.Embedding(Bag)`` under DDP and the
sparsecomm hook, its state in a torch optimizer), row-sharded by ``"hash"``
or ``"range"`` ownership, or whole on one rank (``"table"``, table-wise) (a
``ShardedEmbedding(Bag)``, its state row-aligned on the owners).
:func:`replan` moves tables between them so that the steps after it are the
steps the new placement would have taken from the start:

====================  ==========================================================
move                  what travels
====================  ==========================================================
replicate -> shard    nothing: each rank keeps its owned rows of the replica and
                      of its state (both are the same on every rank)
shard -> replicate    one all-gather of each shard's rows with their state (with
                      ``stale`` replicas, only of the rows changed since the
                      table left its replica: :mod:`sparsecomm.stale`)
between schemes      one all-to-all: the rows and their state through the table
(hash, range, table)  in id order (:mod:`sparsecomm.sharded.dcp`) to the new owners
                      (another owner of a table-wise table too)
====================  ==========================================================

The state that moves, per rule: SGD none, Adagrad its sums and step,
Adam (``SparseAdam`` for a replicated sparse table) its two moments and step.
The :class:`~sparsecomm.sharded.combined.ParallelOptimizer` is changed in
place into the parts ``parallelize`` would build for the new plan, in its
layout, so a checkpoint written after a replan loads into a model
parallelized with the new plan.

Everything is checked on every rank (:mod:`sparsecomm.replan_checks`) and
agreed before anything changes (one all-gather of objects): a refusal raises
on every rank and changes nothing. The tables that move are built without
another collective each (their placements were agreed), and with ``stale``
replicas every moving shard's changed rows travel in one exchange for all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm import ops
from sparsecomm.collectives.objects import all_gather_objects, world
from sparsecomm.collectives.sharded_exchange import allgather_table_rows
from sparsecomm.hooks import register
from sparsecomm.placement import REPLICATE, TableSpec, Where, planned_placement
from sparsecomm.planner import Plan, embedding_modules
from sparsecomm.replan_checks import ReplanBusy, group_of, plan_moves, unwrap
from sparsecomm.sharded import dcp, wire
from sparsecomm.sharded.combined import Incoming, OptimizerSpec, ParallelOptimizer
from sparsecomm.sharded.model import flush, group_tables, sharded_modules
from sparsecomm.sharded.table import ShardedTable
from sparsecomm.stale import Refresh, StaleReplicas, StaleTable, same_memory

__all__ = ["replan", "REPLICATE", "ReplanBusy"]

_WHAT = "sparsecomm.replan"


@dataclasses.dataclass
class Moved:
    """One table after its move: its name, the new module, what joins the optimizer."""

    name: str
    module: nn.Module
    incoming: Incoming


# ------------------------------------------------------------------ moves


def _step_of(state: Dict[str, Any]) -> int:
    step = state.get("step", 0)
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


def _torch_state(cls: type, step: int, rows: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """A torch optimizer's state of a replica from a sharded table's ``step`` and whole-table rows."""
    if cls is torch.optim.Adagrad:
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {"step": torch.tensor(float(step), dtype=scalar), "sum": rows["sum"]}
    if cls is torch.optim.SparseAdam and step:
        return {"step": step, "exp_avg": rows["exp_avg"], "exp_avg_sq": rows["exp_avg_sq"]}
    return {}   # SGD keeps none; SparseAdam makes it at its first step


def _incoming(optimizer: ParallelOptimizer, leaving: torch.Tensor, item: Any, part: str, state: Dict[str, Any]
              ) -> Incoming:
    """What joins ``part`` in place of parameter ``leaving`` (it keeps its group's hyperparameters)."""
    source_part, source = group_of(optimizer, leaving)
    return Incoming(item, part, state, source, optimizer.parts[source_part].defaults)


def _copy_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``table``'s rows at ``ids`` (ascending), never a view."""
    out = torch.empty((ids.numel(), *table.shape[1:]), dtype=table.dtype, device=table.device)
    return ops.take_rows(table, ids, out=out)


def _shard(name: str, m: nn.Module, optimizer: ParallelOptimizer, where: Where, group,
           stale: Optional[StaleReplicas]) -> Moved:
    """A replica to a sharded table: this rank's rows of its weight and state (no communication).

    With stale replicas, the replica's weight and state are kept as the table's copy (they are not updated any more).
    """
    part, _ = group_of(optimizer, m.weight)
    state = optimizer.parts[part].state.get(m.weight, {})
    table = TableSpec.of(m).sharded(m.weight.detach(), where, group, seed=0, adopt=stale is not None, agreed=True)
    names = [n for n in optimizer.spec.part_class("sharded").row_state_names if n in state]
    same = same_memory(table.local_weight, m.weight)   # a table-wise owner's or a spread shard is the replica
    owned = None if same else table.layout.owned_ids()
    rows = {n: state[n] if same else _copy_rows(state[n], owned) for n in names}
    if stale is not None:
        stale.keep(name, m.weight, {n: state[n] for n in names})
    return Moved(name, table, _incoming(optimizer, m.weight, table, "sharded", {"step": _step_of(state), **rows}))


def _replicate(name: str, t: ShardedTable, optimizer: ParallelOptimizer, stale: Optional[StaleReplicas],
               copy: Optional[StaleTable]) -> Moved:
    """A sharded table to a replica: every shard's rows and state to every rank (one all-gather; with its stale
    replica ``copy``, brought up to date by the caller, none)."""
    sharded = optimizer.sharded
    state = sharded.state[t.local_weight]
    names = sharded.row_state_names
    d = t.embedding_dim
    if copy is not None:
        weight, whole = copy.weight, dict(copy.state)
    else:
        packed = torch.cat([t.layout.owned_rows(x) for x in [t.local_weight.detach()] + [state[n] for n in names]], 1)
        ids, rows = allgather_table_rows(t.layout.owned_ids(), packed, t.num_embeddings, t.group)
        full = torch.empty((t.num_embeddings, packed.shape[1]), dtype=rows.dtype, device=rows.device)
        full[ids.to(rows.device)] = rows
        weight = ops.huge_page_copy(full[:, :d])   # a replica's rows are updated at random, as a shard's
        whole = {n: ops.huge_page_copy(full[:, (i + 1) * d:(i + 2) * d]) for i, n in enumerate(names)}
    if stale is not None:
        stale.drop(name)   # the replica is updated from now on
    spec = optimizer.spec
    module = TableSpec.of(t).replica(weight)
    part = spec.replica_part(TableSpec.of(t).sparse)
    torch_state = _torch_state(spec.part_class(part), int(state["step"]), whole)
    return Moved(name, module, _incoming(optimizer, t.weight, module.weight, part, torch_state))


def _reshard(name: str, t: ShardedTable, optimizer: ParallelOptimizer, where: Where, group,
             copy: Optional[StaleTable]) -> Moved:
    """A sharded table under another scheme: rows and state through the id order to the new owners (one all-to-all;
    with its stale replica ``copy``, brought up to date by the caller, every rank cuts its rows from it)."""
    sharded = optimizer.sharded
    w = t.local_weight
    if copy is not None:
        new = TableSpec.of(t).sharded(copy.weight, where, group, seed=t.seed, adopt=True, agreed=True)
        same = same_memory(new.local_weight, copy.weight)   # a table-wise owner's or a spread shard is the copy
        owned = None if same else new.layout.owned_ids()
        moved = {n: s if same else _copy_rows(s, owned) for n, s in copy.state.items()}
        return Moved(name, new, _incoming(optimizer, t.weight, new, "sharded",
                                          {"step": int(sharded.state[w]["step"]), **moved}))
    # A table of zeros without its memory: the new table's rows come from the old one's below.
    zeros = torch.zeros((1, t.embedding_dim), dtype=w.dtype, device=w.device).expand(t.num_embeddings, -1)
    new = TableSpec.of(t).sharded(zeros, where, group, seed=t.seed, agreed=True)
    state = sharded.state[w]
    names = sharded.row_state_names
    chunks = dcp.to_id_order(t.layout, [w.detach()] + [state[n] for n in names], t.group)
    rows = dcp.from_id_order(new.layout, chunks, new.group)
    with torch.no_grad():
        new.local_weight.copy_(rows[0])
    moved_state = {"step": int(state["step"]), **dict(zip(names, rows[1:]))}
    return Moved(name, new, _incoming(optimizer, t.weight, new, "sharded", moved_state))


def _move(inner: nn.Module, optimizer: ParallelOptimizer, name: str, new: Where, group,
          stale: Optional[StaleReplicas], copies: Dict[str, Optional[StaleTable]]) -> Moved:
    m = inner.get_submodule(name)
    if not isinstance(m, ShardedTable):
        return _shard(name, m, optimizer, new, group, stale)
    if new.replicated:
        return _replicate(name, m, optimizer, stale, copies.get(name))
    return _reshard(name, m, optimizer, new, group, copies.get(name))


def _refreshed(inner: nn.Module, optimizer: ParallelOptimizer, moves, stale: Optional[StaleReplicas]
               ) -> Dict[str, Optional[StaleTable]]:
    """The stale copies of the shards that move, brought up to date in one exchange for all (None: not usable)."""
    todo = [Refresh(name, inner.get_submodule(name), None if new.replicated else new.scheme) for name, _, new in moves
            if stale is not None and name in stale and isinstance(inner.get_submodule(name), ShardedTable)]
    return dict(zip([r.name for r in todo], stale.current_tables(todo, optimizer.sharded))) if todo else {}


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


# ------------------------------------------------------------------ the optimizer's parts


def _wanted(inner: nn.Module, plan: Plan, spec: OptimizerSpec) -> Dict[str, List[Any]]:
    """What each part holds under the new plan, in ``parallelize``'s order."""
    sparse = [m.weight for _, m in embedding_modules(inner) if m.sparse and m.weight.requires_grad]
    ids = {id(p) for p in sparse}
    dense = [p for p in inner.parameters() if p.requires_grad and id(p) not in ids]
    return {**spec.replica_params(dense, sparse), "sharded": [inner.get_submodule(n) for n in plan.sharded()]}


# ------------------------------------------------------------------ the model


def _regroup(inner: nn.Module, old_sets: Sequence[Any], plan: Plan) -> None:
    """Every sharded table in one round again; the old sets' forward hooks removed."""
    for table_set in old_sets:
        if table_set.hook is not None:
            table_set.hook.remove()
            table_set.hook = None
    tables = [inner.get_submodule(n) for n in plan.sharded()]
    if tables:
        group_tables(inner, tables, compression=getattr(inner, "sparsecomm_compression", None))


def _wrap(model: nn.Module, inner: nn.Module, process_group, n: int, ddp_kwargs, hook_options) -> nn.Module:
    """DDP around the model's replicated parameters, with the sparsecomm hook (as ``parallelize`` wraps).

    A DDP model is built again in place (``DistributedDataParallel.__init__`` on the same object: a new reducer
    over the new parameters), so whoever holds the model keeps a valid one. The replicas are already equal on
    every rank (the moves made them so), so DDP's initial broadcast is skipped.
    """
    old_state = getattr(inner, "sparsecomm_state", None)
    if hook_options is None:   # the link was measured on the same group: not again
        hook_options = {"config": old_state.config, "link": old_state.link} if old_state is not None else {}
    hook_options = wire.with_compression(hook_options, getattr(inner, "sparsecomm_compression", None))
    if ddp_kwargs is None:
        ddp_kwargs = getattr(inner, "sparsecomm_ddp_kwargs", None)
    kwargs = {"init_sync": False, **(ddp_kwargs or {})}
    replicated = [p for p in inner.parameters() if p.requires_grad]
    inner.sparsecomm_state = None
    unused, inner._sparsecomm_unused_hook = getattr(inner, "_sparsecomm_unused_hook", None), None
    if unused is not None:   # it lists the replicas of its time: the next hook installs one for the current ones
        unused.remove()
    if n == 1 or not replicated:
        return inner
    if isinstance(model, DDP):
        model._sparsecomm_state = None   # its hook goes with the reducer being replaced
        DDP.__init__(model, inner, process_group=process_group, **kwargs)
        wrapped = model
    else:
        wrapped = DDP(inner, process_group=process_group, **kwargs)
    inner.sparsecomm_state = register(wrapped, **hook_options)
    return wrapped


def _agree(problem: Optional[str], busy: bool, plan: Any, group, rank: int,
           replicas: Optional[StaleReplicas]) -> frozenset:
    """Raise the same error on every rank when some rank refused; else the tables whose stale copies every rank
    holds alike."""
    where = [(n, planned_placement(t)) for n, t in plan.tables.items()] if isinstance(plan, Plan) else None
    copies = replicas.names() if replicas is not None else {}
    verdicts = all_gather_objects((problem, busy, where, copies), group)
    usable = frozenset(n for n, shape in copies.items() if all(v[3].get(n) == shape for v in verdicts))
    verdicts = [v[:3] for v in verdicts]
    errors = [(r, err, mid) for r, (err, mid, _) in enumerate(verdicts) if err]
    if errors:
        r, err, mid = next(((r, e, m) for r, e, m in errors if r == rank), errors[0])
        kind = ReplanBusy if mid and all(m for _, _, m in errors) else ValueError
        raise kind(f"{_WHAT}: {err}" if r == rank else f"{_WHAT}: rank {r}: {err}")
    verdicts = [(err, theirs) for err, _, theirs in verdicts]
    for r, (_, theirs) in enumerate(verdicts):
        if theirs != verdicts[0][1]:
            raise ValueError(f"{_WHAT}: rank {r} places the tables {theirs} but rank 0 {verdicts[0][1]}: pass the "
                             f"same plan on every rank")
    return usable


def replan(model: nn.Module, optimizer: ParallelOptimizer, new_plan: Plan, *,
           process_group: Optional[dist.ProcessGroup] = None, ddp_kwargs: Optional[Dict[str, Any]] = None,
           hook_options: Optional[Dict[str, Any]] = None, stale: Optional[StaleReplicas] = None
           ) -> Tuple[nn.Module, ParallelOptimizer]:
    """Move tables of a parallelized model to the placements of ``new_plan``, optimizer state included; collective.

    Between two steps (after ``step()`` and ``zero_grad()``), every rank calls
    it with the same plan. Tables go between ``"replicate"`` and ``"shard"``
    under ``"hash"``, ``"range"`` or ``"table"`` (whole on one owner), in any combination, with their optimizer
    state (SGD: none; Adagrad: the sums and step; Adam: the moments and step),
    so that training goes on exactly as if ``new_plan`` had been used from
    the start.

    Args:
        model: what ``parallelize`` (or the last ``replan``) returned.
        optimizer: its :class:`~sparsecomm.sharded.combined.ParallelOptimizer`.
        new_plan: the placements, e.g. the model's ``sparsecomm_plan`` (or a
            copy) after ``override(name, "shard", "range")``: what moves is
            read from the model's modules, not from the old plan. It becomes
            the model's ``sparsecomm_plan``.
        process_group: the group given to ``parallelize`` (default: the world).
        ddp_kwargs: the ``DistributedDataParallel`` arguments for the
            wrapper when the set of replicated parameters changes (default:
            those given to ``parallelize``).
        hook_options: the hook's options for that wrapper (default: the old
            hook's settings), with parallelize's ``sparse_compression`` where they set none.
        stale: :class:`~sparsecomm.stale.StaleReplicas` (the same object at
            every replan of the model): later moves of a table that left its
            replica send only the rows that changed since (a replica's memory).

    Returns:
        ``(model, optimizer)``: the optimizer is the same object, changed in
        place: the param groups of the parts that stay are the same dicts,
        and a part made for incoming tables starts from the group they come
        from (lr and a scheduler's ``initial_lr`` included). So an LR
        scheduler made before goes on: one that steps each group from its
        own lr (``StepLR``, ``MultiStepLR``, ``ExponentialLR``) drives every
        group, a new part's too; one that keeps a list per group from its
        construction (``LambdaLR``, ``CosineAnnealingLR``'s ``base_lrs``)
        drives groups by position, so make it again after a replan that adds
        or removes a part (a part comes when the first table of its kind
        arrives, goes with the last).
        The model is the same object: a DDP model is built again in place
        when a table moved in or out of the replicas (DDP's parameters are
        fixed when it is built); only a model that had no DDP and now needs
        one (or no longer does) comes back as another object, so use what is
        returned. Sharded tables that moved are new modules.

    Raises:
        ReplanBusy: (a ``ValueError``) on every rank, before anything
            changes: the model is mid-step on every rank that refused:
            gradients are pending (between backward and ``step()``, as in
            gradient accumulation), lookups are open, a round prefetched by hand
            or awaiting its backward is pending (a pipeline's is ended unused).
        ValueError: on every rank, before anything changes: the plan names
            tables the model does not have (or misses some), a table cannot be
            sharded, the optimizer is not the model's, a table would change its
            hyperparameters, or the ranks' plans differ.

    Example::

        >>> model, opt = sparsecomm.parallelize(net, torch.optim.Adagrad, plan=p, lr=0.1)
        >>> ...train...
        >>> q = copy.deepcopy(p).override("user_table", "shard", "range")
        >>> model, opt = sparsecomm.replan(model, opt, q)
    """
    rank, n = world(process_group)
    group = (process_group or dist.group.WORLD) if n > 1 else None
    moves, problem, busy = [], None, False
    try:
        moves = plan_moves(model, optimizer, new_plan, group)
    except ValueError as exc:
        problem, busy = str(exc), isinstance(exc, ReplanBusy)
    usable = _agree(problem, busy, new_plan, group, rank, stale)
    inner = unwrap(model)
    new_plan.world_size = n
    inner.sparsecomm_plan = new_plan
    if not moves:
        return model, optimizer
    old_sets = list({id(t.table_set): t.table_set for _, t in sharded_modules(inner)}.values())
    for s in old_sets:   # a pipeline's next round: ended unused (it asks again)
        s.drop_prefetched()
    flush(inner)   # open rounds run, deferred gradients land: the shards hold every update
    for name in set(stale.names() if stale is not None else ()) - usable:
        stale.drop(name)   # not held alike by every rank: of no use
    copies = _refreshed(inner, optimizer, moves, stale)
    moved = [_move(inner, optimizer, name, new, process_group, stale, copies) for name, _, new in moves]
    for m in moved:
        _replace(inner, m.name, m.module)
    optimizer.regroup(_wanted(inner, new_plan, optimizer.spec), [m.incoming for m in moved])
    for m in moved if stale is not None else ():
        stale.watch(m.name, m.module, optimizer.sharded)   # a shard's next move sends the rows written from now on
    _regroup(inner, old_sets, new_plan)
    if any(old.replicated or new.replicated for _, old, new in moves):
        model = _wrap(model, inner, process_group, n, ddp_kwargs, hook_options)
    return model, optimizer
