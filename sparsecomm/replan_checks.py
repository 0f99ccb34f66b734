"""What :func:`sparsecomm.replan` checks on each rank before anything moves, and the tables that move.

Every check is local; ``replan`` then agrees on the verdicts in one
all-gather of objects, so a refusal raises on every rank and changes nothing.
:class:`ReplanBusy` is the refusal that passes by itself: the model is
mid-step, and the same replan goes through after ``step()`` and ``zero_grad()``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.collectives.objects import world
from sparsecomm.placement import TableSpec, Where, current_placement, planned_placement
from sparsecomm.planner import Plan, embedding_modules
from sparsecomm.sharded.combined import OptimizerSpec, ParallelOptimizer, check_optimizer
from sparsecomm.sharded.model import sharded_modules
from sparsecomm.sharded.table import ShardedTable

__all__ = ["ReplanBusy", "plan_moves", "group_of", "unwrap"]


class ReplanBusy(ValueError):
    """Refused: the model is mid-step on some rank; the same replan goes through after step() and zero_grad()."""


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _has_grad(g: Optional[torch.Tensor]) -> bool:
    return g is not None and (g._nnz() > 0 if g.is_sparse else bool(g.any()))


def _busy(optimizer: ParallelOptimizer, inner: nn.Module) -> Optional[str]:
    """Why the model is mid-step, or None: gradients not stepped yet, a round prefetched or awaiting backward."""
    if any(_has_grad(p.grad) for g in optimizer.param_groups for p in g["params"]):
        return ("gradients are pending (between backward and step(), e.g. accumulating): call step() and "
                "zero_grad() first")
    for name, t in sharded_modules(inner):
        if _has_grad(t.local_weight.grad) or (t.optimizer is not None and t.optimizer.in_flight(t.local_weight)) \
                or (t.hot is not None and t.hot.gradient() is not None):
            return f"table {name!r} has a gradient pending: call step() and zero_grad() first"
        busy = t.table_set.busy()
        if busy:
            return f"table {name!r}: {busy}"
    return None


def _check_tables(inner: nn.Module, plan: Plan, spec: OptimizerSpec) -> None:
    modules = {name: inner.get_submodule(name) for name in _table_names(inner)}
    unknown, missing = sorted(set(plan.tables) - set(modules)), sorted(set(modules) - set(plan.tables))
    if unknown or missing:
        raise ValueError(f"the plan does not match the model: tables not in the model {unknown}, tables missing "
                         f"from the plan {missing}")
    for name, t in plan.tables.items():
        m = modules[name]
        if (m.num_embeddings, m.embedding_dim) != (t.num_embeddings, t.embedding_dim):
            raise ValueError(f"table {name!r} is {m.num_embeddings} x {m.embedding_dim} but the plan has "
                             f"{t.num_embeddings} x {t.embedding_dim}")
        if t.placement == "shard" and not isinstance(m, ShardedTable):
            frozen = "the table is frozen (requires_grad=False)" if not m.weight.requires_grad else ""
            blocker = t.blocker or frozen or (
                "sparse=False under Adam (a sharded table's Adam is lazy)"
                if spec.optimizer_class is torch.optim.Adam and not m.sparse else "")
            if blocker:
                raise ValueError(f"table {name!r} cannot be sharded: {blocker}")
    sparse_replicas = any(TableSpec.of(modules[n]).sparse for n, t in plan.tables.items()
                          if t.placement != "shard")
    check_optimizer(spec.optimizer_class, spec.kwargs, bool(plan.sharded()), sparse_replicas)


def _table_names(inner: nn.Module) -> List[str]:
    """Every table of the model, replicated or sharded, in module order."""
    replicas = {n for n, _ in embedding_modules(inner)}
    return [n for n, m in inner.named_modules() if n in replicas or isinstance(m, ShardedTable)]


def _check_optimizer(optimizer: Any, inner: nn.Module, moves: Sequence[Tuple[str, Where, Where]]) -> OptimizerSpec:
    if not isinstance(optimizer, ParallelOptimizer) or optimizer.spec is None:
        raise ValueError(f"the optimizer must be the ParallelOptimizer sparsecomm.parallelize returned, got "
                         f"{type(optimizer).__name__}")
    sharded = optimizer.sharded
    mine = [t for _, t in sharded_modules(inner)]
    if {id(t) for t in mine} != {id(t) for t in (sharded.tables() if sharded is not None else [])}:
        raise ValueError("the optimizer does not update this model's sharded tables (pass the model and the "
                         "optimizer parallelize or the last replan returned)")
    for part, opt in optimizer.parts.items():
        if part != "dense" and len(opt.param_groups) != 1:
            raise ValueError(f"the optimizer's {part!r} part has {len(opt.param_groups)} param groups; a "
                             f"replan keeps one there")
    if any(not old.replicated and new.replicated for _, old, new in moves) and getattr(sharded, "rowwise", False):
        raise ValueError("row-wise Adagrad keeps one sum per row, which torch's Adagrad on a replica cannot "
                         "continue from; keep those tables sharded")
    return optimizer.spec


def _check_group(model: nn.Module, group) -> None:
    if isinstance(model, DDP) and group is not None:
        if dist.get_process_group_ranks(model.process_group) != dist.get_process_group_ranks(group):
            raise ValueError("process_group is not the DDP model's group: pass the process_group given to "
                             "sparsecomm.parallelize")


def plan_moves(model: nn.Module, optimizer: Any, plan: Any, group) -> List[Tuple[str, Where, Where]]:
    """``(table, from, to)`` of every table that moves, after every local check (ValueError otherwise)."""
    inner = unwrap(model)
    if not isinstance(plan, Plan):
        raise ValueError(f"new_plan must be a sparsecomm.Plan, got {type(plan).__name__}")
    if getattr(inner, "sparsecomm_plan", None) is None:
        raise ValueError("the model was not made by sparsecomm.parallelize (it has no sparsecomm_plan)")
    _check_group(model, group)
    for t in plan.tables.values():
        if t.owner_problem(world(group)[1]):
            raise ValueError(t.owner_problem(world(group)[1]))
    names = set(_table_names(inner))
    moves = [(n, current_placement(inner.get_submodule(n)), planned_placement(t)) for n, t in plan.tables.items()
             if n in names]
    spec = _check_optimizer(optimizer, inner, moves)
    _check_tables(inner, plan, spec)
    moves = [m for m in moves if m[1] != m[2]]
    _check_hyperparameters(optimizer, inner, moves)
    busy = _busy(optimizer, inner)
    if busy:
        raise ReplanBusy(busy)
    return moves


def group_of(optimizer: ParallelOptimizer, p: torch.Tensor) -> Tuple[str, Dict[str, Any]]:
    """The part and the param group that hold parameter ``p`` (a replica's weight, a table's stand-in)."""
    for part, opt in optimizer.parts.items():
        for g in opt.param_groups:
            if any(q is p for q in g["params"]):
                return part, g
    raise ValueError("a table of the model is in none of the optimizer's param groups")


def _target_part(spec: OptimizerSpec, m: nn.Module, new: Where) -> str:
    if not new.replicated:
        return "sharded"
    return spec.replica_part(TableSpec.of(m).sparse)


def _check_hyperparameters(optimizer: ParallelOptimizer, inner: nn.Module, moves) -> None:
    """A table keeps its hyperparameters: it may join only a group with the same ones (lr, ...)."""
    spec = optimizer.spec
    keys = spec.part_options("sharded")
    into = {part: opt.param_groups[0] for part, opt in optimizer.parts.items()}
    for name, _, new in moves:
        m = inner.get_submodule(name)
        _, source = group_of(optimizer, m.weight)
        target = into.setdefault(_target_part(spec, m, new), source)
        differ = {k: (source[k], target[k]) for k in keys if k in source and k in target and source[k] != target[k]}
        if differ:
            raise ValueError(f"table {name!r} would change its hyperparameters {differ} (its group's, then the "
                             f"group it joins): give both groups the same values first")
