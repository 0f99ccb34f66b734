"""``sparsecomm.parallelize``: a single-process model to data-parallel training in one call.

Applies a :class:`~sparsecomm.planner.Plan` (decided by
:func:`sparsecomm.plan` when none is given): tables the plan shards become
``ShardedEmbedding(Bag)`` holding rank 0's weights (as DDP broadcasts rank 0's
parameters) and share one lookup round per step; the rest of the model goes
under DDP with the sparsecomm hook (``dense="ddp"``) or under ``fully_shard``
(``dense="fsdp"``, :mod:`sparsecomm.sharded.fsdp`); one optimizer drives both
(:class:`~sparsecomm.sharded.combined.ParallelOptimizer`). Everything is
checked before anything is modified (docs/PARALLELIZE.md).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm import ops
from sparsecomm.collectives.dense import broadcast_
from sparsecomm.collectives.objects import all_gather_objects, world
from sparsecomm.hooks import register
from sparsecomm.planner import Plan, embedding_modules, plan as make_plan, refuse_wrapped
from sparsecomm.sharded.combined import ParallelOptimizer, build_optimizer, check_optimizer
from sparsecomm.sharded.embedding import ShardedEmbedding, ShardedEmbeddingBag
from sparsecomm.sharded.fsdp import DENSE_WRAPPERS, check_fsdp, fsdp_submodules, shard_dense
from sparsecomm.sharded.model import group_tables
from sparsecomm.sharded.wire import check_compression, with_compression
from sparsecomm.trial import PlacementTrial, TrialConfig, can_try, candidates

__all__ = ["parallelize"]


def _check_plan(model: nn.Module, p: Plan, modules: Dict[str, nn.Module], n: int,
                optimizer_class: Type[torch.optim.Optimizer]) -> None:
    missing = sorted(set(modules) - set(p.tables))
    extra = sorted(set(p.tables) - set(modules))
    if missing or extra:
        raise ValueError(f"sparsecomm.parallelize: the plan does not match the model: tables missing from the plan "
                         f"{missing}, in the plan but not in the model {extra}")
    for name in p.sharded():
        m, t = modules[name], p.tables[name]
        if (m.num_embeddings, m.embedding_dim) != (t.num_embeddings, t.embedding_dim):
            raise ValueError(f"sparsecomm.parallelize: table {name!r} is {m.num_embeddings} x {m.embedding_dim} but "
                             f"the plan has {t.num_embeddings} x {t.embedding_dim}")
        if t.owner_problem(n):
            raise ValueError(f"sparsecomm.parallelize: {t.owner_problem(n)}: place it again "
                             f"(plan.override({name!r}, 'shard', 'table', owner=...) or another scheme)")
        if t.blocker:
            raise ValueError(f"sparsecomm.parallelize: table {name!r} cannot be sharded: {t.blocker}; replicate it "
                             f"(plan.override({name!r}, 'replicate'))")
        if optimizer_class is torch.optim.Adam and not m.sparse:
            raise ValueError(f"sparsecomm.parallelize: table {name!r} has sparse=False, so Adam updates all of its rows "
                             f"every step (momentum), but a sharded table's Adam is lazy (SparseAdam's rule): "
                             f"replicate it (plan.override({name!r}, 'replicate')) or make it sparse=True")


def _sharded_twin(m: nn.Module, weight: torch.Tensor, scheme: str, owner: Optional[int], group) -> nn.Module:
    common = dict(scheme=scheme, owner=owner, group=group, dtype=weight.dtype, device=weight.device, _weight=weight,
                  _freeze=not m.weight.requires_grad)
    if isinstance(m, nn.EmbeddingBag):
        return ShardedEmbeddingBag(m.num_embeddings, m.embedding_dim, m.mode,
                                   include_last_offset=m.include_last_offset, padding_idx=m.padding_idx, **common)
    return ShardedEmbedding(m.num_embeddings, m.embedding_dim, m.padding_idx, **common)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _dense_wrapper(model: nn.Module, options: "_Options") -> str:
    """The wrapper of the dense part: ``options.dense``, by default ``"fsdp"`` when submodules are
    ``fully_shard``-ed, else ``"ddp"``."""
    presharded = fsdp_submodules(model)
    dense = options.dense
    if dense is None:
        dense = "fsdp" if presharded else "ddp"
    if dense not in DENSE_WRAPPERS:
        raise ValueError(f"sparsecomm.parallelize: dense must be one of {DENSE_WRAPPERS}, got {dense!r}")
    if dense == "ddp" and presharded:
        raise ValueError(f"sparsecomm.parallelize: dense='ddp', but submodules {presharded} are fully_shard-ed "
                         f"(DDP cannot wrap them): use dense='fsdp' (the default for such a model)")
    if dense == "fsdp" and (options.ddp_kwargs or options.hook_options):
        raise ValueError("sparsecomm.parallelize: ddp_kwargs and hook_options configure DDP and its hook; "
                         "dense='fsdp' uses neither: drop them (fully_shard submodules yourself for their options)")
    return dense


def _agree_checks(model: nn.Module, p: Plan, modules: Dict[str, nn.Module], n: int, options: "_Options",
                  group) -> str:
    """Every check, on every rank, agreed: the dense wrapper to use; raises ``ValueError`` on every rank."""
    error, wrapper = None, None
    try:
        options.former = p.adopt_optimizer(options.optimizer_class, modules, n)  # the plan is for what trains
        wrapper = _dense_wrapper(model, options)
        _check_compression(options)
        _check_plan(model, p, modules, n, options.optimizer_class)
        if wrapper == "fsdp":
            check_fsdp(model, p.sharded())
        sparse_replicas = any(modules[name].sparse for name in modules if name not in p.sharded())
        check_optimizer(options.optimizer_class, options.optimizer_kwargs, bool(p.sharded()), sparse_replicas)
    except ValueError as exc:
        error = str(exc)
    # Every rank must hold the same plan: one rank refusing means all refuse.
    verdicts = all_gather_objects((error, [(t, p.tables[t].where) for t in p.sharded()], wrapper,
                                   options.compression), group)
    for r, (err, placed, theirs, compression) in enumerate(verdicts):
        if err:
            raise ValueError(err if r == world(group)[0] else f"rank {r}: {err}")
        if placed != verdicts[0][1]:
            raise ValueError(f"sparsecomm.parallelize: rank {r} shards {placed} but rank 0 shards {verdicts[0][1]}: "
                             f"pass the same plan on every rank")
        if theirs != verdicts[0][2]:
            raise ValueError(f"sparsecomm.parallelize: rank {r} wraps the dense part in {theirs} but rank 0 in "
                             f"{verdicts[0][2]}: pass the same model and dense= on every rank")
        if compression != verdicts[0][3]:
            raise ValueError(f"sparsecomm.parallelize: rank {r} passes sparse_compression={compression!r} but rank 0 "
                             f"{verdicts[0][3]!r}: pass the same on every rank")
    return wrapper


def _shard_tables(model: nn.Module, p: Plan, modules: Dict[str, nn.Module], n: int, src: int,
                  process_group) -> List[nn.Module]:
    """Replace the planned tables by sharded twins holding rank 0's rows; one lookup round for them all."""
    tables: List[nn.Module] = []
    for name in p.sharded():
        m = modules[name]
        weight = m.weight.detach()
        if n > 1:
            weight = weight.clone()
            broadcast_(weight, src, process_group)
        new = _sharded_twin(m, weight, p.tables[name].scheme, p.tables[name].owner, process_group)
        _replace(model, name, new)
        tables.append(new)
    if tables:
        group_tables(model, tables, compression=model.sparsecomm_compression)
    return tables


def _check_compression(options: "_Options") -> None:
    """``sparse_compression`` is a wire dtype, and ``hook_options`` does not ask for another one."""
    try:
        c = options.compression = check_compression(options.compression)
    except ValueError as exc:
        raise ValueError(f"sparsecomm.parallelize: sparse_{exc}") from None
    hook = options.hook_options or {}
    given = hook.get("sparse_compression", getattr(hook.get("config"), "sparse_compression", None) or c)
    if c is not None and given != c:
        raise ValueError(f"sparsecomm.parallelize: sparse_compression={c!r} but hook_options has "
                         f"sparse_compression={given!r}: give it once")


@dataclass
class _Options:
    """What parallelize was asked for, beside the model and the plan."""

    optimizer_class: Type[torch.optim.Optimizer]
    optimizer_kwargs: Dict[str, Any]
    dense: Optional[str]
    ddp_kwargs: Optional[Dict[str, Any]]
    hook_options: Optional[Dict[str, Any]]
    former: Optional[str] = None   # the optimizer the plan was made for, when another (Plan.adopt_optimizer)
    compression: Optional[str] = None   # the embedding rows' wire dtype (sparse_compression)


# Tables smaller than this stay in their pages (ops.empty_rows advises huge pages from 4 MiB on).
_HUGE_PAGE_BYTES = 4 << 20


def parallelize(model: nn.Module, optimizer_class: Type[torch.optim.Optimizer], *, plan: Optional[Plan] = None,
                process_group: Optional[dist.ProcessGroup] = None, sample_batch: Any = None,
                memory_budget: Optional[int] = None, dense: Optional[str] = None,
                ddp_kwargs: Optional[Dict[str, Any]] = None, hook_options: Optional[Dict[str, Any]] = None,
                trial: Union[None, bool, TrialConfig] = None, sparse_compression: Optional[str] = None,
                **optimizer_kwargs) -> Tuple[nn.Module, ParallelOptimizer]:
    """Make ``model`` data-parallel: the plan's tables sharded, the rest under DDP + sparsecomm or FSDP2; collective.

    Every rank calls it with the same model (weights may differ: rank 0's win,
    as with DDP). Without torch.distributed initialized it is a world of one.

    The dense part (the model minus its sharded tables) goes under DDP with
    the sparsecomm hook (``dense="ddp"``), or under ``fully_shard``
    (``dense="fsdp"``): one ``fully_shard`` at the root, its sharded tables
    left out (``ignored_params``), after any ``fully_shard`` the user applied
    to submodules beforehand; the optimizer steps FSDP's ``DTensor``
    parameters with the torch optimizer and the sharded tables with their
    owner-side one. Under FSDP every replicated table must have
    ``sparse=False`` (or be frozen) and no ``max_norm``, no table the plan
    shards may lie in a submodule already ``fully_shard``-ed, and every rank
    must use the same dense parameters in a step (FSDP2's rule; see
    :mod:`sparsecomm.sharded.fsdp`).

    Args:
        model: a single-process model, not wrapped (modified in place:
            sharded tables replace the planned ``nn.Embedding(Bag)`` modules;
            under FSDP, the model becomes an ``FSDPModule``).
        optimizer_class: ``torch.optim.SGD``, ``Adagrad``, ``Adam`` or
            ``SparseAdam`` (any torch optimizer when nothing is sharded).
        plan: placements (default: ``sparsecomm.plan(model, sample_batch, ...)``).
            A plan made for another optimizer is taken for this one
            (``Plan.adopt_optimizer``: memory figures and the budget checked
            again; a warning on rank 0 when its costs were predicted from a
            sample batch).
        process_group: the ranks training together (default: the whole world).
        sample_batch, memory_budget: passed to :func:`sparsecomm.plan` when no plan is given.
        dense: ``"ddp"`` or ``"fsdp"``; default ``"ddp"``, or ``"fsdp"`` when
            some submodule is already ``fully_shard``-ed.
        ddp_kwargs: extra arguments of ``DistributedDataParallel`` (DDP only).
        hook_options: options of ``sparsecomm.register`` (``SparseCommState``; DDP only).
        trial: measure the placement on the first training steps
            (:mod:`sparsecomm.trial`): start with every table replicated,
            time the planner's pick and the row-sharded alternative on real
            steps (tables and optimizer state move exactly), keep the fastest;
            ``optimizer.trial`` reports it. None (default): when no plan is
            given, on a DDP model with dense parameters and peers; False:
            never; True or a :class:`~sparsecomm.trial.TrialConfig`: whenever
            the model allows (a warning says why not).
        sparse_compression: None (default: exact), ``"bf16"`` or ``"fp16"``:
            embedding rows travel in that dtype between ranks: the sharded
            tables' pulled rows (or partial bags) and pushed gradient rows
            (:attr:`ShardedTable.compression <sparsecomm.sharded.table.ShardedTable.compression>`)
            and, under DDP, the replicated tables' gradient rows (the hook's
            ``sparse_compression``). Not exact: each value is rounded once
            on the wire and summed at the table's precision (the bound is in
            docs/PARALLELIZE.md); half the row bytes, for a slow link
            between hosts. Kept across ``sparsecomm.replan`` and the trial's moves.
        **optimizer_kwargs: the optimizer's options (``lr=...``).

    Returns:
        ``(model, optimizer)``: the DDP-wrapped model, or the model itself
        (under FSDP, when nothing is left for DDP or FSDP, or there are no
        peers) and one :class:`~sparsecomm.sharded.combined.ParallelOptimizer`.
        On the inner module, ``sparsecomm_plan`` is the plan applied
        (``sparsecomm.sharded.save`` records it) and ``sparsecomm_state`` the
        hook's state (``stats``, ``decisions``; None without DDP).

    Raises:
        TypeError: before anything runs or is modified, on every rank: the
            model is already wrapped (DDP, FSDP1, or ``fully_shard`` at its
            root); pass the unwrapped model (for FSDP2, with ``dense="fsdp"``).
        ValueError: before anything is modified, on every rank: the plan does
            not match the model, a table the plan shards uses an option only a
            replica honours, a table FSDP cannot hold (``dense="fsdp"``), an
            unknown ``dense``, DDP's options with ``dense="fsdp"``, the
            optimizer has no owner-side twin or uses options the twin lacks,
            or ranks disagree on the model.

    Example::

        model, opt = sparsecomm.parallelize(model, torch.optim.Adagrad, dense="fsdp", lr=0.1)
    """
    _, n = world(process_group)
    group = (process_group or dist.group.WORLD) if n > 1 else None
    refuse_wrapped(model, group, "sparsecomm.parallelize")
    modules = dict(embedding_modules(model))
    config = _trial_config(trial, plan is None, n, dense)
    if plan is None:
        plan = make_plan(model, sample_batch, process_group=process_group, memory_budget=memory_budget,
                         optimizer=optimizer_class)
    tried = candidates(plan) if config is not None else []
    if len(tried) > 1:
        plan = tried[0].plan   # the trial starts replicated: moving a replica to a shard communicates nothing
    options = _Options(optimizer_class, optimizer_kwargs, dense, ddp_kwargs, hook_options,
                       compression=sparse_compression)
    wrapper = _agree_checks(model, plan, modules, n, options, group)
    if options.former is not None and world(group)[0] == 0 and any(t.bytes_sharded is not None
                                                                   for t in plan.tables.values()):
        warnings.warn(f"sparsecomm.parallelize: the plan was made for {options.former} and trains {plan.optimizer}: "
                      f"its memory figures now count {plan.optimizer}'s state, but its costs predicted from the "
                      f"sample batch were priced for {options.former} and may have placed tables differently; make "
                      f"the plan with optimizer={plan.optimizer}", stacklevel=2)

    # Nothing was modified so far. A plan from a checkpoint at another world size keeps its placements
    # (its numbers are that world's). Shard the planned tables, with rank 0's rows.
    plan.world_size = n
    src = dist.get_global_rank(process_group, 0) if process_group is not None and n > 1 else 0
    model.sparsecomm_compression = options.compression   # what sparsecomm.replan groups tables with again
    tables = _shard_tables(model, plan, modules, n, src, process_group)
    model.sparsecomm_plan = plan
    model.sparsecomm_state = None
    model.sparsecomm_ddp_kwargs = ddp_kwargs   # what sparsecomm.replan builds DDP with again

    sparse = [m.weight for name, m in modules.items() if name not in plan.sharded() and m.sparse
              and m.weight.requires_grad]
    moved = _to_huge_pages(sparse)   # before DDP: it broadcasts rank 0's weights into them
    wrapped: nn.Module = model
    if n > 1 and wrapper == "fsdp":
        shard_dense(model, tables, process_group, src)   # the model's parameters become FSDP's DTensors
    elif n > 1 and (sparse or any(p.requires_grad for p in model.parameters())):
        wrapped = DDP(model, process_group=process_group, **(ddp_kwargs or {}))
        model.sparsecomm_state = register(wrapped, **with_compression(options.hook_options, options.compression))
    sparse_ids = {id(p) for p in sparse}
    dense_params = [p for p in model.parameters() if p.requires_grad and id(p) not in sparse_ids]
    optimizer = build_optimizer(optimizer_class, optimizer_kwargs, dense_params, sparse, tables)
    _state_to_huge_pages(moved, optimizer)
    optimizer.trial = None
    if config is not None:
        why = can_try(wrapped, model) or (None if len(tried) > 1 else "every candidate placement is the same")
        if why is None:
            optimizer.trial = PlacementTrial(wrapped, tried, config, process_group)
            optimizer.register_step_post_hook(optimizer.trial.after_step)
        elif trial not in (None, False) and world(group)[0] == 0:
            warnings.warn(f"sparsecomm.parallelize: no placement trial: {why}", stacklevel=2)
    return wrapped, optimizer


def _to_huge_pages(weights: List[nn.Parameter]) -> List[nn.Parameter]:
    """Move replicated sparse tables into huge-page memory (``ops.empty_rows``), as the shards are: their rows
    are read and updated at random, and with 4 KiB pages each row is a TLB miss. Each is copied once, here; a
    weight that shares its storage with another tensor, or is small, stays where it is. Returns those moved."""
    moved = []
    with torch.no_grad():
        for p in weights:
            if p.device.type == "cpu" and p.is_contiguous() and p.numel() * p.element_size() >= _HUGE_PAGE_BYTES \
                    and p.untyped_storage().nbytes() == p.numel() * p.element_size():
                p.data = ops.huge_page_copy(p.data)
                moved.append(p)
    return moved


def _state_to_huge_pages(weights: List[nn.Parameter], optimizer: ParallelOptimizer) -> None:
    """The same for the row state the optimizer made with those weights (Adagrad's sums, copied), and for the
    moments SparseAdam makes at a weight's first step (made there, before its step, as it would make them)."""
    with torch.no_grad():
        for part in optimizer.parts.values():
            for p in weights if part is not None else ():
                state = part.state.get(p, {})
                for name, v in list(state.items()):
                    if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == p.shape[0] and v.device == p.device:
                        state[name] = ops.huge_page_copy(v)
    sparse = optimizer.parts.get("sparse")
    if isinstance(sparse, torch.optim.SparseAdam) and weights:
        hook = _SparseAdamMoments(weights)
        hook.handle = sparse.register_step_pre_hook(hook)


class _SparseAdamMoments:
    """A SparseAdam step pre-hook: the state of a weight about to take its first step (``step`` 0 and zero
    moments, SparseAdam's own initialization) made in huge-page memory; removed once every weight has one."""

    def __init__(self, weights: List[nn.Parameter]) -> None:
        self.waiting = {id(p): weakref.ref(p) for p in weights}   # a weight a replan took away is not kept
        self.handle: Any = None   # the hook's registration (set by the caller)

    def __call__(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for key, ref in list(self.waiting.items()):
            p = ref()
            if p is None or len(opt.state.get(p, {})):   # gone, or made already (a loaded state dict)
                del self.waiting[key]
            elif p.grad is not None:        # SparseAdam makes the state of a weight with a gradient
                opt.state[p] = {"step": 0, "exp_avg": ops.empty_rows(tuple(p.shape), p.dtype, p.device).zero_(),
                                "exp_avg_sq": ops.empty_rows(tuple(p.shape), p.dtype, p.device).zero_()}
                del self.waiting[key]
        if not self.waiting and self.handle is not None:
            self.handle.remove()


def _trial_config(trial: Union[None, bool, TrialConfig], no_plan: bool, n: int, dense: Optional[str]
                  ) -> Optional[TrialConfig]:
    """The trial's schedule, or None when none runs (module ``sparsecomm.trial``; ``parallelize``'s ``trial``)."""
    if trial is None:
        trial = no_plan and n > 1 and dense != "fsdp"
    if trial is False:
        return None
    if trial is True:
        return TrialConfig()
    if not isinstance(trial, TrialConfig):
        raise TypeError(f"sparsecomm.parallelize: trial must be None, a bool or a sparsecomm.TrialConfig, "
                        f"got {type(trial).__name__}")
    return trial
