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

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from sparsecomm import ops
from sparsecomm.collectives.sharded_exchange import (Carry, PooledRequest, Routes, TableRequest, exchange_rows,
                                                     finish_request, pull_rows, start_request, world)
from sparsecomm.collectives.sharded_wire import InputStatus, encode_pooled
from sparsecomm.sharded.hot import sync_hot_gradients
from sparsecomm.types import SparseSyncStats

__all__ = ["Bags", "Lookup", "TableSet", "group_tables", "flush", "pool_rows", "choose_pooling"]

# Beyond this many ids per owner, a second all-to-all costs less than the padding could.
_MAX_CAPACITY = 1 << 16


class Bags:
    """How a bag lookup's ids form bags, for owner-side pooling (sum or mean).

    Attributes:
        num_bags: bags in the result.
        mode: ``"sum"`` or ``"mean"``.
        lengths: ``(num_bags,)`` int64 ids per bag (consecutive in the flat
            ids, which they cover: the table refuses ids after the last bag).
        weights: ``(n,)`` per-sample weights (not requiring grad), or None.
        backward_seconds: how long the rows path's pooling backward took
            (:func:`pool_rows`), for ``owner_pooling="auto"``'s timing.
    """

    __slots__ = ("num_bags", "mode", "lengths", "weights", "backward_seconds")

    def __init__(self, num_bags: int, mode: str, lengths: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
        self.num_bags, self.mode, self.lengths, self.weights = num_bags, mode, lengths, weights
        self.backward_seconds = 0.0   # the requester's pooling backward on the rows path (owner_pooling="auto")

    def counts(self, bag_of: torch.Tensor) -> torch.Tensor:
        """``(num_bags,)`` int64: how many of the ids with bags ``bag_of`` each bag holds."""
        return torch.bincount(bag_of, minlength=self.num_bags)[:self.num_bags]

    def bag_of(self, n: int) -> torch.Tensor:
        """``(n,)`` int64: each of the ``n`` flat ids' bag."""
        lengths = self.lengths
        return torch.repeat_interleave(torch.arange(self.num_bags, device=lengths.device), lengths, output_size=n)


class Lookup:
    """One call of one table: its ids, how to turn the table's rows into the result, and the result.

    Attributes:
        table: the sharded table.
        ids: ``(n,)`` int64 ids (empty when ``status`` is not OK).
        status: the table's verdict on the input (:class:`~sparsecomm.collectives.sharded_wire.InputStatus`).
        finish: ``finish(rows, inverse, pad) -> result``: ``rows`` are the
            unique rows of the table in this round, ``inverse`` each id's
            position among them, ``pad`` the padding row's position or None.
        shape: the result's shape (known before the round runs).
        bags: for a bag lookup that owners may pool (sum/mean, weights
            without gradient): its :class:`Bags`; else None.
    """

    __slots__ = ("table", "ids", "status", "finish", "shape", "grad_enabled", "result", "bags")

    def __init__(self, table, ids: torch.Tensor, status: InputStatus,
                 finish: Callable[[torch.Tensor, torch.Tensor, Optional[int]], torch.Tensor],
                 shape: Tuple[int, ...], bags: Optional[Bags] = None) -> None:
        self.table, self.ids, self.status, self.finish, self.shape = table, ids, status, finish, tuple(shape)
        self.bags = bags
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
    """What a round keeps of one table.

    As requester: its unique ids, their owners (of the cold ones, when the
    table replicates hot rows), each lookup's inverse into the round's rows
    (in the order they arrive: by owner, then the hot rows), and
    for a pooled lookup the bag of every partial row it gets back. As owner:
    the slots whose gradient rows it receives (``grad_slots``, their ids
    ``grad_ids``); when some requester pooled, those are the distinct slots, and
    slot ``u`` gets the sum of gradient rows ``grad_rows[grad_offsets[u]:grad_offsets[u + 1]]``
    (times ``grad_scale``): one bag per slot.
    """

    __slots__ = ("unique", "part", "inverses", "pad", "pooled", "timed", "bag_rows", "bag_counts", "bags",
                 "grad_slots", "grad_ids", "grad_offsets", "grad_rows", "grad_scale", "hot_positions",
                 "finish_seconds", "row_bags")

    def __init__(self) -> None:
        self.unique = self.part = None
        # Replicated hot rows: the positions in the table's hot set of the round's hot ids (their rows follow
        # the cold rows), or None.
        self.hot_positions: Optional[torch.Tensor] = None
        # "auto" timing beyond the round: the requester's work on the rows it got (pooling them, or adding the
        # partial bags), and on the rows path the bags whose pooling backward times itself.
        self.finish_seconds = 0.0
        self.row_bags: Optional[Bags] = None
        self.inverses: List[torch.Tensor] = []
        self.pad: Optional[int] = None
        self.pooled = self.timed = False
        self.bag_rows = self.bag_counts = self.bags = None
        self.grad_slots = self.grad_ids = self.grad_offsets = self.grad_rows = self.grad_scale = None


class _Awaiting:
    """Counts a round in its set's ``_awaiting`` from its forward until its backward starts or its graph is freed."""

    __slots__ = ("table_set", "open")

    def __init__(self, table_set: "TableSet") -> None:
        self.table_set, self.open = table_set, True
        table_set._awaiting += 1

    def close(self) -> None:
        if self.open:
            self.open = False
            self.table_set._awaiting -= 1

    def __del__(self) -> None:
        self.close()


class _Deferred(NamedTuple):
    """A round's gradient rows whose push waits for the next round's request (optimizers with ``defer=True``)."""

    tables: List[_Table]          # the round's owner-side records (where each gradient row goes)
    pushing: List[bool]           # per table: whether it gets a gradient (the same on every rank)
    routes: Routes                # the round's routes: rows_send / rows_recv count the gradient rows per peer
    rows: List[torch.Tensor]      # per table, the gradient rows, those for each owner consecutive

    def carry(self) -> Carry:
        """The rows as a request carries them."""
        return Carry(self.rows, self.routes.rows_send, self.routes.rows_recv)


class _Round(torch.autograd.Function):
    """One round: every table's unique rows from their owners; backward pushes their gradients in one exchange."""

    @staticmethod
    def forward(ctx, table_set: "TableSet", state: Dict[str, Any], *weights: torch.Tensor):
        start = time.perf_counter()
        rows, routes, tables = table_set._pull(state)
        ctx.table_set, ctx.routes, ctx.tables = table_set, routes, tables
        ctx.awaiting = _Awaiting(table_set) if state.get("grad") else None
        ctx.pull_seconds = time.perf_counter() - start
        ctx.set_materialize_grads(False)
        return tuple(rows)

    @staticmethod
    def backward(ctx, *grads):
        start = time.perf_counter()
        if ctx.awaiting is not None:
            ctx.awaiting.close()
        out = ctx.table_set._push(ctx.routes, ctx.tables, grads)
        ctx.table_set._record(ctx.tables, ctx.pull_seconds + time.perf_counter() - start)
        return (None, None, *out)


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
        # Per bag table with owner_pooling "auto"/"bytes": whether its next lookup is pooled at the owners,
        # decided from every rank's numbers in the last round's metadata (so the same on every rank).
        self._pool_next: Dict[int, bool] = {}
        # A round whose id exchange started early (prefetch), waiting for its lookups.
        self._prefetched: Optional[Dict[str, Any]] = None
        # Per table ("auto"): per path (rows, pooled), this rank's rounds and its last measured round times (us).
        self._timing: Dict[int, Tuple[List[Any], List[Any]]] = {}
        # Per table with hot rows: the window (round number // window) in which it last chose its hot set.
        self._hot_epoch: Dict[int, int] = {}
        # Rounds whose backward may still run (gradient enabled, graph alive): while any is, hot sets stay
        # as they are, since those rounds' gradients are addressed to positions in them.
        self._awaiting = 0
        # A backward's gradient rows not pushed yet: they ride in the next round's request (or push_deferred()).
        self._deferred: Optional[_Deferred] = None

    def prefetch(self, lookups: Sequence[Lookup]) -> None:
        """Start the id exchange of a round now, in the background (collective: every rank prefetches alike).

        The round runs when exactly these lookups are submitted, in this order
        (``table(handle)`` with the handles of :func:`prefetch`): its rows are
        pulled then, so they include every update made in between.
        """
        self.flush()
        if self._prefetched is not None:  # prefetched but never used: end it (every rank does the same)
            self._finish(self._prefetched)
        self.push_deferred()  # a prefetched request starts in the background: it carries no gradient rows
        bad = next((lk.status for lk in lookups if not lk.status.ok), None)
        state = {"lookups": list(lookups), "status": bad or InputStatus()}
        self._request(state, async_op=True)
        self._prefetched = state

    def submit(self, lookup: Lookup) -> torch.Tensor:
        """Add a lookup to the open round; its result, or a placeholder when the set is lazy."""
        self._open.append(lookup)
        if not self.lazy:
            self.flush()
            return lookup.result
        w = lookup.table.local_weight
        return PendingLookup(lookup, w.dtype, w.device)

    def run(self, lookup: Lookup) -> torch.Tensor:
        """Run ``lookup`` now, with any lookup already open, even in a lazy set; its real result."""
        self._open.append(lookup)
        self.flush()
        return lookup.result

    def flush(self) -> None:
        """Run the open round (collective: every rank flushes the same round). No-op when nothing is pending."""
        lookups, self._open = self._open, []
        if not lookups:
            return
        state = self._prefetched
        self._prefetched = None
        if state is not None and [id(x) for x in state["lookups"]] != [id(x) for x in lookups]:
            self._finish(state)  # prefetched, then not used as prefetched: end it, unused
            state = None
        if state is not None and self._hot_due():
            # Prefetched while an earlier round awaited its backward (no hot set could change then): choose now,
            # and if a set changed, end the prefetched request (it split the ids by the old set) and ask again.
            if self._choose_hot_rows():
                self._finish(state)
                state = None
        if state is None:
            bad = next((lk.status for lk in lookups if not lk.status.ok), None)
            state = {"lookups": lookups, "status": bad or InputStatus()}
        grad = any(lk.grad_enabled for lk in lookups)
        state["grad"] = grad
        with torch.set_grad_enabled(grad):
            rows = _Round.apply(self, state, *[t.local_weight for t in self.tables])
        tables: List[_Table] = state["tables"]
        seen: Dict[int, int] = {}
        for lk in lookups:
            i = self._index[id(lk.table)]
            nth = seen.get(i, 0)
            seen[i] = nth + 1
            info = tables[i]
            start = time.perf_counter()
            with torch.set_grad_enabled(lk.grad_enabled):
                lk.result = _pool(rows[i], info) if info.pooled else lk.finish(rows[i], info.inverses[nth], info.pad)
            info.finish_seconds += time.perf_counter() - start

    # ------------------------------------------------------------ the round

    def _pooling(self, t: Any, ids: List[Lookup], ok: bool) -> Optional[Lookup]:
        """The lookup to pool at its owners this round, or None (rows path)."""
        if not ok or len(ids) != 1 or ids[0].bags is None or t.hot is not None:
            return None
        choice = getattr(t, "owner_pooling", "never")
        if choice == "always" or (choice in ("auto", "bytes") and self._pool_next.get(id(t), False)):
            return ids[0]
        return None

    def _measured(self, t: Any) -> Tuple[int, int]:
        """This rank's measured round time (microseconds) by rows and pooled: the fastest of the last
        ``MEASURED_ROUNDS`` rounds of the path (other work on the machine only ever adds time), 0 until it
        has that many."""
        timing = self._timing.get(id(t))
        if timing is None:
            return 0, 0
        return tuple(int(min(us)) if len(us) >= MEASURED_ROUNDS else 0  # type: ignore[return-value]
                     for _, us in timing)

    def _record(self, tables: List[_Table], seconds: float) -> None:
        """Add a finished lookup's time to the path each "auto" table took: the round (pull + push) and
        the requester's own work on the rows (pooling them and its backward, or adding the partial bags).

        The first round of each path is not counted (it pays for first-touch buffers and warm-up); a path's
        time is the fastest of its last ``MEASURED_ROUNDS`` rounds, so rounds slowed by other work on the
        machine do not decide.
        """
        for t, info in zip(self.tables, tables):
            if not info.timed:
                continue
            path = self._timing.setdefault(id(t), ([0, []], [0, []]))[int(info.pooled)]
            path[0] += 1
            if path[0] >= 2:
                own = info.finish_seconds + (info.row_bags.backward_seconds if info.row_bags is not None else 0.0)
                path[1] = (path[1] + [max(1.0, (seconds + own) * 1e6)])[-MEASURED_ROUNDS:]

    def _request(self, state: Dict[str, Any], async_op: bool = False) -> None:
        """Build the round's requests and start its id exchange (in the background with ``async_op``)."""
        lookups: List[Lookup] = state["lookups"]
        status = state["status"]
        ok = status.ok
        of_table: List[List[Lookup]] = [[] for _ in self.tables]
        for lk in lookups:
            of_table[self._index[id(lk.table)]].append(lk)
        tables = [_Table() for _ in self.tables]
        requests = []
        me, n = world(self.group)
        self._choose_hot_rows()
        for t, info, lks in zip(self.tables, tables, of_table):
            device = t.local_weight.device
            pooled = self._pooling(t, lks, ok)
            if pooled is not None:
                requests.append(self._pooled_request(t, info, pooled, me, n))
                t.stats.pooled_lookups += 1
                continue
            ids = [lk.ids for lk in lks]
            flat = torch.cat(ids) if ids and ok else torch.empty(0, dtype=torch.int64, device=device)
            info.unique, inverse = ops.unique_inverse(flat, t.num_embeddings)
            info.inverses = list(torch.split(inverse, [x.numel() for x in ids])) if ids and ok else \
                [inverse] * len(ids)
            info.pad = t._padding_position(info.unique)
            cold, hot_mask = info.unique, None
            hot = t.hot
            if hot is not None and ok:
                hot.count(info.unique, torch.bincount(inverse, minlength=info.unique.numel()))
                split = hot.split(info.unique)
                if split is not None:  # hot rows come from the replica; only the cold ones travel
                    hot_mask, info.hot_positions = split
                    cold = info.unique[~hot_mask]
            info.part = t.layout.partition(cold)
            t.stats.rows_in += int(flat.numel())
            t.stats.row_lookups += len(lks)
            estimates = (0, 0)
            choice = getattr(t, "owner_pooling", "never")
            if ok and len(lks) == 1 and lks[0].bags is not None and hot is None:
                if choice == "bytes":
                    estimates = _estimates(t, info, inverse, lks[0].bags, me)
                elif choice == "auto":
                    estimates, info.timed = self._measured(t), True
                    info.row_bags = lks[0].bags
            if info.unique.numel():
                # The rows arrive by owner, then the hot ones from the replica: point the lookups there instead
                # of sorting the rows back (and backward's gradient rows are then in the order they travel).
                arrival = info.part.perm if hot_mask is None else \
                    torch.cat([(~hot_mask).nonzero().view(-1)[info.part.perm], hot_mask.nonzero().view(-1)])
                where = torch.empty_like(arrival)
                where[arrival] = torch.arange(where.numel(), device=where.device)
                info.inverses = [where[x] for x in info.inverses]
                info.pad = int(where[info.pad]) if info.pad is not None else None
            requests.append(TableRequest(info.part.ids, info.part.counts, t.fingerprint(), t.num_embeddings,
                                         t.layout.num_local, bool(lks), t.layout.owns,
                                         weight_dtype=t.local_weight.dtype, estimates=estimates))
        state["tables"] = tables
        carry = None
        if self._deferred is not None and not async_op:  # the last backward's gradient rows travel along
            state["deferred"], self._deferred = self._deferred, None
            carry = state["deferred"].carry()
        state["pending"] = start_request(requests, status, round=self.rounds, group=self.group, stats=self.stats,
                                         capacity=self.capacity, async_op=async_op, carry=carry)

    def _hot_due(self) -> List[Any]:
        """Tables with hot rows whose window ended since their last choice, when no round awaits its backward."""
        if self._awaiting:
            return []
        return [t for t in self.tables if t.hot is not None
                and self.rounds // t.hot.config.window > self._hot_epoch.get(id(t), 0)]

    def _choose_hot_rows(self) -> bool:
        """Each table whose window ended chooses its next hot set (collective, all ranks alike); whether any changed.

        Every rank holds the same round count and the same rounds awaiting
        backward (ranks run the same code), so every rank makes the same calls.
        """
        changed = False
        for t in self._hot_due():
            self._hot_epoch[id(t)] = self.rounds // t.hot.config.window
            version = t.hot.version
            t.hot.choose(t, self.group)
            changed = changed or t.hot.version != version
        return changed

    def _finish(self, state: Dict[str, Any]) -> Routes:
        """Wait for a started round's id exchange and check it; the round counts once it passed.

        Gradient rows that rode along (a deferred push) are applied first,
        whatever the checks find: they belong to an earlier, validated round.
        """
        pending, deferred = state.pop("pending"), state.pop("deferred", None)
        try:
            routes = finish_request(pending)
        finally:
            if deferred is not None and pending.carried is not None:
                self._owner_gradients(deferred.tables, deferred.pushing, pending.carried)
        self.rounds += 1
        return routes

    def _pull(self, state: Dict[str, Any]) -> Tuple[List[torch.Tensor], Routes, List[_Table]]:
        if "pending" not in state:  # else prefetched: the id exchange already started
            self._request(state)
        tables: List[_Table] = state["tables"]
        routes = self._finish(state)
        self.capacity = min(_MAX_CAPACITY, routes.largest + routes.largest // 8 + 8)
        for t, per_rank in zip(self.tables, routes.estimates):
            nxt = choose_pooling(getattr(t, "owner_pooling", "never"), per_rank, self.rounds)
            if nxt is not None:  # every rank holds the same numbers: the same choice everywhere
                self._pool_next[id(t)] = nxt
        served = [self._serve(t, i, info, requested, parts, routes)
                  for i, (t, info, requested, parts) in enumerate(zip(self.tables, tables, routes.requested,
                                                                      routes.pooled))]
        got = pull_rows(served, routes, self.group, self.stats)
        rows = [g if info.hot_positions is None else torch.cat([g, t.hot.weight.index_select(0, info.hot_positions)])
                for t, g, info in zip(self.tables, got, tables)]
        return rows, routes, tables

    def _pooled_request(self, t: Any, info: _Table, lk: Lookup, me: int, n: int) -> TableRequest:
        """A pooled lookup's request: unique ids by owner, and per owner each occurrence's position and bag."""
        bags = lk.bags
        flat = lk.ids
        bag_of = bags.bag_of(flat.numel())
        weights = bags.weights
        keep = flat != t.padding_idx if t.padding_idx is not None else None
        if keep is not None and not bool(keep.all()):
            flat, bag_of = flat[keep], bag_of[keep]
            weights = weights[keep] if weights is not None else None
        t.stats.rows_in += int(flat.numel())
        info.pooled, info.bags = True, bags
        info.bag_counts = bags.counts(bag_of) if bags.mode == "mean" \
            else None
        # One pass (ops.pooled_request): occurrences grouped by owner, bag order kept inside an owner; per
        # owner its distinct ids (sorted), each occurrence's position among them, and its partial bags' lengths.
        layout = t.layout
        plan = ops.pooled_request(flat, bag_of, n, layout.scheme, t.num_embeddings, layout.range_size,
                                  num_bags=bags.num_bags)
        occ_counts = plan.occ_counts.tolist()
        counts = plan.unique_counts.cpu()
        info.unique = plan.unique
        info.bag_rows = plan.bag_rows
        w = weights[plan.order] if weights is not None else None
        positions = torch.split(plan.positions, occ_counts)
        len_split = torch.split(plan.lengths, plan.bag_counts.tolist())
        w_split = torch.split(w, occ_counts) if w is not None else [None] * n
        words = [encode_pooled(p, ln, x) for p, ln, x in zip(positions, len_split, w_split)]
        weight_bytes = t.local_weight.element_size() if w is not None else 0
        info.timed = t.owner_pooling == "auto"
        estimates = _pooled_estimates(t, counts, plan.occ_counts, plan.bag_counts, weight_bytes, me) \
            if t.owner_pooling == "bytes" else self._measured(t) if info.timed else (0, 0)
        return TableRequest(info.unique, counts, t.fingerprint(), t.num_embeddings, layout.num_local, True,
                            layout.owns, PooledRequest(plan.occ_counts, plan.bag_counts, words, weight_bytes),
                            t.local_weight.dtype, estimates)

    def _serve(self, t: Any, i: int, info: _Table, requested: torch.Tensor, parts: List[Any], routes: Routes
               ) -> torch.Tensor:
        """The rows (or partial pooled bags) this owner sends back for table ``i``, grouped by requester."""
        weight = t.local_weight.detach()
        if routes.problem is not None:  # a peer sent ids this rank does not own: serve nothing, all raise in pull
            return weight.new_zeros(sum(routes.rows_recv[i]), t.embedding_dim)
        slots = t.layout.slots(requested).to(weight.device)
        info.grad_slots, info.grad_ids = slots, requested
        if all(p is None for p in parts):
            return ops.gather_rows(weight, slots)
        # Some requesters pool: per requester, one partial bag per bag it sent, or (rows path) each id as a bag
        # of its own; all of them in one embedding_bag. Backward adds each gradient row (times the weight) into
        # the coalesced gradient of the distinct slots asked for.
        info.grad_slots, where = ops.unique_inverse(slots, max(t.layout.num_local, 1))
        info.grad_ids = torch.empty_like(info.grad_slots).index_copy_(0, where, requested)
        dev = weight.device
        any_weights = any(p is not None and p.weights is not None for p in parts)
        positions, lengths, scales = [], [], []
        start = 0
        for p, count in zip(parts, routes.recv[i]):
            if p is None:
                positions.append(torch.arange(start, start + count, device=dev))
                lengths.append(torch.ones(count, dtype=torch.int64, device=dev))
            else:
                positions.append(p.positions + start)
                lengths.append(p.lengths)
            if any_weights:
                scales.append(p.weights if p is not None and p.weights is not None else
                              weight.new_ones(positions[-1].numel()))
            start += count
        positions, lengths = torch.cat(positions), torch.cat(lengths)
        scale = torch.cat(scales) if any_weights else None
        # Backward sums, per distinct slot, its occurrences' gradient rows in input order (one embedding_bag
        # over the few gradient rows): ops.bag_groups sorts the occurrences by slot and names their bags.
        order, info.grad_rows, info.grad_offsets = ops.bag_groups(where, positions, lengths, info.grad_slots.numel())
        info.grad_scale = scale[order] if any_weights else None
        if lengths.numel() == 0:
            return weight.new_zeros(0, t.embedding_dim)
        return F.embedding_bag(slots[positions], weight, torch.cumsum(lengths, 0) - lengths, mode="sum",
                               per_sample_weights=scale)

    def _push(self, routes: Routes, tables: List[_Table], grads: Sequence[Optional[torch.Tensor]]
              ) -> List[Optional[torch.Tensor]]:
        # Which tables get a gradient is the same on every rank: looked up by some rank, and trainable.
        pushing = [p and t.local_weight.requires_grad for p, t in zip(routes.present, self.tables)]
        n = len(routes.send[0])
        send = [s if p else [0] * n for s, p in zip(routes.rows_send, pushing)]
        recv = [r if p else [0] * n for r, p in zip(routes.rows_recv, pushing)]
        rows = []
        hot_entries, hot_tables = [], []
        for t, info, g, p, count in zip(self.tables, tables, grads, pushing, send):
            if not p:
                rows.append(t.local_weight.new_empty(0, t.embedding_dim))
                continue
            if g is None:  # looked up, but its result got no gradient this time
                size = sum(count) if info.pooled or info.unique is None else info.unique.numel()
                g = t.local_weight.new_zeros(size, t.embedding_dim)
            if t.hot is not None and t.hot.size:  # every rank takes part in the hot rows' sum, looked up or not
                hot_tables.append(t)
                positions = info.hot_positions if info.hot_positions is not None else \
                    torch.empty(0, dtype=torch.int64, device=g.device)
                cold = g.shape[0] - positions.numel()   # the hot rows' gradient follows the cold rows'
                hot_entries.append((t.hot, positions, g[cold:]))
                g = g[:cold]
            # In the order the rows travel: by owner (rows), or one gradient row per partial bag (pooled).
            rows.append(g.contiguous())
        routes = routes._replace(rows_send=send, rows_recv=recv, problem=None)
        if self._defers(pushing):
            self.push_deferred()  # an earlier round's pending gradient is applied first (updates keep their order)
            self._deferred = _Deferred(tables, pushing, routes, rows)
            return [None] * len(self.tables)
        got = exchange_rows(rows, routes, self.group, self.stats)
        hot_sums = sync_hot_gradients(hot_entries, self.group, n, [t.grad_reduction == "mean" for t in hot_tables],
                                      [t.stats for t in hot_tables])
        out = self._owner_gradients(tables, pushing, got)
        for t, (positions, rows) in zip(hot_tables, hot_sums):
            t._hot_gradient(positions, rows)
        return out

    def _owner_gradients(self, tables: List[_Table], pushing: Sequence[bool], got: Sequence[torch.Tensor]
                         ) -> List[Optional[torch.Tensor]]:
        """Each table's gradient from the rows pushed to this owner (None: not pushed, or applied by a fused
        optimizer)."""
        out = []
        for t, info, g, p in zip(self.tables, tables, got, pushing):
            if not p:
                out.append(None)
                continue
            coalesced = info.grad_rows is not None
            if coalesced:  # pooled requesters: each occurrence adds its bag's gradient (times its weight) to its row's
                g = F.embedding_bag(info.grad_rows, g, info.grad_offsets, mode="sum",
                                    per_sample_weights=info.grad_scale)
            out.append(t._owner_gradient(info.grad_slots, info.grad_ids, g, coalesced=coalesced))
        return out

    def _defers(self, pushing: Sequence[bool]) -> bool:
        """Whether this backward's push waits for the next request: every table that gets a gradient has a
        fused optimizer with ``defer=True`` and no hot rows, and no request was started early (prefetch).

        Ranks attach the same optimizers and prefetch alike, so all decide the same.
        """
        if self._prefetched is not None or not any(pushing):
            return False
        for t, p in zip(self.tables, pushing):
            if not p:
                continue
            opt = t._optimizer() if t._optimizer is not None else None
            if opt is None or not getattr(opt, "fused", False) or not getattr(opt, "defer", False) \
                    or t.hot is not None:
                return False
        return True

    def push_deferred(self) -> None:
        """Push and apply a backward's gradient that waits for the next round (collective; no-op when none is
        pending, which every rank agrees on).

        With ``defer=True`` optimizers the gradient of a round's backward
        travels in the next round's request and is applied before that round
        serves any row; this pushes it now instead: :func:`flush`,
        ``sparsecomm.sharded.save``/``load`` and :meth:`prefetch` call it.
        """
        d, self._deferred = self._deferred, None
        if d is None:
            return
        got = exchange_rows(d.rows, d.routes, self.group, self.stats)
        self._owner_gradients(d.tables, d.pushing, got)

    def settle(self) -> None:
        """Run the open round and push a pending deferred gradient (collective): the shards hold every update."""
        self.flush()
        self.push_deferred()


class _PoolRows(torch.autograd.Function):
    """Sum/mean bags of a round's unique rows; backward sums each row's bag gradients as one embedding_bag.

    torch's dense ``embedding_bag`` backward (what the rows would otherwise
    get) sorts and reduces per element: 3.1 ms for 2048 bags of 8 here, 1.4 ms
    this way (occurrences sorted by row, then summed per row from the
    cache-resident bag gradients).
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor, bags: Bags, pad: Optional[int]) -> torch.Tensor:
        lengths = bags.lengths
        out = F.embedding_bag(inverse, rows, torch.cumsum(lengths, 0) - lengths, mode=bags.mode,
                              per_sample_weights=bags.weights, padding_idx=pad)
        ctx.save_for_backward(inverse)
        ctx.bags, ctx.pad, ctx.num_rows = bags, pad, rows.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = time.perf_counter()
        (inverse,) = ctx.saved_tensors
        bags = ctx.bags
        bag_of = bags.bag_of(inverse.numel())
        keep = inverse != ctx.pad if ctx.pad is not None else None
        weights = bags.weights
        if keep is not None and not bool(keep.all()):
            inverse, bag_of = inverse[keep], bag_of[keep]
            weights = weights[keep] if weights is not None else None
        grad = grad.contiguous()
        if bags.mode == "mean":
            counts = bags.counts(bag_of)
            grad = grad / counts.clamp(min=1).to(grad.dtype).unsqueeze(1)
        # Occurrences sorted by row (stable) and where each row's start: one embedding_bag sums each row's
        # bag gradients in input order.
        order, offsets = ops.group_by(inverse, ctx.num_rows)
        rows_grad = F.embedding_bag(bag_of[order], grad, offsets, mode="sum",
                                    per_sample_weights=weights[order] if weights is not None else None)
        bags.backward_seconds = time.perf_counter() - start
        return rows_grad, None, None, None


def pool_rows(rows: torch.Tensor, inverse: torch.Tensor, bags: Bags, pad: Optional[int]) -> torch.Tensor:
    """``embedding_bag`` (sum/mean, weights without gradient) of the round's unique ``rows`` at ``inverse``."""
    return _PoolRows.apply(rows, inverse.reshape(-1), bags, pad)


# An "auto" table re-measures the path it is not taking every this many rounds.
REMEASURE_ROUNDS = 64
# An "auto" table's time for a path: the fastest of this many rounds of it (after one uncounted round).
MEASURED_ROUNDS = 3


def choose_pooling(choice: str, per_rank: Sequence[Tuple[int, int]], round: int) -> Optional[bool]:
    """Whether a table's next lookup is pooled at the owners; None: keep the current choice.

    Args:
        choice: the table's ``owner_pooling``.
        per_rank: every rank's ``(rows, pooled)`` numbers from the last round's
            metadata: bytes (``"bytes"``), or measured microseconds per round
            (``"auto"``; 0 where that rank has not measured the path yet).
        round: the round just requested (the same on every rank).

    Every rank passes the same numbers, so every rank gets the same answer.
    ``"auto"`` first measures rows, then pooled (each path's first round is a
    warm-up, not counted; a path's time is the fastest of its last
    ``MEASURED_ROUNDS`` rounds), then takes the faster summed over the ranks, and
    every ``REMEASURE_ROUNDS`` rounds takes the other path once so that a
    change in the workload or the machine is seen.
    """
    active = [(r, p) for r, p in per_rank if r or p]
    if choice == "bytes":
        rows, pooled = sum(r for r, _ in active), sum(p for _, p in active)
        return pooled < rows if active else None
    if choice != "auto" or not active:
        return None
    if any(r == 0 for r, _ in active):
        return False
    if any(p == 0 for _, p in active):
        return True
    faster = sum(p for _, p in active) < sum(r for r, _ in active)
    return (not faster) if round % REMEASURE_ROUNDS == REMEASURE_ROUNDS - 1 else faster


def _pool(partials: torch.Tensor, info: _Table) -> torch.Tensor:
    """A pooled lookup's result: the owners' partial bags added up per bag (divided by the count for "mean")."""
    bags = info.bags
    out = partials.new_zeros(bags.num_bags, partials.shape[1]).index_add(0, info.bag_rows, partials)
    if bags.mode == "mean":
        out = out / info.bag_counts.clamp(min=1).to(out.dtype).unsqueeze(1)
    return out


def _estimates(t: Any, info: _Table, inverse: torch.Tensor, bags: Bags, me: int) -> Tuple[int, int]:
    """Wire bytes of this rank's lookup by rows and (estimated: a bag per occurrence, at most) pooled."""
    counts = info.part.counts
    multiplicity = torch.bincount(inverse, minlength=info.unique.numel())[info.part.perm]
    occurrences = torch.stack([x.sum() for x in torch.split(multiplicity, counts.tolist())]) if counts.numel() \
        else counts
    bag_counts = occurrences.clamp(max=bags.num_bags)
    weight_bytes = t.local_weight.element_size() if bags.weights is not None else 0
    return _pooled_estimates(t, counts, occurrences, bag_counts, weight_bytes, me)


def _pooled_estimates(t: Any, counts: torch.Tensor, occurrences: torch.Tensor, bag_counts: torch.Tensor,
                      weight_bytes: int, me: int) -> Tuple[int, int]:
    """``(rows path, pooled path)`` bytes this rank sends and receives for one lookup (forward + backward)."""
    row = t.embedding_dim * t.local_weight.element_size()
    others = torch.ones_like(counts, dtype=torch.bool)
    if others.numel() > me:
        others[me] = False
    u, o, b = (int(x[others].sum()) for x in (counts, occurrences, bag_counts))
    return u * (8 + 2 * row), u * 8 + o * (4 + weight_bytes) + b * (4 + 2 * row)


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
        t._set.settle()  # a lookup still pending in its old set runs there first, and its gradient is pushed
        t._set = table_set

    def finish_forward(module, args, output):
        if torch.compiler.is_compiling():
            return output  # compiled lookups run their rounds at once (sparsecomm.sharded.compiled)
        table_set.flush()
        return resolve(output)

    table_set.hook = model.register_forward_hook(finish_forward)
    return table_set


def flush(model: nn.Module) -> None:
    """Run every open round of ``model``'s sharded tables, and push any gradient a ``defer=True`` optimizer left
    pending (collective): afterwards every shard and its optimizer state hold every update."""
    from sparsecomm.sharded.embedding import sharded_modules

    done = set()
    for _, t in sharded_modules(model):
        if id(t._set) not in done:
            done.add(id(t._set))
            t._set.settle()
