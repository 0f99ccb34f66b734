"""Lookup rounds: every pending lookup of a set of sharded tables in one exchange per direction.

Each sharded table belongs to a :class:`TableSet` (tables on one process
group). A lookup joins its set's open *round*; a round runs:

- at once, for an *eager* set (a standalone table is an eager set of one:
  its forward returns a plain tensor, as ``nn.Embedding`` does);
- when the first result is needed, for a *lazy* set (:func:`group_tables`,
  used by ``sparsecomm.parallelize``): the table's forward returns a
  placeholder tensor of the right shape, dtype and device; the first torch
  operation that reads any placeholder of the round (``torch.cat``, ``+``,
  a ``Linear``, ``.sum()``, ``print``...) runs the round for all of them, as
  does the end of the model's forward and :meth:`TableSet.flush`.

A round, whatever the number of tables and lookups in it (a table looked up
twice asks for the union of its ids once): one all-to-all to request ids
(metadata, with the ids padded to the last round's largest count behind it;
a second one when the ids do not fit), one to pull rows, and in backward one
to push every table's gradient rows to their owners
(``sparsecomm.collectives.sharded_exchange``).
TorchRec gets the same from a ``KeyedJaggedTensor`` the user builds; here the
model's own code is unchanged.

Contract (as DDP's): ranks run the same code path, so their rounds hold the
same tables in the same order (checked: a mismatch raises on every rank);
every rank runs backward through a round whose results any rank
differentiates. A lookup whose result gets no gradient while others of its
round do sends zero rows (lazy optimizers then see a zero gradient for those rows).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from sparsecomm import ops
from sparsecomm.collectives.sharded_exchange import (STATUS_OK, Routes, TableRequest, exchange_rows, pull_rows,
                                                     request_rows, world)
from sparsecomm.types import SparseSyncStats

__all__ = ["Lookup", "TableSet", "group_tables", "flush"]

# Beyond this many ids per owner, a second all-to-all costs less than the padding could.
_MAX_CAPACITY = 1 << 16


class Lookup:
    """One call of one table: its ids, how to turn the table's rows into the result, and the result.

    Attributes:
        table: the sharded table.
        ids: ``(n,)`` int64 ids (empty when ``status`` is not OK).
        status: ``(code, detail, message)`` from the table's input check.
        finish: ``finish(rows, inverse, pad) -> result``: ``rows`` are the
            unique rows of the table in this round, ``inverse`` each id's
            position among them, ``pad`` the padding row's position or None.
        shape: the result's shape (known before the round runs).
    """

    __slots__ = ("table", "ids", "status", "finish", "shape", "grad_enabled", "result")

    def __init__(self, table, ids: torch.Tensor, status: Tuple[int, int, str],
                 finish: Callable[[torch.Tensor, torch.Tensor, Optional[int]], torch.Tensor],
                 shape: Tuple[int, ...]) -> None:
        self.table, self.ids, self.status, self.finish, self.shape = table, ids, status, finish, tuple(shape)
        self.grad_enabled = torch.is_grad_enabled()
        self.result: Optional[torch.Tensor] = None


# Tensor attributes that a placeholder answers without running its round.
_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
             torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.is_sparse.__get__,
             torch.Tensor.layout.__get__, torch.Tensor.__len__}


class PendingLookup(torch.Tensor):
    """A lazy set's lookup result before its round has run (see the module docstring).

    Shape, dtype and device are known; reading anything else runs the round
    and continues with the real tensor (an autograd-tracked plain tensor).
    """

    @staticmethod
    def __new__(cls, lookup: Lookup, dtype: torch.dtype, device: torch.device) -> "PendingLookup":
        t = torch.Tensor._make_wrapper_subclass(cls, lookup.shape, dtype=dtype, device=device)
        t._lookup = lookup
        return t

    def resolve(self) -> torch.Tensor:
        """The real result (runs the round if it has not run)."""
        lookup = self._lookup
        if lookup.result is None:
            lookup.table._set.flush()
        if lookup.result is None:
            raise RuntimeError("sparsecomm: this lookup's round failed (see the error raised when it ran)")
        return lookup.result

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(lambda x: x.resolve() if isinstance(x, PendingLookup) else x, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Only code that bypasses __torch_function__ gets here, below autograd: a
        # gradient would be lost silently, so refuse instead.
        raise RuntimeError(f"sparsecomm: a pending sharded-table lookup reached {func} below autograd; run "
                           f"sparsecomm.sharded.flush(model) (or pass the result through a torch operation) first")

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D401 - torch's signature
        return repr(self.resolve())


def resolve(tree: Any) -> Any:
    """``tree`` with every pending lookup replaced by its result (runs their rounds)."""
    return tree_map(lambda x: x.resolve() if isinstance(x, PendingLookup) else x, tree)


class _Table:
    """What a round keeps of one table: its unique ids, their owners, and the routes' slots."""

    __slots__ = ("unique", "part", "inverses", "pad", "slots")

    def __init__(self) -> None:
        self.unique = self.part = self.slots = None
        self.inverses: List[torch.Tensor] = []
        self.pad: Optional[int] = None


class _Round(torch.autograd.Function):
    """One round: every table's unique rows from their owners; backward pushes their gradients in one exchange."""

    @staticmethod
    def forward(ctx, table_set: "TableSet", state: Dict[str, Any], *weights: torch.Tensor):
        rows, routes, tables = table_set._pull(state)
        ctx.table_set, ctx.routes, ctx.tables = table_set, routes, tables
        ctx.set_materialize_grads(False)
        return tuple(rows)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.table_set._push(ctx.routes, ctx.tables, grads))


class TableSet:
    """Sharded tables whose lookups share rounds (one exchange per direction for all of them).

    Args:
        tables: sharded tables on the same process group, in the same order
            on every rank.
        lazy: True: lookups wait for the first use of a result (see the
            module docstring); False: each lookup runs its round at once.
        stats: the counters the round's bytes are added to (default: new ones;
            a table alone in its set shares its own ``stats``).
    """

    def __init__(self, tables: Sequence[Any], lazy: bool, stats: Optional[SparseSyncStats] = None) -> None:
        tables = list(tables)
        if not tables:
            raise ValueError("a TableSet needs at least one table")
        groups = {id(t._group) for t in tables}
        if len(groups) != 1:
            raise ValueError("tables of one TableSet must share their process group")
        if len({id(t) for t in tables}) != len(tables):
            raise ValueError("a table appears twice in a TableSet")
        self.tables = tables
        self._index = {id(t): i for i, t in enumerate(tables)}   # table -> its position in a round
        self.lazy = lazy
        self.group = tables[0]._group
        self.stats = stats if stats is not None else SparseSyncStats(world_size=world(self.group)[1])
        self.rounds = 0
        # Ids per owner that ride padded in the round's metadata all-to-all (saves one all-to-all per
        # round): the last round's largest count + 1/8 + 8, the same on every rank; 0 before the first round.
        self.capacity = 0
        self._open: List[Lookup] = []

    def submit(self, lookup: Lookup) -> torch.Tensor:
        """Add a lookup to the open round; its result, or a placeholder when the set is lazy."""
        self._open.append(lookup)
        if not self.lazy:
            self.flush()
            return lookup.result
        w = lookup.table.local_weight
        return PendingLookup(lookup, w.dtype, w.device)

    def flush(self) -> None:
        """Run the open round (collective: every rank flushes the same round). No-op when nothing is pending."""
        lookups, self._open = self._open, []
        if not lookups:
            return
        bad = next((lk.status for lk in lookups if lk.status[0] != STATUS_OK), None)
        state = {"lookups": lookups, "status": bad or (STATUS_OK, 0, "")}
        grad = any(lk.grad_enabled for lk in lookups)
        with torch.set_grad_enabled(grad):
            rows = _Round.apply(self, state, *[t.local_weight for t in self.tables])
        tables: List[_Table] = state["tables"]
        seen: Dict[int, int] = {}
        for lk in lookups:
            i = self._index[id(lk.table)]
            nth = seen.get(i, 0)
            seen[i] = nth + 1
            info = tables[i]
            with torch.set_grad_enabled(lk.grad_enabled):
                lk.result = lk.finish(rows[i], info.inverses[nth], info.pad)

    # ------------------------------------------------------------ the round

    def _pull(self, state: Dict[str, Any]) -> Tuple[List[torch.Tensor], Routes, List[_Table]]:
        lookups: List[Lookup] = state["lookups"]
        status = state["status"]
        ok = status[0] == STATUS_OK
        ids_of: List[List[torch.Tensor]] = [[] for _ in self.tables]
        for lk in lookups:
            ids_of[self._index[id(lk.table)]].append(lk.ids)
        tables = [_Table() for _ in self.tables]
        requests = []
        for t, info, ids in zip(self.tables, tables, ids_of):
            device = t.local_weight.device
            flat = torch.cat(ids) if ids and ok else torch.empty(0, dtype=torch.int64, device=device)
            info.unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
            info.inverses = list(torch.split(inverse, [x.numel() for x in ids])) if ids and ok else \
                [inverse] * len(ids)
            info.pad = t._padding_position(info.unique)
            info.part = t.layout.partition(info.unique)
            t.stats.rows_in += int(flat.numel())
            requests.append(TableRequest(info.part.ids, info.part.counts, t.fingerprint(), t.num_embeddings,
                                         t.layout.num_local, bool(ids), t.layout.owns))
        routes = request_rows(requests, status=status[0], detail=status[1], message=status[2],
                              round=self.rounds, group=self.group, stats=self.stats, capacity=self.capacity)
        self.rounds += 1
        self.capacity = min(_MAX_CAPACITY, routes.largest + routes.largest // 8 + 8)
        served = []
        for t, info, requested in zip(self.tables, tables, routes.requested):
            weight = t.local_weight.detach()
            if routes.problem is None:
                info.slots = t.layout.slots(requested).to(weight.device)
                served.append(ops.gather_rows(weight, info.slots))
            else:  # a peer sent ids this rank does not own: serve nothing, every rank raises in pull_rows
                info.slots = torch.empty(0, dtype=torch.int64, device=weight.device)
                served.append(weight.new_zeros(requested.shape[0], t.embedding_dim))
        got = pull_rows(served, routes, self.group, self.stats)
        rows = [torch.empty_like(g).index_copy_(0, info.part.perm, g) for g, info in zip(got, tables)]
        state["tables"] = tables
        return rows, routes, tables

    def _push(self, routes: Routes, tables: List[_Table], grads: Sequence[Optional[torch.Tensor]]
              ) -> List[Optional[torch.Tensor]]:
        # Which tables get a gradient is the same on every rank: looked up by some rank, and trainable.
        pushing = [p and t.local_weight.requires_grad for p, t in zip(routes.present, self.tables)]
        n = len(routes.send[0])
        send = [s if p else [0] * n for s, p in zip(routes.send, pushing)]
        recv = [r if p else [0] * n for r, p in zip(routes.recv, pushing)]
        rows = []
        for t, info, g, p in zip(self.tables, tables, grads, pushing):
            if not p:
                rows.append(t.local_weight.new_empty(0, t.embedding_dim))
                continue
            if g is None:  # looked up, but its result got no gradient this time
                g = t.local_weight.new_zeros(info.unique.numel(), t.embedding_dim)
            rows.append(g.contiguous().index_select(0, info.part.perm))
        got = exchange_rows(rows, Routes(send, recv, routes.requested, routes.present, None), self.group,
                            self.stats)
        return [t._owner_gradient(info.slots, requested, g) if p else None
                for t, info, requested, g, p in zip(self.tables, tables, routes.requested, got, pushing)]


def group_tables(model: nn.Module, tables: Optional[Sequence[Any]] = None) -> TableSet:
    """Make the sharded tables of ``model`` share lookup rounds (lazy): one exchange per direction per step.

    Every rank calls it, on the same model. A forward hook on ``model`` runs
    any round still open when its forward returns, and gives the caller real
    tensors in place of placeholders.

    Args:
        model: the module whose forward looks the tables up (not a DDP wrapper:
            pass ``ddp.module``, or group before wrapping).
        tables: the tables to group (default: every sharded table of ``model``).

    Returns:
        The :class:`TableSet` (``flush()`` runs an open round by hand; ``stats``
        counts the bytes of every round).
    """
    from sparsecomm.sharded.embedding import sharded_modules  # the tables' module imports this one

    if tables is None:
        tables = [t for _, t in sharded_modules(model)]
    if not tables:
        raise ValueError(f"{type(model).__name__} contains no sharded table to group")
    table_set = TableSet(tables, lazy=True)
    for t in tables:
        t._set.flush()  # a lookup still pending in its old set runs there first
        t._set = table_set

    def finish_forward(module, args, output):
        table_set.flush()
        return resolve(output)

    table_set.hook = model.register_forward_hook(finish_forward)
    return table_set


def flush(model: nn.Module) -> None:
    """Run every open round of ``model``'s sharded tables (collective)."""
    from sparsecomm.sharded.embedding import sharded_modules

    done = set()
    for _, t in sharded_modules(model):
        if id(t._set) not in done:
            done.add(id(t._set))
            t._set.flush()
