"""Pipelined lookups in one call: the next batch's ids travel while the current batch trains.

``for batch in sparsecomm.pipeline(loader, model): ...`` yields the loader's
batches unchanged, one step ahead of the loop. Right after the model's
forward on batch t, it starts the id exchange of batch t+1's lookup rounds
(``sharded.prefetch``, an asynchronous all-to-all on the tables' group), so
the ids move while batch t's backward, gradient push, all-reduce and
``step()`` run. Batch t+1's forward then finds its ids at their owners and
only pulls the rows: after every update of step t, so training is the same
as the plain loop: the same rounds and sums (TorchRec's
``TrainPipelineSparseDist`` moves its input distribution the same way, from
a ``KeyedJaggedTensor``). The price: a pipelined round's gradient push
cannot ride in the next round's request (``defer=True``: that request is
already sent), so it runs in backward, one all-to-all more there.

How it knows batch t+1's lookups without running the model on it: on every
forward it records each sharded table's call and finds every tensor argument
among the batch's tensors (the same tensor, or the same view of one, any
nesting of dicts, lists and tuples). Batch t+1's lookups are then the same
calls with batch t+1's tensors in those places. A table called with
something computed inside the forward (``ids % rows``, offsets built there),
or a set of tables whose lookups took more than one round in that forward (a
result used before every table was looked up), is not prefetched; nor is
anything when some rank has no next batch or one of another structure: that
step runs as without the pipeline, and :attr:`Pipeline.reason` says why. In
the next forward each table takes its prefetched lookup when called with
exactly those tensors, unchanged (same version counter); a forward that
calls them otherwise (an evaluation between steps) runs a round of its own,
and the prefetched one waits. The prefetch is a collective, so every rank
must decide alike: matching goes by which tensor is which (the program, not
addresses or values), and the data-dependent part (a next batch, its
structure) is agreed by a one-int all-reduce started when the forward begins
and read when it ends. Ranks must run the same code, as with any lookup.

A placement trial or ``sparsecomm.replan`` that moves tables ends the
pending round unused (the moved tables are new modules); the pipeline finds
the new tables at the next forward. Replicated tables need no pipeline: the
DDP hook syncs their gradients. Leaving the loop early leaves the next
round prefetched; the tables' next round ends it (on every rank alike).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from sparsecomm.collectives.futures import keep
from sparsecomm.collectives.groups import comm_device
from sparsecomm.sharded.model import sharded_modules
from sparsecomm.sharded.pending import Prefetched
from sparsecomm.sharded.table import ShardedTable

__all__ = ["pipeline", "Pipeline"]

_END = object()


class _Call:
    """One table call of a forward: the table, its arguments' structure and, per tensor, its batch leaf."""

    __slots__ = ("table", "spec", "leaves", "places")

    def __init__(self, table: ShardedTable, args: tuple, kwargs: dict) -> None:
        self.table = table
        self.leaves, self.spec = tree_flatten((args, kwargs))
        self.places: List[Optional[int]] = []   # per argument leaf: its batch leaf (tensors), or None


def _same(a: Any, b: Any) -> bool:
    """Whether two tensors are the same object, or views of one tensor with the same layout.

    Decided by which tensor is a view of which (the program's structure), never by addresses: empty
    tensors share address 0, so an address test would answer differently on a rank whose ids are empty,
    and ranks that decide differently would not make the same collectives.
    """
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    base_a, base_b = a._base if a._base is not None else a, b._base if b._base is not None else b
    return (base_a is base_b and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset())


class _Expected:
    """A prefetched lookup and the tensors its table must be called with to take it."""

    __slots__ = ("handle", "leaves", "versions")

    def __init__(self, handle: Prefetched, leaves: List[Any]) -> None:
        self.handle, self.leaves = handle, leaves
        self.versions = [x._version if isinstance(x, torch.Tensor) else None for x in leaves]

    def matches(self, leaves: List[Any]) -> bool:
        if len(leaves) != len(self.leaves):
            return False
        for got, want, version in zip(leaves, self.leaves, self.versions):
            if isinstance(want, torch.Tensor):
                if not _same(got, want) or got._version != version:
                    return False
            elif got is not want and (type(got) is not type(want) or got != want):
                return False
        return True


class Pipeline:
    """Iterates a loader one batch ahead and prefetches the next batch's lookups (module docstring).

    Attributes:
        prefetched: forwards whose next batch had its lookups prefetched.
        used: lookups that took a prefetched round.
        reason: why the last forward's next batch was not prefetched ('' when it was).
    """

    def __init__(self, batches: Iterable[Any], model: nn.Module) -> None:
        self.batches = batches
        self.model = model
        self.prefetched = 0
        self.used = 0
        self.reason = ""
        self._current: Any = _END
        self._next: Any = _END
        self._calls: List[_Call] = []
        self._seen: Dict[int, int] = {}                       # table -> its calls so far in this forward
        self._expected: Dict[Tuple[int, int], _Expected] = {}  # (table, nth call) -> its prefetched lookup
        self._rounds: Dict[int, int] = {}                     # table set -> its rounds when the forward began
        self._table_hooks: Dict[int, Tuple[Any, Any]] = {}   # table -> (weak reference to it, its pre-hook)
        self._batch = 0          # batches yielded so far
        self._asked_for = 0      # the batch whose forward last prefetched (one prefetch per batch)
        self._agreement: Optional[Tuple[torch.Tensor, Any]] = None   # (flag, its all-reduce) of this forward
        self._model_hooks: List[Any] = []

    def _inner(self) -> nn.Module:
        return getattr(self.model, "module", self.model) if isinstance(
            self.model, nn.parallel.DistributedDataParallel) else self.model

    def __iter__(self) -> Iterator[Any]:
        inner = self._inner()
        self._model_hooks = [inner.register_forward_pre_hook(self._forward_starts),
                             inner.register_forward_hook(self._forward_ends)]
        try:
            source = iter(self.batches)
            self._next = next(source, _END)
            while self._next is not _END:
                self._current, self._next = self._next, next(source, _END)
                self._batch += 1
                yield self._current
        finally:
            for h in self._model_hooks + [h for _, h in self._table_hooks.values()]:
                h.remove()
            self._model_hooks, self._table_hooks = [], {}

    # ------------------------------------------------------------ hooks

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        tables = [t for _, t in sharded_modules(module)]
        live = {id(t): t for t in tables}
        for key in [k for k, (ref, _) in self._table_hooks.items() if live.get(k) is not ref()]:
            self._table_hooks.pop(key)[1].remove()   # a table a replan replaced (its id may be reused)
        for t in tables:
            if id(t) not in self._table_hooks:
                self._table_hooks[id(t)] = (weakref.ref(t), t.register_forward_pre_hook(self._table_called,
                                                                                         with_kwargs=True))
        self._calls, self._seen = [], {}
        self._rounds = {id(t.table_set): t.table_set.rounds for t in tables}
        self._agreement = None
        group = tables[0].table_set.group if tables else None
        if group is not None and self._asked_for != self._batch:
            # Whether every rank has a next batch of this one's structure (data, not program: loaders of
            # different lengths, under Join): agreed while the forward runs, so all prefetch or none does.
            ok = self._next is not _END and tree_flatten(self._next)[1] == tree_flatten(self._current)[1]
            flag = torch.tensor([int(ok)], device=comm_device(group, tables[0].local_weight.device))
            self._agreement = (flag, keep(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=True), group))

    def _table_called(self, table: ShardedTable, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        nth = self._seen.get(id(table), 0)
        self._seen[id(table)] = nth + 1
        call = _Call(table, args, kwargs)
        self._calls.append(call)
        expected = self._expected.get((id(table), nth))
        if expected is None or not table.table_set.holds_prefetched(expected.handle.lookup) \
                or not expected.matches(call.leaves):
            return None   # e.g. an evaluation forward on this batch: the next batch's round waits for its own
        del self._expected[(id(table), nth)]
        self.used += 1
        return (expected.handle,), {}

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        for s in {id(c.table.table_set): c.table.table_set for c in self._calls}.values():
            s.flush()   # what the tables' own forward hook does next: their round runs before the next one starts
        self.reason = self._why_not()
        if self.reason:
            return
        self._asked_for, self._expected = self._batch, {}
        leaves, spec = tree_flatten(self._next)
        by_set: Dict[int, List[Tuple[_Call, List[Any]]]] = {}
        for call in self._calls:
            mine = [leaves[p] if p is not None else x for x, p in zip(call.leaves, call.places)]
            by_set.setdefault(id(call.table.table_set), []).append((call, mine))
        for calls in by_set.values():   # in the order of each set's first lookup: the same on every rank
            handles = []
            for call, mine in calls:
                a, kw = tree_unflatten(mine, call.spec)
                handles.append((call, mine, Prefetched(call.table, call.table.lookup_plan(*a, **kw))))
            calls[0][0].table.table_set.prefetch([h.lookup for _, _, h in handles], droppable=True)
            seen: Dict[int, int] = {}
            for call, mine, h in handles:
                nth = seen.get(id(call.table), 0)
                seen[id(call.table)] = nth + 1
                self._expected[(id(call.table), nth)] = _Expected(h, mine)
        self.prefetched += 1

    def _why_not(self) -> str:
        """Why batch t+1's lookups cannot be prefetched now ('' when they can); finds each argument's batch leaf.

        Every answer is the same on every rank: the program decides it, or the ranks agreed on it.
        """
        agreed = True
        if self._agreement is not None:
            flag, work = self._agreement
            work.wait()
            agreed = bool(flag.item())
        if not self._calls:
            return "the forward looked up no sharded table"
        if self._asked_for == self._batch:
            return "this batch's next one was prefetched by an earlier forward"
        leaves, spec = tree_flatten(self._current)
        for t, before in self._rounds.items():
            sets = [c.table.table_set for c in self._calls if id(c.table.table_set) == t]
            if sets and sets[0].rounds - before != 1:
                return (f"a set of tables took {sets[0].rounds - before} rounds in one forward (a result was used "
                        f"before every table was looked up)")
        for call in self._calls:
            call.places = []
            for x in call.leaves:
                if not isinstance(x, torch.Tensor):
                    call.places.append(None)
                    continue
                place = next((i for i, b in enumerate(leaves) if b is x), None)
                if place is None:
                    place = next((i for i, b in enumerate(leaves) if _same(b, x)), None)
                if place is None:
                    return (f"a {type(call.table).__name__} was called with a tensor that is not one of the "
                            f"batch's (computed in the forward?)")
                call.places.append(place)
        if not agreed:
            return "some rank has no next batch, or one of another structure"
        if self._next is _END:   # a world of one: no agreement made
            return "no next batch"
        if tree_flatten(self._next)[1] != spec:
            return "the next batch has another structure than this one"
        return ""


def pipeline(batches: Iterable[Any], model: nn.Module) -> Pipeline:
    """Iterate ``batches`` with each next batch's lookups prefetched during the current step (module docstring).

    Args:
        batches: any iterable of batches (a ``DataLoader``); read one ahead.
        model: the model ``parallelize`` returned (or a module with sharded
            tables); its forward is called once per batch with the batch's
            tensors passed to the tables as they are.

    Returns:
        A :class:`Pipeline`: iterate it as you would ``batches``; its
        ``prefetched``, ``used`` and ``reason`` say what it did.

    Example::

        >>> model, opt = sparsecomm.parallelize(net, torch.optim.Adagrad, lr=0.05)
        >>> for batch in sparsecomm.pipeline(loader, model):
        ...     opt.zero_grad(); loss_fn(model(batch), batch["y"]).backward(); opt.step()
    """
    return Pipeline(batches, model)
