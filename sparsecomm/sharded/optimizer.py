"""Owner-side optimizers for sharded tables: SGD, Adagrad and Adam, row-wise and lazy.

Each rank updates only the rows it owns, with the gradient its table's
backward delivered there (``table.local_weight.grad``, sparse). When the
update happens: in ``step()``, exactly like a torch optimizer — backward only
accumulates the gradient (several backward passes add up), ``step()`` applies
it, ``zero_grad()`` clears it. Only rows with a gradient change, and only
their optimizer state changes (like ``torch.optim.SparseAdam``); the state is
row-aligned with the shard, so it lives on the owner only and reshards with it.

With ``fused=True`` (like TorchRec's fused optimizers) the update happens in
backward instead: the owner applies the rule to the rows' gradient as soon as
its table's gradient exchange delivers it, with no ``local_weight.grad`` and
no pass in ``step()`` (which then does nothing for those tables). Each
backward through a lookup round is one update, so with one round per step
(the usual case, and always under ``group_tables``/``parallelize``) it trains
exactly as the unfused optimizer; gradient accumulation over several backward
passes is not available fused.

``defer=True`` saves one all-to-all per step: a backward's gradient rows
travel in the next lookup round's request and land before that round serves
any row. Fused, the owner applies them there. Unfused (``parallelize``'s
default), ``step()`` and ``zero_grad()`` on a table whose gradient is still in
flight are recorded, with the param group's values at the call (a scheduler
may change them), and replayed when it lands: added to ``local_weight.grad``,
then stepped and cleared. Training is exactly the same as with
``defer=False`` (gradient accumulation included); only when the shard itself
changes moves: at the next lookup, at ``sparsecomm.sharded.flush(model)``,
``save``/``load``, or the model's or optimizer's ``state_dict()`` (collectives
that push it): call ``flush(model)`` before reading ``local_weight`` or its
``grad`` yourself. Tables with replicated hot rows, and rounds whose next
request was prefetched, push at once.

These are ``torch.optim.Optimizer`` subclasses: ``param_groups[i]["lr"]`` is
the learning rate, so torch's LR schedulers drive them. A param group lists
each table by its ``weight`` (the zero-element stand-in through which torch's
distributed state dict names a table, :mod:`sparsecomm.sharded.table`); the
state is the shard's, ``state[table.local_weight]`` (``step`` and the
row-aligned tensors). ``state_dict()`` is collective and holds the row state
as the table's state dict holds its rows, the whole table in id order
(:mod:`sparsecomm.sharded.optimizer_state`), so ``torch.distributed.checkpoint``
saves it whole and ``load_state_dict()`` reshards it to any world size and scheme.

Each rule reproduces torch's sparse-gradient path for the same coalesced
gradient, so a sharded table trains like a replicated ``nn.Embedding(sparse=True)``
with ``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam``:

- ``ShardedSGD``: ``w -= lr * g``.
- ``ShardedAdagrad``: ``s += g^2; w -= clr * g / (sqrt(s) + eps)``,
  ``clr = lr / (1 + (step - 1) * lr_decay)``; ``rowwise=True`` keeps one
  accumulator per row (the mean of ``g^2``, as fbgemm's row-wise Adagrad), ``d``
  times less state.
- ``ShardedAdam``: SparseAdam's lazy Adam; bias correction uses the table's
  step count (every ``step()`` after a backward through the table), as
  SparseAdam does, so every row is corrected by the same global step.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from sparsecomm import ops
from sparsecomm.sharded import optimizer_state
from sparsecomm.sharded.model import sharded_modules
from sparsecomm.sharded.table import ShardedTable

__all__ = ["ShardedOptimizer", "ShardedSGD", "ShardedAdagrad", "ShardedAdam"]

ParamsT = Union[nn.Module, Iterable[Any]]


def _table_of(t: Any) -> ShardedTable:
    ref = getattr(t, "_sparsecomm_table", None)
    table = ref() if ref is not None else None
    if table is None:
        raise TypeError("sharded optimizers take sharded tables (ShardedEmbedding/ShardedEmbeddingBag), modules "
                        f"containing them, or their local_weight tensors; got {type(t).__name__}")
    return table


def _logged(p: torch.Tensor, slots: torch.Tensor) -> None:
    """Tell shard ``p``'s row log (if a stale replica keeps one: :mod:`sparsecomm.sharded.row_log`) that rows
    ``slots`` of its weight and state were just written."""
    log = _table_of(p).row_log
    if log is not None:
        log.mark(slots)


def _weights(items: Any) -> List[torch.Tensor]:
    """The tables' ``weight`` stand-ins, what a param group lists (from tables, modules or either tensor)."""
    if isinstance(items, (nn.Module, torch.Tensor)):
        items = [items]
    out: List[torch.Tensor] = []
    for item in items:
        if isinstance(item, ShardedTable):
            out.append(item.weight)
        elif isinstance(item, nn.Module):
            found = sharded_modules(item)
            if not found:
                raise ValueError(f"{type(item).__name__} contains no sharded table")
            out.extend(m.weight for _, m in found)
        else:
            out.append(_table_of(item).weight)
    return out


def _rows_like(p: torch.Tensor, shape=None) -> torch.Tensor:
    """Uninitialized row-aligned state for shard ``p`` (huge pages on the CPU: it is updated at random rows)."""
    return ops.empty_rows(tuple(p.shape if shape is None else shape), p.dtype, p.device)


def _add_rows(table: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``table[slots] += rows`` for unique slots, through the row kernel (faster than ``index_add_``)."""
    if table.dim() == 1:  # row-wise accumulators: one value per row
        ops.scatter_add_rows(table.view(-1, 1), slots, rows.reshape(-1, 1).contiguous())
    else:
        ops.scatter_add_rows(table, slots, rows.contiguous())


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of the owner-side optimizers: gathers the tables, coalesces gradients, calls the row rule.

    Args:
        params: a model (every sharded table in it), tables, their
            ``local_weight`` tensors, or param-group dicts of those.
        defaults: hyperparameters, as ``torch.optim.Optimizer``.
        fused: update in backward, as the gradient arrives (see the module docstring).
        defer: push a backward's gradient with the next lookup's request, one all-to-all fewer per step
            (see the module docstring).
    """

    #: Names of the row-aligned state tensors (resharded with the rows).
    row_state_names: Tuple[str, ...] = ()

    def __init__(self, params: ParamsT, defaults: Dict[str, Any], fused: bool = False, defer: bool = False
                 ) -> None:
        self.fused = bool(fused)
        self.defer = bool(defer)
        # Per shard (id of local_weight) whose gradient is in flight (unfused, defer=True): the step() and
        # zero_grad() calls made since, replayed when it lands.
        self._held: Dict[int, List[Tuple[str, Any]]] = {}
        # Strong references: the tables live as long as their optimizer does.
        self._tables: Dict[int, ShardedTable] = {}
        if isinstance(params, nn.Module):
            params = [params]
        params = list(params)
        if params and isinstance(params[0], dict):
            groups = [dict(g, params=_weights(g["params"])) for g in params]
        else:
            groups = [{"params": _weights(params)}]
        super().__init__(groups, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        param_group = dict(param_group, params=_weights(param_group["params"]))
        super().add_param_group(param_group)
        for p in param_group["params"]:
            table = _table_of(p)
            self._tables[id(p)] = table
            # State is made up front: the memory report is right from the start and
            # a checkpoint taken before the first step still holds every moment.
            self.state[table.local_weight] = self._init_state(table.local_weight, self.param_groups[-1])
            table.attach_optimizer(self)

    def _group_of(self, p: torch.Tensor) -> Dict[str, Any]:
        """The param group of the table whose shard is ``p``."""
        weight = _table_of(p).weight
        return next(g for g in self.param_groups if any(q is weight for q in g["params"]))

    def _init_state(self, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
        return {"step": 0}

    def _update(self, group: Dict[str, Any], p: torch.Tensor, state: Dict[str, Any], slots: torch.Tensor,
                grad: torch.Tensor) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def apply_rows(self, p: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, coalesced: bool = False) -> None:
        """Update ``p`` (a table's ``local_weight``) now with gradient ``rows`` at ``slots`` (repeats add up;
        ``coalesced``: the slots are already distinct and sorted).

        What a fused optimizer does when the table's backward delivers its
        gradient; the same rule and step count as :meth:`step`.
        """
        group = self._group_of(p)
        state = self.state[p]
        state["step"] += 1
        if slots.numel() == 0:
            return
        if not coalesced:
            slots, rows = ops.coalesce_rows(slots.contiguous(), rows.contiguous(), p.shape[0])
        self._update(group, p, state, slots, rows)
        _logged(p, slots)

    @torch.no_grad()
    def apply_hot(self, table: ShardedTable, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Update ``table``'s replicated hot rows at ``positions`` (distinct, sorted) with the gradient ``rows``
        summed over ranks, then write them through to the owner's shard (``sparsecomm.sharded.hot``).

        Every rank runs it with the same sum, so the replicas stay equal. It
        uses the table's current step count: call it after the step's
        increment (the cold rows' update, in backward or in :meth:`step`).
        """
        p = table.local_weight
        if positions.numel() == 0:
            return
        group = self._group_of(p)
        state = self.state[p]
        hot = table.hot
        self._update(group, hot.weight, dict(hot.state, step=state["step"]), positions, rows)
        _logged(p, hot.write_through(p, state, positions))

    def _step_hot(self, p: torch.Tensor) -> None:
        table = _table_of(p)
        if table.hot is not None:
            pending = table.hot.gradient()
            if pending is not None:
                self.apply_hot(table, *pending)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the tables' gradients (their shards'), including their hot rows' pending one."""
        super().zero_grad(set_to_none=set_to_none)
        for table in self._tables.values():
            held = self._held.get(id(table.local_weight))
            if held is not None:
                held.append(("zero", set_to_none))
            else:
                self._zero_shard(table, set_to_none)

    @staticmethod
    def _zero_shard(table: ShardedTable, set_to_none: bool) -> None:
        w = table.local_weight
        if w.grad is not None:
            if set_to_none:
                w.grad = None
            else:
                w.grad.requires_grad_(False)
                w.grad.zero_()
        if table.hot is not None:
            table.hot.clear_gradient()

    @torch.no_grad()
    def set_tables(self, tables: Sequence[ShardedTable], incoming: Dict[int, Dict[str, Any]]) -> None:
        """Make ``tables`` (in this order) the tables of the one param group (``sparsecomm.replan``).

        A table already here keeps its state; a new one (``id(table)`` in
        ``incoming``) gets ``incoming``'s ``step`` and row tensors (this
        rank's rows, slot order; a rule's tensor left out starts as a new
        table's would); tables left out are dropped with their state.
        An incoming row tensor of the state's shape, dtype and device that is
        contiguous becomes the state itself (the caller hands it over: no
        copy); another is copied into new state.

        Raises:
            ValueError: the optimizer has several param groups.
        """
        if len(self.param_groups) != 1:
            raise ValueError(f"{type(self).__name__}.set_tables needs one param group, it has "
                             f"{len(self.param_groups)}")
        group = self.param_groups[0]
        keep = {id(t) for t in tables}
        for q in group["params"]:
            old = self._tables.pop(id(q))
            if id(old) not in keep or id(old) in incoming:
                self.state.pop(old.local_weight, None)
            else:
                self._tables[id(q)] = old
        group["params"] = [t.weight for t in tables]
        for t in tables:
            if id(t) not in incoming:
                continue
            self._tables[id(t.weight)] = t
            self.state[t.local_weight] = self._incoming_state(t.local_weight, group, incoming[id(t)])
            t.attach_optimizer(self)

    def _incoming_state(self, p: torch.Tensor, group: Dict[str, Any], rows: Dict[str, Any]) -> Dict[str, Any]:
        """``set_tables``' state for shard ``p`` from ``rows``: tensors that fit taken over, others copied into
        new row state, missing names made fresh."""
        fresh = self._init_state(p, group) if any(n not in rows for n in self.row_state_names) else {}
        state = {"step": int(rows.get("step", 0))}
        for name in self.row_state_names:
            if name not in rows:
                state[name] = fresh[name]
                continue
            r, shape = rows[name], self._state_shape(p, name)
            fits = tuple(r.shape) == shape and r.dtype == p.dtype and r.device == p.device and r.is_contiguous()
            state[name] = r if fits else _rows_like(p, shape).copy_(r)
        return state

    def _state_shape(self, p: torch.Tensor, name: str) -> Tuple[int, ...]:
        """The shape of row state ``name`` of shard ``p`` (the shard's own; a rule keeping one value per row
        says otherwise)."""
        return tuple(p.shape)

    def tables(self) -> List[ShardedTable]:
        """The sharded tables this optimizer updates, in param-group order."""
        return [self._tables[id(p)] for g in self.param_groups for p in g["params"]]

    def memory_bytes(self) -> int:
        """Bytes of the row-wise state this rank holds (all its tables)."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))

    @torch.no_grad()
    def step(self, closure=None):
        """Apply each owned row's accumulated gradient; rows without one stay as they are. A shard whose
        gradient is still in flight (``defer=True``) steps when it lands, with the param group's values now.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for q in group["params"]:
                p = self._tables[id(q)].local_weight
                held = self._held.get(id(p))
                if held is not None:
                    held.append(("step", dict(group)))
                else:
                    self._step_shard(group, p)
        return loss

    def _step_shard(self, group: Dict[str, Any], p: torch.Tensor) -> None:
        if p.grad is None:
            return
        grad = p.grad
        if not grad.is_sparse:
            raise RuntimeError("sharded optimizers expect the sparse gradient a sharded table's backward "
                               "leaves in local_weight.grad")
        state = self.state[p]
        # Every rank's table receives a (possibly empty) gradient in each backward: step counts agree.
        state["step"] += 1
        if grad._nnz():
            if grad.is_coalesced():
                slots, values = grad._indices()[0], grad._values()
            else:
                slots, values = ops.coalesce_rows(grad._indices()[0].contiguous(),
                                                  grad._values().contiguous(), p.shape[0])
            self._update(group, p, state, slots, values)
            _logged(p, slots)
        self._step_hot(p)  # after the shard's rows: the hot rows write through into it

    def hold(self, p: torch.Tensor) -> None:
        """Shard ``p``'s gradient from the last backward travels later (``defer=True``, unfused): until
        :meth:`land`, :meth:`step` and :meth:`zero_grad` on it are recorded, not applied."""
        if not self.fused:
            self._held.setdefault(id(p), [])

    def in_flight(self, p: torch.Tensor) -> bool:
        calls = self._held.get(id(p))  # whether p's gradient is in flight and will not be cleared when it lands
        return calls is not None and (not calls or calls[-1][0] != "zero")

    @torch.no_grad()
    def land(self, p: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        """Shard ``p``'s deferred gradient arrived: add it to ``p.grad`` as backward would have, then replay the
        recorded ``step()`` and ``zero_grad()`` calls in order."""
        calls = self._held.pop(id(p), [])
        if grad is not None:
            p.grad = grad if p.grad is None else p.grad + grad
        for kind, arg in calls:
            if kind == "step":
                self._step_shard(arg, p)
            else:
                self._zero_shard(_table_of(p), arg)

    def state_dict(self) -> Dict[str, Any]:
        """The state of every table, whole and in id order, for any world size and scheme (collective).

        ``{"state": {i: {"step": ...}}, "param_groups": [...]}``: each param
        group as usual plus, aligned with its ``params``, each table's ``step`` and row state
        (:mod:`sparsecomm.sharded.optimizer_state`). ``torch.distributed.checkpoint``
        saves it without loss, directly or through ``get_state_dict``; a
        gradient a ``defer=True`` optimizer left pending lands first.
        """
        return optimizer_state.state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s form from any world size and scheme (collective), or the per-rank form of
        earlier versions at the same layout.

        Raises:
            ValueError: on every rank, before anything changes, when the state
                does not fit this optimizer's tables, groups or rule (the
                message names the rank and the table).
        """
        optimizer_state.load_state_dict(self, state_dict)


class ShardedSGD(ShardedOptimizer):
    """Plain SGD on the owned rows: ``w -= lr * g`` (as ``torch.optim.SGD`` with a sparse gradient).

    Args:
        params: see :class:`ShardedOptimizer`.
        lr: learning rate.
        fused, defer: see :class:`ShardedOptimizer`.
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, fused: bool = False, defer: bool = False) -> None:
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        super().__init__(params, dict(lr=lr), fused, defer)

    def _update(self, group, p, state, slots, grad):
        _add_rows(p, slots, grad * -group["lr"])


class ShardedAdagrad(ShardedOptimizer):
    """Adagrad on the owned rows (``torch.optim.Adagrad``'s sparse path), optionally row-wise.

    Args:
        params: see :class:`ShardedOptimizer`.
        lr, lr_decay, eps, initial_accumulator_value: as ``torch.optim.Adagrad``.
        rowwise: one accumulator per row (mean of the squared gradient over
            the row) instead of one per element: ``d`` times less state.
        fused, defer: see :class:`ShardedOptimizer`.
    """

    def __init__(self, params: ParamsT, lr: float = 1e-2, lr_decay: float = 0.0, eps: float = 1e-10,
                 initial_accumulator_value: float = 0.0, rowwise: bool = False, fused: bool = False,
                 defer: bool = False) -> None:
        for name, v in (("lr", lr), ("lr_decay", lr_decay), ("eps", eps),
                        ("initial_accumulator_value", initial_accumulator_value)):
            if v < 0:
                raise ValueError(f"invalid {name} {v}")
        self.rowwise = rowwise
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps,
                                      initial_accumulator_value=initial_accumulator_value), fused, defer)

    row_state_names = ("sum",)

    def _state_shape(self, p, name):
        return tuple(p.shape[:1] if self.rowwise else p.shape)

    def _init_state(self, p, group):
        return {"step": 0, "sum": _rows_like(p, self._state_shape(p, "sum")).fill_(group["initial_accumulator_value"])}

    def _update(self, group, p, state, slots, grad):
        clr = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
        acc = state["sum"]
        if self.rowwise and p.dtype in (torch.float32, torch.float64):
            ops.rowwise_adagrad_(p, acc, slots.to(torch.int64).contiguous(), grad.contiguous(), clr, group["eps"])
            return
        if self.rowwise:
            _add_rows(acc, slots, grad.pow(2).mean(dim=1))
            std = acc.index_select(0, slots).sqrt_().add_(group["eps"]).unsqueeze(1)
        else:
            _add_rows(acc, slots, grad.pow(2))
            std = acc.index_select(0, slots).sqrt_().add_(group["eps"])
        _add_rows(p, slots, (grad / std).mul_(-clr))


class ShardedAdam(ShardedOptimizer):
    """Lazy Adam on the owned rows (``torch.optim.SparseAdam``'s rule).

    Only rows with a gradient update their moments and values; bias
    correction uses the table's step count, as SparseAdam does.

    Args:
        params: see :class:`ShardedOptimizer`.
        lr, betas, eps: as ``torch.optim.SparseAdam``.
        fused, defer: see :class:`ShardedOptimizer`.
    """

    row_state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, fused: bool = False, defer: bool = False) -> None:
        if lr < 0 or eps < 0:
            raise ValueError(f"invalid lr {lr} or eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps), fused, defer)

    def _init_state(self, p, group):
        return {"step": 0, "exp_avg": _rows_like(p).zero_(), "exp_avg_sq": _rows_like(p).zero_()}

    def _update(self, group, p, state, slots, grad):
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # The same operations, in the same order, as torch.optim._functional.sparse_adam.
        old_avg = exp_avg.index_select(0, slots)
        avg_update = grad.sub(old_avg).mul_(1 - beta1)
        _add_rows(exp_avg, slots, avg_update)
        old_sq = exp_avg_sq.index_select(0, slots)
        sq_update = grad.pow(2).sub_(old_sq).mul_(1 - beta2)
        _add_rows(exp_avg_sq, slots, sq_update)
        numer = avg_update.add_(old_avg)
        denom = sq_update.add_(old_sq).sqrt_().add_(group["eps"])
        step = state["step"]
        step_size = group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        _add_rows(p, slots, -step_size * numer.div_(denom))
