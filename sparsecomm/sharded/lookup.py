"""Lookup rounds: every pending lookup of a set of sharded tables in one exchange per direction.

Each sharded table belongs to a :class:`TableSet` (tables on one process
group). A lookup joins its set's open *round*; a round runs:

- at once, for an *eager* set (a standalone table is an eager set of one:
  its forward returns a plain tensor, as ``nn.Embedding`` does);
- when the first result is needed, for a *lazy* set
  (:func:`sparsecomm.sharded.model.group_tables`, used by
  ``sparsecomm.parallelize``): the table's forward returns a placeholder
  tensor of the right shape, dtype and device
  (:class:`~sparsecomm.sharded.pending.PendingLookup`); the first torch
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

This module runs the round; what a requester asks and makes of the rows is
in :mod:`~sparsecomm.sharded.requester`, what an owner serves and receives
in :mod:`~sparsecomm.sharded.owner`, who pools a bag lookup in
:mod:`~sparsecomm.sharded.pooling`. It uses the tables through
:class:`~sparsecomm.sharded.protocol.LookupTable` only.

The push runs once the backward's graph has run, not where autograd
reaches the round: every rank then pushes its rounds in round order, before
the DDP hook's fused sync, whatever order its own graph produced the
gradients in (:mod:`sparsecomm.collectives.step_order`); the shards'
gradients land in ``local_weight.grad`` there, before ``backward()``
returns. A rank that ran out of inputs under ``Join`` takes part in its
peers' rounds with none of its own (:meth:`TableSet.shadow_step`).

Rows on the wire in half precision (opt-in, not exact; :mod:`~sparsecomm.sharded.wire`):
a table with ``compression`` ``"bf16"`` or ``"fp16"`` sends the rows it
serves (or its partial bags) and the gradient rows it pushes in that dtype,
cast back to the table's dtype on arrival, so requesters pool and owners sum
at the table's precision. Each value travels rounded once, ``x (1 + e)``
with ``|e| <= u`` (``2^-8`` bf16; ``2^-11`` fp16 within its normal range,
``|x|`` in [6.1e-5, 65504]), so an owner's gradient is off by at most ``u``
times the summed ``|g|`` of the rows pushed for that row (one per rank, or
one per bag when pooled) beyond float32's own rounding. Ids, counts,
verdicts and hot rows stay exact; a world of one rounds nothing.

Contract (as DDP's): ranks run the same code path, so their rounds hold the
same tables in the same order (checked: a mismatch raises on every rank);
every rank runs backward through a round whose results any rank
differentiates (a lazy set's forward hook anchors its rounds to the model's
output, so a round one rank's loss does not use still pushes there). A
lookup whose result gets no gradient while others of its round do sends
zero rows (lazy optimizers then see a zero gradient for those rows).
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sparsecomm.collectives.sharded_exchange import (Routes, exchange_rows, finish_request, next_capacity, pull_rows,
                                                     start_request, world)
from sparsecomm.collectives.step_order import PUSH, at_backward_end, current_backward
from sparsecomm.sharded.hot import sync_hot_gradients
from sparsecomm.sharded.inputs import bad_input
from sparsecomm.sharded.owner import owner_gradients, serve
from sparsecomm.sharded.pending import Lookup, PendingLookup
from sparsecomm.sharded.pooling import PoolingChoice
from sparsecomm.sharded.protocol import LookupTable
from sparsecomm.sharded.requester import TableRound, gradient_rows, pooled_request, rows_request
from sparsecomm.sharded.round_state import DeferredPush, RoundState
from sparsecomm.sharded.wire import from_wire, to_wire
from sparsecomm.types import SparseSyncStats

__all__ = ["TableSet", "RoundState"]


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


class _Round(torch.autograd.Function):
    """One round: every table's unique rows from their owners; backward pushes their gradients in one exchange,
    once the backward's graph has run (:meth:`TableSet.push_after_graph`)."""

    @staticmethod
    def forward(ctx, table_set: "TableSet", state: RoundState, *weights: torch.Tensor):
        start = time.perf_counter()
        rows, routes, tables = table_set._pull(state)
        ctx.table_set, ctx.routes, ctx.tables, ctx.round = table_set, routes, tables, table_set.rounds
        ctx.awaiting = _Awaiting(table_set) if state.grad else None
        ctx.pull_seconds = time.perf_counter() - start
        ctx.set_materialize_grads(False)
        return tuple(rows)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.awaiting is not None:
            ctx.awaiting.close()
        ctx.table_set.push_after_graph(ctx.round, ctx.routes, ctx.tables, grads, ctx.pull_seconds)
        return (None, None, *[None] * len(grads))  # the shards' gradients land in the push


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

    def __init__(self, tables: Sequence[LookupTable], lazy: bool, stats: Optional[SparseSyncStats] = None) -> None:
        tables = list(tables)
        if not tables:
            raise ValueError("a TableSet needs at least one table")
        groups = {id(t.group) for t in tables}
        if len(groups) != 1:
            raise ValueError("tables of one TableSet must share their process group")
        if len({id(t) for t in tables}) != len(tables):
            raise ValueError("a table appears twice in a TableSet")
        self.tables = tables
        self._index = {id(t): i for i, t in enumerate(tables)}   # table -> its position in a round
        self.lazy = lazy
        self.group = tables[0].group
        self.stats = stats if stats is not None else SparseSyncStats(world_size=world(self.group)[1])
        self.rounds = 0
        # Ids per owner that ride padded in the round's metadata all-to-all (saves one all-to-all per
        # round): the last round's largest count + 1/8 + 8, the same on every rank; 0 before the first round.
        self.capacity = 0
        self._open: List[Lookup] = []
        # Per bag table: its next lookup's path and this rank's measured round times.
        self.pooling = PoolingChoice()
        # A round whose id exchange started early (prefetch), waiting for its lookups.
        self._prefetched: Optional[RoundState] = None
        self._droppable = False   # whether replan may end it unused (drop_prefetched)
        # Per table with hot rows: the window (round number // window) in which it last chose its hot set.
        self._hot_epoch: Dict[int, int] = {}
        # Rounds whose backward may still run (gradient enabled, graph alive): while any is, hot sets stay
        # as they are, since those rounds' gradients are addressed to positions in them.
        self._awaiting = 0
        # A backward's gradient rows not pushed yet: they ride in the next round's request (or push_deferred()).
        self._deferred: Optional[DeferredPush] = None
        # The model's forward hook that runs the open round (a lazy set made by group_tables), or None.
        self.hook: Optional[torch.utils.hooks.RemovableHandle] = None
        # With a forward hook: the tables (positions) of each round of this forward, for it to see a split.
        self._forward_rounds: List[Tuple[int, ...]] = []
        # With a forward hook: the results of this forward's rounds that record autograd, for it to anchor.
        self._forward_rows: List[torch.Tensor] = []
        # Per round since the last backward, whether it recorded autograd; the last step's, for a joined rank.
        self._step_rounds: List[bool] = []
        self._last_step: Optional[List[bool]] = None
        self._step_backward: Optional[int] = None   # the backward whose pushes end the current step

    def prefetch(self, lookups: Sequence[Lookup], droppable: bool = False) -> None:
        """Start a round's id exchange now, in the background (collective: every rank prefetches alike).

        It runs when exactly these lookups are submitted, in order (``table(handle)``): its rows are pulled
        then, after every update in between. ``droppable`` (a pipeline's): ``replan`` ends it unused instead.
        """
        self.flush()
        self.drop_prefetched(any_round=True)   # prefetched but never used: end it (every rank does the same)
        self.push_deferred()  # a prefetched request starts in the background: it carries no gradient rows
        state = RoundState.of(lookups)
        self._request(state, async_op=True)
        self._prefetched, self._droppable = state, droppable

    def drop_prefetched(self, any_round: bool = False) -> None:
        """End a droppable prefetched round unused (or any, with ``any_round``); collective, no-op when none."""
        if self._prefetched is not None and (any_round or self._droppable):
            state, droppable, self._prefetched = self._prefetched, self._droppable, None
            try:
                self._finish(state)
            except ValueError:   # every rank alike; a pipeline's lookups, if made, run and raise on their own
                if not droppable:
                    raise

    def holds_prefetched(self, lookup: Lookup) -> bool:
        """Whether ``lookup`` belongs to the round prefetched now (a dropped round's lookups do not)."""
        return self._prefetched is not None and any(x is lookup for x in self._prefetched.lookups)

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
        state = self._take_prefetched(lookups)
        state.grad = any(lk.grad_enabled for lk in lookups)
        with torch.set_grad_enabled(state.grad):
            rows = _Round.apply(self, state, *[t.local_weight for t in self.tables])
        self._step_rounds.append(state.grad)
        if self.hook is not None:
            self._forward_rows.extend(r for r in rows if r.requires_grad)
            self._forward_rounds.append(tuple(sorted({self._index[id(lk.table)] for lk in lookups})))
        seen: Dict[int, int] = {}
        for lk in lookups:
            i = self._index[id(lk.table)]
            nth = seen.get(i, 0)
            seen[i] = nth + 1
            info = state.tables[i]
            start = time.perf_counter()
            with torch.set_grad_enabled(lk.grad_enabled):
                lk.result = info.result(rows[i], lk, nth)
            info.finish_seconds += time.perf_counter() - start

    def take_forward_rows(self) -> List[torch.Tensor]:
        """The results of the rounds since the last call that record autograd (the forward hook of
        ``group_tables`` anchors them to the model's output, so every rank's backward runs them)."""
        rows, self._forward_rows = self._forward_rows, []
        return rows

    def take_forward_rounds(self) -> List[Tuple[int, ...]]:
        """The tables (positions in ``tables``) of each round run since the last call: more than one round in a
        forward means a result was used before every table was looked up (``group_tables`` warns)."""
        rounds, self._forward_rounds = self._forward_rounds, []
        return rounds

    def _take_prefetched(self, lookups: List[Lookup]) -> RoundState:
        """The round for ``lookups``: the prefetched one when it was started for exactly them, else a new one."""
        state, self._prefetched = self._prefetched, None
        if state is not None and [id(x) for x in state.lookups] != [id(x) for x in lookups]:
            if not self._droppable:   # prefetched by hand, then not used as prefetched: end it, unused
                self._finish(state)
            self._prefetched, state = (state if self._droppable else None), None   # a pipeline's waits for its own
        if state is not None and self._hot_due():
            # Prefetched while an earlier round awaited its backward (no hot set could change then): choose now,
            # and if a set changed, end the prefetched request (it split the ids by the old set) and ask again.
            if self._choose_hot_rows():
                self._finish(state)
                state = None
        return state if state is not None else RoundState.of(lookups)

    # ------------------------------------------------------------ the round

    def _record(self, tables: List[TableRound], seconds: float) -> None:
        """Add a finished lookup's time to the path each "auto" table took: the round (pull + push) and
        the requester's own work on the rows (pooling them and its backward, or adding the partial bags)."""
        for t, info in zip(self.tables, tables):
            if info.timed:
                self.pooling.record(t, info.pooled, seconds + info.own_seconds())

    def _request(self, state: RoundState, async_op: bool = False) -> None:
        """Build the round's requests and start its id exchange (in the background with ``async_op``)."""
        ok = state.status.ok
        of_table: List[List[Lookup]] = [[] for _ in self.tables]
        for lk in state.lookups:
            of_table[self._index[id(lk.table)]].append(lk)
        tables = [TableRound() for _ in self.tables]
        me, n = world(self.group)
        self._choose_hot_rows()
        requests = []
        for t, info, lks in zip(self.tables, tables, of_table):
            pooled = self.pooling.pooled_lookup(t, lks, ok)
            requests.append(pooled_request(t, info, pooled, me, n, self.pooling) if pooled is not None else
                            rows_request(t, info, lks, ok, me, self.pooling))
        state.tables = tables
        carry = None
        if self._deferred is not None and not async_op:  # the last backward's gradient rows travel along
            state.deferred, self._deferred = self._deferred, None
            carry = state.deferred.carry()
        state.pending = start_request(requests, state.status, round=self.rounds, group=self.group, stats=self.stats,
                                      capacity=self.capacity, async_op=async_op, carry=carry)

    def _hot_due(self) -> List[LookupTable]:
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

    def _finish(self, state: RoundState) -> Routes:
        """Wait for a started round's id exchange and check it; the round counts once it passed.

        Gradient rows that rode along (a deferred push) are applied first,
        whatever the checks find: they belong to an earlier, validated round.
        """
        pending, deferred = state.pending, state.deferred
        state.pending = state.deferred = None
        try:
            routes = finish_request(pending)
        finally:
            if deferred is not None and pending.carried is not None:
                self._land(deferred, pending.carried)
        self.rounds += 1
        return routes

    def _pull(self, state: RoundState) -> Tuple[List[torch.Tensor], Routes, List[TableRound]]:
        if state.pending is None:  # else prefetched: the id exchange already started
            self._request(state)
        tables = state.tables
        routes = self._finish(state)
        self.capacity = next_capacity(routes.largest)
        self.pooling.update(self.tables, routes.estimates, self.rounds)
        served = [serve(t, info, routes, i) for i, (t, info) in enumerate(zip(self.tables, tables))]
        got = from_wire(self.tables, pull_rows(to_wire(self.tables, served), routes, self.group, self.stats))
        rows = [g if info.hot_positions is None else torch.cat([g, t.hot.weight.index_select(0, info.hot_positions)])
                for t, g, info in zip(self.tables, got, tables)]
        return rows, routes, tables

    def _push(self, routes: Routes, tables: List[TableRound], grads: Sequence[Optional[torch.Tensor]]
              ) -> List[Optional[torch.Tensor]]:
        # Which tables get a gradient is the same on every rank: looked up by some rank, and trainable.
        pushing = [p and t.local_weight.requires_grad for p, t in zip(routes.present, self.tables)]
        n = len(routes.send[0])
        send = [s if p else [0] * n for s, p in zip(routes.rows_send, pushing)]
        recv = [r if p else [0] * n for r, p in zip(routes.rows_recv, pushing)]
        rows = gradient_rows(self.tables, tables, grads, pushing, send)
        cold = to_wire(self.tables, rows.cold)
        routes = routes._replace(rows_send=send, rows_recv=recv, problem=None)
        if self._defers(pushing):
            self.push_deferred()  # an earlier round's pending gradient is applied first (updates keep their order)
            self._deferred = DeferredPush(tables, pushing, routes, cold, [t.optimizer for t in self.tables])
            for t in (t for t, p in zip(self.tables, pushing) if p):
                t.optimizer.hold(t.local_weight)
            return [None] * len(self.tables)
        got = from_wire(self.tables, exchange_rows(cold, routes, self.group, self.stats))
        hot_sums = sync_hot_gradients(rows.hot, self.group, n, [t.grad_reduction == "mean" for t in rows.hot_tables],
                                      [t.stats for t in rows.hot_tables])
        out = owner_gradients(self.tables, tables, pushing, got)
        for t, (positions, summed) in zip(rows.hot_tables, hot_sums):
            t.hot_gradient(positions, summed)
        return out

    def _defers(self, pushing: Sequence[bool]) -> bool:
        """Whether this backward's push waits for the next request: every table that gets a gradient has an
        optimizer with ``defer=True`` and no hot rows, and no request was started early (prefetch).

        Ranks attach the same optimizers and prefetch alike, so all decide the same.
        """
        if self._prefetched is not None or not any(pushing):
            return False
        for t, p in zip(self.tables, pushing):
            if not p:
                continue
            if t.optimizer is None or not getattr(t.optimizer, "defer", False) or t.hot is not None:
                return False
        return True

    def push_deferred(self) -> None:
        """Push and land a backward's gradient that waits for the next round (collective; no-op when none is
        pending, which every rank agrees on).

        With ``defer=True`` optimizers a round's backward gradient travels in the next round's request and
        lands before that round serves any row; this pushes it now instead: ``sparsecomm.sharded.flush``,
        ``save``/``load`` and :meth:`prefetch` call it.
        """
        d, self._deferred = self._deferred, None
        if d is not None:
            self._land(d, exchange_rows(d.rows, d.routes, self.group, self.stats))

    def _land(self, d: DeferredPush, got: List[torch.Tensor]) -> None:
        """A deferred gradient arrived (``got``: per table, by source rank): fused optimizers apply it, the
        others take it and replay the ``step()``/``zero_grad()`` calls they held meanwhile."""
        grads = owner_gradients(self.tables, d.tables, d.pushing, from_wire(self.tables, got))
        for t, g, p, opt in zip(self.tables, grads, d.pushing, d.optimizers):
            if p:
                opt.land(t.local_weight, g)

    def push_after_graph(self, round_no: int, routes: Routes, tables: List[TableRound],
                         grads: Sequence[Optional[torch.Tensor]], pull_seconds: float) -> None:
        """Push a round's gradient once this backward's graph has run, after the rounds before it (collective).

        Every rank pushes at the same point of its backward, in round order,
        whatever order its graph reached the rounds in
        (:mod:`sparsecomm.collectives.step_order`). The shards' gradients land
        there: in ``local_weight.grad``, or applied by a fused optimizer.
        """

        def push() -> None:
            start = time.perf_counter()
            with torch.no_grad():
                _accumulate(self.tables, self._push(routes, tables, grads))
            self._record(tables, pull_seconds + time.perf_counter() - start)

        # This set's place among every set's pushes: its first table's fingerprint, which every rank agrees on.
        order = tuple(self.tables[0].fingerprint())
        at_backward_end(PUSH, (order, round_no), push)
        backward = current_backward()
        if backward != self._step_backward:  # once per backward: the rounds since the last one made a step
            self._step_backward = backward
            at_backward_end(PUSH, (order, math.inf), self._end_step)

    def _end_step(self) -> None:
        self._last_step, self._step_rounds = self._step_rounds, []

    def shadow_step(self) -> None:
        """Take part in one step of this set's rounds with no lookup of this rank's own (collective).

        What a rank that ran out of inputs does while its peers still train
        (``torch.distributed.algorithms.join.Join``, through the DDP hook): the
        rounds of the last step it ran, in order, each asking for no row and
        serving this rank's rows; then the pushes of those with gradients,
        which land the peers' gradients in this rank's shards, and the
        ``step()`` of unfused owner-side optimizers, as the peers step theirs.

        Raises:
            ValueError: on every rank (the peers in their round) when this
                rank cannot: it ran no step yet, or a prefetched round is pending.
        """
        problem = ("it has run no step yet" if self._last_step is None else
                   "it has a prefetched round pending" if self._prefetched is not None else None)
        if problem is not None:
            self._pull(RoundState([], bad_input(f"sparsecomm sharded lookup: rank {world(self.group)[0]} ran out "
                                                f"of inputs (Join) but cannot shadow its peers' lookups: {problem}")))
        optimizers = list({id(t.optimizer): t.optimizer for t in self.tables
                           if t.optimizer is not None and not getattr(t.optimizer, "fused", False)}.values())
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        pushes = []
        for grad in self._last_step:
            awaiting = _Awaiting(self) if grad else None  # as the peers' rounds await their backward
            _, routes, tables = self._pull(RoundState([], grad=grad))
            self._step_rounds.append(grad)
            if awaiting is not None:
                pushes.append((awaiting, routes, tables))
        with torch.no_grad():
            for awaiting, routes, tables in pushes:
                awaiting.close()
                _accumulate(self.tables, self._push(routes, tables, [None] * len(self.tables)))
        self._end_step()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def busy(self) -> Optional[str]:
        """Why this set's tables cannot be replaced now (``sparsecomm.replan``), or None: a prefetched round, open
        lookups, or a round whose backward has not run."""
        if self._prefetched is not None and not self._droppable:
            return "a prefetched round is pending (look its handles up first)"
        if self._open:
            return "lookups are open (their round has not run)"
        if self._awaiting:
            return "a round awaits its backward (run backward and step first)"
        return None

    def settle(self) -> None:
        """Run the open round and push a pending deferred gradient (collective): the shards hold every update."""
        self.flush()
        self.push_deferred()


def _accumulate(tables: Sequence[LookupTable], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Add each shard's gradient to its ``local_weight.grad``, as autograd would (the push runs after the graph)."""
    for t, g in zip(tables, grads):
        if g is not None:
            w = t.local_weight
            w.grad = g if w.grad is None else w.grad + g
