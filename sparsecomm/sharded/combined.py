"""One optimizer for a model whose tables are partly sharded: torch's for the replicas, owner-side for the shards.

:func:`build_optimizer` maps a torch optimizer class to the rule each kind
of parameter gets (the same rule, so training equals single-process training):

=================  ==================  ========================  ======================
class              dense parameters    replicated sparse tables  sharded tables
=================  ==================  ========================  ======================
``SGD``            ``SGD``             ``SGD``                   :class:`ShardedSGD`
``Adagrad``        ``Adagrad``         ``Adagrad``               :class:`ShardedAdagrad`
``Adam``           ``Adam``            ``SparseAdam`` (lazy)     :class:`ShardedAdam` (lazy)
``SparseAdam``     ``Adam``            ``SparseAdam``            :class:`ShardedAdam`
=================  ==================  ========================  ======================

Options a sharded table's rule does not implement (momentum, weight decay,
AMSGrad, ...) are refused by :func:`check_optimizer` with their names, before
anything is built. :class:`ParallelOptimizer` is a ``torch.optim.Optimizer``
whose ``param_groups`` are its parts' groups (the same dicts), so LR
schedulers drive every part.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn as nn

from sparsecomm.collectives.objects import agree
from sparsecomm.sharded.optimizer import ShardedAdagrad, ShardedAdam, ShardedOptimizer, ShardedSGD

__all__ = ["ParallelOptimizer", "OptimizerSpec", "Incoming", "check_optimizer", "build_optimizer", "OPTIMIZER_FORMAT", "PARTS"]

OPTIMIZER_FORMAT = "sparsecomm.parallel_optimizer/1"

# class -> (owner-side twin, options the twin takes, {option: the only value it supports}).
_TWINS: Dict[Type[torch.optim.Optimizer], Tuple[Type[ShardedOptimizer], Tuple[str, ...], Dict[str, Any]]] = {
    torch.optim.SGD: (ShardedSGD, ("lr",), {"momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False,
                                            "maximize": False}),
    torch.optim.Adagrad: (ShardedAdagrad, ("lr", "lr_decay", "eps", "initial_accumulator_value"),
                          {"weight_decay": 0, "maximize": False}),
    torch.optim.Adam: (ShardedAdam, ("lr", "betas", "eps"), {"weight_decay": 0, "amsgrad": False, "maximize": False}),
    torch.optim.SparseAdam: (ShardedAdam, ("lr", "betas", "eps"), {"maximize": False}),
}
_ADAM = (torch.optim.Adam, torch.optim.SparseAdam)
# The parts of a ParallelOptimizer, in the order of its param groups.
PARTS = ("dense", "sparse", "sharded")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """The torch optimizer a :class:`ParallelOptimizer` was built from: its class and options (what a part
    built later, by ``sparsecomm.replan``, is built from)."""

    optimizer_class: Type[torch.optim.Optimizer]
    options: Tuple[Tuple[str, Any], ...]

    @property
    def kwargs(self) -> Dict[str, Any]:
        return dict(self.options)

    def replica_part(self, sparse: bool) -> str:
        """The part a replicated parameter joins: ``"sparse"`` for sparse tables under Adam, else ``"dense"``."""
        return "sparse" if sparse and self.optimizer_class in _ADAM else "dense"

    def replica_params(self, dense: Sequence[torch.Tensor], sparse: Sequence[torch.Tensor]
                       ) -> Dict[str, List[torch.Tensor]]:
        """The replicated parameters of each part, in :func:`build_optimizer`'s order."""
        if self.optimizer_class in _ADAM:
            return {"dense": list(dense), "sparse": list(sparse)}
        return {"dense": list(dense) + list(sparse)}

    def part_options(self, part: str) -> Dict[str, Any]:
        """The options :func:`build_optimizer` gives ``part``'s optimizer."""
        kw = self.kwargs
        if self.optimizer_class in _ADAM and (part != "dense" or self.optimizer_class is torch.optim.SparseAdam):
            return _table_kwargs(self.optimizer_class, kw)
        return _table_kwargs(self.optimizer_class, kw) if part == "sharded" else kw

    def part_class(self, part: str) -> Type[torch.optim.Optimizer]:
        """The optimizer class of ``part`` (see the module docstring's table)."""
        if part == "sharded":
            return _TWINS[self.optimizer_class][0]
        if self.optimizer_class in _ADAM:
            return torch.optim.SparseAdam if part == "sparse" else torch.optim.Adam
        return self.optimizer_class


def check_optimizer(optimizer_class: Type[torch.optim.Optimizer], kwargs: Dict[str, Any], sharded: bool,
                    sparse_replicas: bool = False) -> None:
    """Refuse, before anything is built, an optimizer the tables cannot follow exactly.

    Args:
        optimizer_class: a ``torch.optim`` class.
        kwargs: its options.
        sharded: whether some table will be sharded (needs an owner-side twin).
        sparse_replicas: whether some replicated table has sparse gradients
            (Adam's become SparseAdam's, which takes fewer options).

    Raises:
        ValueError: naming the class or the option and what to do.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
    twin = _TWINS.get(optimizer_class)
    if twin is None:
        if sharded:
            raise ValueError(f"{optimizer_class.__name__} has no owner-side twin for sharded tables (supported: "
                             f"{', '.join(c.__name__ for c in _TWINS)}); replicate every table "
                             f"(plan.override(name, 'replicate')) or use one of those")
        if sparse_replicas and optimizer_class not in (torch.optim.SGD, torch.optim.Adagrad):
            raise ValueError(f"{optimizer_class.__name__} does not take the sparse gradients of embedding tables "
                             f"with sparse=True; use SGD, Adagrad, Adam or SparseAdam")
        return
    _, _, fixed = twin
    if sharded or (sparse_replicas and optimizer_class in _ADAM):
        for name, only in fixed.items():
            if name in kwargs and kwargs[name] != only:
                who = "sharded tables' owner-side" if sharded else "sparse tables' SparseAdam"
                raise ValueError(f"{optimizer_class.__name__}({name}={kwargs[name]!r}): the {who} rule supports "
                                 f"only {name}={only!r}; pass that, or replicate every table with a dense "
                                 f"gradient (plan.override(name, 'replicate'), sparse=False)")


@dataclasses.dataclass
class Incoming:
    """A parameter that joins a part of a :class:`ParallelOptimizer` (``sparsecomm.replan``): a replica's
    weight or a sharded table, its state in that part's form, and the param group it comes from."""

    item: Any                          # the replica's weight, or the ShardedTable
    part: str                          # the part it joins: "dense", "sparse" or "sharded"
    state: Dict[str, Any]              # torch's state for a replica; step + this rank's rows for a table
    source: Dict[str, Any]             # the param group it leaves
    source_defaults: Dict[str, Any]    # the defaults of the optimizer it leaves


def _set_params(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], states: Dict[int, Dict[str, Any]]
                ) -> None:
    """Make ``params`` the first param group's; those in ``states`` get that state, those left out lose theirs."""
    group = opt.param_groups[0]
    live = {id(p) for p in params}
    for p in group["params"]:
        if id(p) not in live:
            opt.state.pop(p, None)
    group["params"] = list(params)
    for p in params:
        if id(p) in states:
            opt.state.pop(p, None)
            if states[id(p)]:
                opt.state[p] = states[id(p)]


def _table_kwargs(optimizer_class, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    keep = _TWINS[optimizer_class][1]
    return {k: v for k, v in kwargs.items() if k in keep}


class ParallelOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one: replicated parameters' and sharded tables'.

    ``step()``, ``zero_grad()``, ``state_dict()``, ``load_state_dict()`` and
    ``param_groups`` cover every part; LR schedulers work on it.

    Args:
        parts: ``{name: optimizer}``; names are ``"dense"`` (replicated
            parameters), ``"sparse"`` (replicated tables with their own rule)
            and ``"sharded"`` (a :class:`ShardedOptimizer`).
    """

    def __init__(self, parts: Dict[str, torch.optim.Optimizer]) -> None:
        parts = OrderedDict((k, v) for k, v in parts.items() if v is not None)
        if not parts:
            raise ValueError("ParallelOptimizer needs at least one optimizer")
        self.parts = parts
        # How the parts were made (set by build_optimizer; None for parts given by hand).
        self.spec: Optional[OptimizerSpec] = None
        self.defaults: Dict[str, Any] = {}
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise AttributeError("ParallelOptimizer.param_groups are its parts' groups; change them there")

    @property
    def state(self) -> Dict[torch.Tensor, Any]:  # type: ignore[override]
        return {p: s for opt in self.parts.values() for p, s in opt.state.items()}

    def set_parts(self, parts: Dict[str, torch.optim.Optimizer]) -> None:
        """Replace the parts (``sparsecomm.replan``): kept in :data:`PARTS` order, so :attr:`param_groups` are
        ordered as :func:`build_optimizer` orders them."""
        unknown = sorted(set(parts) - set(PARTS))
        if unknown or not parts:
            raise ValueError(f"ParallelOptimizer parts must be some of {PARTS}, got {sorted(parts)}")
        self.parts = OrderedDict((k, parts[k]) for k in PARTS if k in parts)

    def regroup(self, wanted: Dict[str, Sequence[Any]], incoming: Sequence[Incoming]) -> None:
        """Give each part the parameters ``wanted`` lists (``sparsecomm.replan``), in that order.

        A part keeps its optimizer and the state of what stays; ``incoming``
        brings its state; what leaves loses it. A part that ends up empty
        goes; one that is needed and missing is made from :attr:`spec`, its
        hyperparameters those of the group its first incoming parameter
        leaves (with what an LR scheduler added there, ``initial_lr``...).
        Parameters of the ``"dense"`` part's later groups (``add_param_group``) stay there.
        """
        parts: Dict[str, torch.optim.Optimizer] = {}
        for part in PARTS:
            items, opt = list(wanted.get(part, [])), self.parts.get(part)
            mine = [i for i in incoming if i.part == part]
            if opt is None and items:
                opt = self._new_part(part, items, mine[0])
            if opt is None:
                continue
            extra = {id(p) for g in opt.param_groups[1:] for p in g["params"]}
            items = [p for p in items if id(p) not in extra]
            if not items and len(opt.param_groups) == 1:
                continue
            states = {id(i.item): i.state for i in mine}
            if part == "sharded":
                opt.set_tables(items, states)
            else:
                _set_params(opt, items, states)
            parts[part] = opt
        self.set_parts(parts)

    def _new_part(self, part: str, items: Sequence[Any], first: Incoming) -> torch.optim.Optimizer:
        if self.spec is None:
            raise ValueError("this ParallelOptimizer was not built by build_optimizer: it cannot make a new part")
        options = {k: first.source.get(k, v) for k, v in self.spec.part_options(part).items()}
        cls = self.spec.part_class(part)
        if part == "sharded":  # starts empty: set_tables gives its tables their incoming state (no state made twice)
            opt = cls([{"params": []}], defer=True, **options)
        else:
            opt = cls(list(items), **options)
        opt.param_groups[0].update({k: v for k, v in first.source.items()
                                    if k != "params" and k not in first.source_defaults})
        return opt

    @property
    def sharded(self) -> Optional[ShardedOptimizer]:
        """The owner-side optimizer of the sharded tables, or None."""
        return self.parts.get("sharded")

    @property
    def replicated(self) -> List[torch.optim.Optimizer]:
        """The torch optimizers of the replicated parameters."""
        return [o for k, o in self.parts.items() if k != "sharded"]

    @torch.no_grad()
    def step(self, closure=None):
        """Step every part (the closure, if any, runs once)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.parts.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add replicated parameters (to the ``"dense"`` part)."""
        if "dense" not in self.parts:
            raise ValueError("this ParallelOptimizer has no part for replicated parameters")
        self.parts["dense"].add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        """Every part's state in torch's layout, as one optimizer over :attr:`param_groups` (collective with a
        sharded part: see ``ShardedOptimizer.state_dict``).

        Parameters are numbered across the parts in :attr:`param_groups` order,
        and each group is tagged with its ``"part"`` and the part's ``"kind"``
        (class name), so ``torch.distributed.checkpoint.state_dict`` maps it
        to the model's parameter names like any optimizer's and a state of
        other parts is refused on load.
        """
        state: Dict[Any, Any] = {}
        groups: List[Dict[str, Any]] = []
        offset = 0
        for name, opt in self.parts.items():
            sd = opt.state_dict()
            state.update({offset + k: v for k, v in sd["state"].items()})
            for g in sd["param_groups"]:
                groups.append({**g, "params": [offset + i for i in g["params"]], "part": name,
                               "kind": type(opt).__name__})
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def _split(self, state_dict: Dict[str, Any]) -> Tuple[Optional[str], Dict[str, Dict[str, Any]]]:
        """Each part's share of a :meth:`state_dict`, or what does not fit (the groups are taken in order)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            return (f"the state has {len(groups) if isinstance(groups, list) else 'no'} param groups, this "
                    f"optimizer {len(self.param_groups)}"), {}
        out, at = {}, 0
        for name, opt in self.parts.items():
            mine = groups[at:at + len(opt.param_groups)]
            at += len(opt.param_groups)
            for g, live in zip(mine, opt.param_groups):
                tags = (g.get("part", name), g.get("kind", type(opt).__name__))
                if tags != (name, type(opt).__name__) or len(g["params"]) != len(live["params"]):
                    return (f"the state's group for part {name!r} ({type(opt).__name__}, {len(live['params'])} "
                            f"parameters) holds {tags} with {len(g['params'])}"), {}
            ids = [i for g in mine for i in g["params"]]
            out[name] = {"state": {i: state_dict["state"][i] for i in ids if i in state_dict.get("state", {})},
                         "param_groups": [{k: v for k, v in g.items() if k not in ("part", "kind")} for g in mine]}
        return None, out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load every part's state (from :meth:`state_dict`, or the per-part form of earlier versions); refuses
        a state of other parts or kinds. Collective with a sharded part.

        Raises:
            ValueError: on every rank, before anything changes, when the state
                was written by another combination of optimizers.
        """
        if isinstance(state_dict, dict) and state_dict.get("format") == OPTIMIZER_FORMAT:
            mine = {k: type(o).__name__ for k, o in self.parts.items()}
            if state_dict.get("kinds") != mine:
                raise ValueError(f"ParallelOptimizer.load_state_dict: the state holds {state_dict.get('kinds')}, "
                                 f"this optimizer is {mine}")
            shares = state_dict["parts"]
        else:
            problem, shares = self._split(state_dict)
            sharded = self.sharded
            # Every rank refuses together: the sharded part's load is collective.
            agree(problem, sharded.tables()[0].group if sharded is not None and sharded.tables() else None,
                  "ParallelOptimizer.load_state_dict")
        # The sharded part first: its checks span every rank, and it refuses before any part changed.
        for k in sorted(self.parts, key=lambda k: k != "sharded"):
            self.parts[k].load_state_dict(shares[k])

    def __repr__(self) -> str:
        inner = ",\n".join(f"  {k}: {type(o).__name__} ({sum(len(g['params']) for g in o.param_groups)} tensors)"
                           for k, o in self.parts.items())
        return f"ParallelOptimizer(\n{inner}\n)"


def build_optimizer(optimizer_class: Type[torch.optim.Optimizer], kwargs: Dict[str, Any],
                    dense: Sequence[torch.Tensor], sparse: Sequence[torch.Tensor], tables: Sequence[nn.Module]
                    ) -> ParallelOptimizer:
    """The optimizer of a parallelized model (see the module docstring for the rule per kind).

    Args:
        optimizer_class, kwargs: the user's torch optimizer and its options
            (checked with :func:`check_optimizer` first).
        dense: replicated parameters with dense gradients.
        sparse: replicated embedding weights with sparse gradients.
        tables: sharded tables.
    """
    check_optimizer(optimizer_class, kwargs, bool(tables), bool(sparse))
    parts: Dict[str, Optional[torch.optim.Optimizer]] = {}
    if optimizer_class in _ADAM:
        table_kwargs = _table_kwargs(optimizer_class, kwargs)
        dense_kwargs = table_kwargs if optimizer_class is torch.optim.SparseAdam else kwargs
        parts["dense"] = torch.optim.Adam(list(dense), **dense_kwargs) if dense else None
        parts["sparse"] = torch.optim.SparseAdam(list(sparse), **table_kwargs) if sparse else None
    else:
        replicated = list(dense) + list(sparse)
        parts["dense"] = optimizer_class(replicated, **kwargs) if replicated else None
    if tables:
        twin = _TWINS[optimizer_class][0]
        parts["sharded"] = twin(list(tables), defer=True, **_table_kwargs(optimizer_class, kwargs))
    optimizer = ParallelOptimizer(parts)
    optimizer.spec = OptimizerSpec(optimizer_class, tuple(sorted(kwargs.items())))
    return optimizer
