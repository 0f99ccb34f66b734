"""Stale replicas: a whole copy of each sharded table kept on every rank, so that moves send only changed rows.

Moving a replicated table to a sharded placement communicates nothing (each
rank keeps its rows); the way back, or to another scheme, moves the whole
table with its optimizer state: at 1 Gbit/s, seconds for a table of a few
hundred MB. A placement trial (:mod:`sparsecomm.trial`) makes such moves a few
steps apart, between placements that touch a small part of the table.
:class:`StaleReplicas` keeps, when a table leaves its replica, that replica's
weight and row state (the replica's own tensors: no copy). It is the same on
every rank. When the table moves again, only rows that changed since
travel, and only where the new placement needs them: every rank learns the
ids of the changed rows (one all-gather for all the tables of a move), and
each row goes from its owner to every rank that holds it at the new
placement (every rank, for a replica) and whose copy has it stale, in one
exchange. A rank's copy is then current on the rows it holds at the new
placement, from which that placement is cut
locally, with nothing copied: a table-wise owner's shard is the copy's
memory itself, and a hash shard spreads over it (its slots are its ids, and
the rows other ranks own stay the copy's; :mod:`sparsecomm.sharded.layout`).
The rows left stale in some copies are remembered (which ids, whose copies)
and travel at the move that needs them: across hosts a move to table-wise
sends each changed row to one rank, not to all. (At two ranks a move sends
every row the other copy lacks: it rides in the direction the move leaves
idle.)
Moving out of a replica therefore writes nothing and allocates nothing.
Which rows changed: the shard's row log (:mod:`sparsecomm.sharded.row_log`)
of the rows the owner-side optimizer wrote, while the versions of the
shard's tensors show that nothing else wrote them; after any other write
(a checkpoint load, a user's edit) each owner compares its rows with the
copy, bit for bit (NaNs and signed zeros included), and a shard that is its
copy's memory sends every row. The result is the same bits as a move of
the whole table.

Trust: the copies start from replicas that DDP keeps equal, and each rank
knows which rows of every copy are stale from the same gathered ids, so
every rank computes the same routes (the counts of those records travel in
the refresh's all-gather, and ranks that disagree raise on every rank).
:func:`sparsecomm.replan` uses a table's copy only when every
rank holds one of the same shape (agreed in its one all-gather of objects),
and moves the whole table otherwise.

Cost: the replicated placement's memory for every table kept (a trial starts
replicated, so it adds nothing to the trial's peak), a bool per row of the
log, and one bit comparison of each owner's rows only after writes the log
was not told of. Writes that bypass torch's version counter (``.data``,
``.numpy()``) are not seen: call :meth:`StaleReplicas.drop` after them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sparsecomm import ops, ownership
from sparsecomm.collectives.objects import all_gather_objects, world
from sparsecomm.collectives.sharded_exchange import allgather_ids, exchange_blocks
from sparsecomm.sharded.row_log import RowLog

__all__ = ["StaleReplicas", "StaleTable", "Refresh", "same_memory"]

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK_ROWS = 1 << 16   # rows compared at a time: bounds the gathered copy of the stale rows
_EXCHANGE_BYTES = 64 << 20   # changed rows of the tables of one refresh exchange, all ranks' together


@dataclasses.dataclass
class StaleTable:
    """One table's copy: its weight and its row state (per name), whole tables of the same rows."""

    weight: torch.Tensor
    state: Dict[str, torch.Tensor]

    def shape(self) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
        return tuple(self.weight.shape), tuple(sorted(self.state))


def _words(t: torch.Tensor) -> torch.Tensor:
    """A matrix of rows as the widest integers that tile a row: equal exactly when the bits are."""
    t = t.contiguous()
    row_bytes = t.shape[1] * t.element_size()
    width = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)
    return t.view(torch.uint8).view(_BITS[width]) if t.numel() else t.view(_BITS[t.element_size()])


def changed_rows(ids: torch.Tensor, current: Sequence[torch.Tensor], stale: Sequence[torch.Tensor]) -> torch.Tensor:
    """Positions ``i`` where row ``i`` of some ``current`` matrix differs in any bit from row ``ids[i]`` of its
    ``stale`` one (``ids`` ascending). A chunk whose bits are all equal costs one comparison."""
    out: List[torch.Tensor] = []
    buffers: Dict[int, torch.Tensor] = {}
    for lo in range(0, ids.numel(), _CHUNK_ROWS):
        part = ids[lo:lo + _CHUNK_ROWS]
        differ: Optional[torch.Tensor] = None
        for i, (cur, old) in enumerate(zip(current, stale)):
            if i not in buffers:
                buffers[i] = torch.empty((min(_CHUNK_ROWS, ids.numel()), old.shape[1]), dtype=old.dtype,
                                         device=old.device)
            rows = _words(ops.take_rows(old, part, out=buffers[i][:part.numel()]))
            mine = _words(cur[lo:lo + part.numel()].to(old.device))
            if torch.equal(mine, rows):
                continue
            rows_differ = (mine != rows).any(1).to(ids.device)
            differ = rows_differ if differ is None else differ | rows_differ
        if differ is not None:
            out.append(differ.nonzero().view(-1) + lo)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=ids.device)


class Refresh(NamedTuple):
    """A table about to move (:meth:`StaleReplicas.current_tables`): its name, the sharded table, the scheme it
    moves to (None: to a replica) and that scheme's owner (table-wise)."""

    name: str
    table: Any
    to_scheme: Optional[str] = None
    to_owner: Optional[int] = None

    def needs(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """``(len(ids), n)`` bool: which ranks hold each of ``ids`` at the new placement (a replica: all)."""
        if self.to_scheme is None:
            return torch.ones((ids.numel(), n), dtype=torch.bool, device=ids.device)
        rows = self.table.num_embeddings
        owners = ops.row_owners(ids, n, self.to_scheme, rows, range_size=ownership.range_size(rows, n),
                                owner=self.to_owner)
        return owners.unsqueeze(1) == torch.arange(n, device=ids.device)


class _Pending(NamedTuple):
    """The rows some rank's copy of a table holds stale: their ids (ascending) and, per id, whose copy."""

    ids: torch.Tensor     # (k,) int64
    stale: torch.Tensor   # (k, n) bool

    def digest(self) -> Tuple[int, int]:
        """What every rank must hold alike: the ids and the stale copies, counted."""
        return int(self.ids.numel()), int(self.stale.sum())


class _Route(NamedTuple):
    """One table's rows of a refresh: the ids this rank sends each rank, the ids it receives from each (both in
    rank order, ascending), and the rows all ranks send together."""

    refresh: Refresh
    changes: "_Changes"
    send: List[torch.Tensor]
    recv: List[torch.Tensor]
    total: int


class _Changes(NamedTuple):
    """One rank's shard of a moving table against its copy: the copy, the shard's rows (weight, then each row
    state), the copy's rows alike, the shard's ids, and the slots that changed (None: no usable copy)."""

    copy: Optional[StaleTable]
    current: List[torch.Tensor]
    stale: List[torch.Tensor]
    owned: torch.Tensor
    which: Optional[torch.Tensor]


def _busiest(counts: Sequence[int]) -> int:
    """Rows the busiest rank sends or receives when every rank sends its ``counts`` rows to every other."""
    n, total = len(counts), sum(counts)
    return max(max(c * (n - 1), total - c) for c in counts)


def _whole_move(r: Refresh) -> float:
    """Rows the busiest rank moves when the whole table moves instead (to a replica: no bound, the copy wins)."""
    table = r.table
    if r.to_scheme is None:
        return float("inf")
    n = table.layout.world_size
    return max(table.num_embeddings if scheme == "table" else -(-table.num_embeddings // n)
               for scheme in (table.scheme, r.to_scheme))


def _batches(routes: List[_Route]) -> List[List[_Route]]:
    """The tables in order, in batches whose rows from every rank together stay under :data:`_EXCHANGE_BYTES`
    (a table over it alone): the bound on one exchange's buffers. From what every rank knows alike (the routes'
    totals), so every rank makes the same batches."""
    out: List[List[_Route]] = []
    size = 0
    for route in routes:
        nbytes = route.total * sum(x.shape[1] * x.element_size() for x in route.changes.current)
        if not out or size + nbytes > _EXCHANGE_BYTES:
            out.append([])
            size = 0
        out[-1].append(route)
        size += nbytes
    return out


def _sources(ids: torch.Tensor, current: torch.Tensor, n: int) -> torch.Tensor:
    """``(len(ids), n)``: for each row and each rank that may need it, the rank that sends it: one of the ranks whose
    copy holds it current (``current``, at least its owner), taken in turn by row and destination so that a row
    held current in several copies is not sent by one rank to all. The same on every rank."""
    count = current.sum(1).clamp(min=1)
    among = current.cumsum(1) - 1   # each holder's place among the row's holders
    out = torch.empty((ids.numel(), n), dtype=torch.int64, device=ids.device)
    for q in range(n):
        pick = (ids + q) % count
        out[:, q] = (current & (among == pick.unsqueeze(1))).to(torch.int8).argmax(1)
    return out


class StaleReplicas:
    """The stale copies of a model's sharded tables, by table name (module docstring); one per rank, used alike.

    Attributes:
        rows_sent: rows this rank has sent to refresh copies (all moves together; a row sent to two ranks counts
            twice).
        rows_total: rows a whole-table move would have sent from this rank instead.
        rows_compared: rows compared bit by bit with the copy (where a shard's row log could not answer).
    """

    def __init__(self) -> None:
        self._tables: Dict[str, StaleTable] = {}
        self._logs: Dict[str, RowLog] = {}   # the row log of each copy's current shard (set by watch)
        self._pending: Dict[str, _Pending] = {}   # rows some rank's copy holds stale (none: every copy current)
        self.rows_sent = 0
        self.rows_total = 0
        self.rows_compared = 0

    def __contains__(self, name: str) -> bool:
        return name in self._tables

    def get(self, name: str) -> Optional[StaleTable]:
        """``name``'s copy, or None."""
        return self._tables.get(name)

    def names(self) -> Dict[str, tuple]:
        """Every copy's table name with its shape (what ranks agree on before using them)."""
        return {name: t.shape() for name, t in self._tables.items()}

    @property
    def nbytes(self) -> int:
        """The memory the copies hold."""
        return sum(t.weight.nbytes + sum(s.nbytes for s in t.state.values()) for t in self._tables.values())

    def keep(self, name: str, weight: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        """Keep ``weight`` and ``state`` (whole tables, equal on every rank, no longer updated) as ``name``'s copy."""
        self._tables[name] = StaleTable(weight.detach().contiguous(),
                                        {n: s.detach().contiguous() for n, s in state.items()})
        self._logs.pop(name, None)
        self._pending.pop(name, None)

    def drop(self, name: Optional[str] = None) -> None:
        """Forget ``name``'s copy (every copy: None)."""
        if name is None:
            self._tables.clear()
            self._logs.clear()
            self._pending.clear()
        else:
            self._tables.pop(name, None)
            self._logs.pop(name, None)
            self._pending.pop(name, None)

    def current_tables(self, tables: Sequence["Refresh"], optimizer: Any) -> List[Optional[StaleTable]]:
        """The whole current tables (weight and row state): each one's copy, patched with the rows that changed.

        Collective over the tables' group: every rank calls it for the same
        tables in the same order, those every rank holds a copy of (``replan``
        agrees on the copies first and drops the others). One all-gather of
        every rank's count of changed rows of every table, one of their ids,
        then one exchange of the rows for all tables (one per 64 MiB of rows).
        Each rank's copy is current after it on the rows it holds at the new
        placement (a replica: every row).

        Args:
            tables: what moves, each with the scheme it moves to (None: to a
                replica, where the copy is always worth it: the whole move is an
                all-gather too). Under another scheme, the whole move costs
                the busiest rank the rows of the busiest owner, old or new
                (a table-wise owner's: all of them).
            optimizer: the sharded tables' optimizer (its state of their rows).

        Returns:
            Per table, its copy, or None on every rank (the copy dropped, the caller moves
            the whole table) when some rank's copy does not fit its rows or
            sending the changed rows to every rank would cost the busiest rank
            more rows than the whole move.
        """
        out: List[Optional[StaleTable]] = [None] * len(tables)
        for group in {id(r.table.group): r.table.group for r in tables}.values():   # one group in practice
            at = [i for i, r in enumerate(tables) if r.table.group is group]
            for i, copy in zip(at, self._refresh([tables[i] for i in at], optimizer, group)):
                out[i] = copy
        return out

    def _refresh(self, tables: Sequence["Refresh"], optimizer: Any, group: Any) -> List[Optional[StaleTable]]:
        """:meth:`current_tables` for tables of one group."""
        me, n = world(group)
        changes = [self._changes(r, optimizer) for r in tables]
        digests = [self._pending_of(r.name, n, c.owned.device).digest() for r, c in zip(tables, changes)]
        everyone = all_gather_objects([(-1 if c.which is None else c.which.numel(), d)
                                       for c, d in zip(changes, digests)], group)
        if any(len(theirs) != len(tables) for theirs in everyone):
            raise ValueError(f"sparsecomm stale replicas: the ranks refresh different numbers of tables "
                             f"({[len(theirs) for theirs in everyone]}): a bug or a version mismatch between ranks")
        sending: List[Tuple[Refresh, _Changes, List[int]]] = []
        for k, (r, c) in enumerate(zip(tables, changes)):
            counts = [int(theirs[k][0]) for theirs in everyone]
            if max(counts) > r.table.num_embeddings:
                raise ValueError(f"sparsecomm stale replicas: a rank announced {max(counts)} changed rows of table "
                                 f"{r.name!r}, which has {r.table.num_embeddings}: a bug or a version mismatch "
                                 f"between ranks")
            if min(counts) < 0 or _busiest(counts) > _whole_move(r):
                self.drop(r.name)
                continue
            if len({tuple(theirs[k][1]) for theirs in everyone}) > 1:
                raise ValueError(f"sparsecomm stale replicas: the ranks disagree on which copies of table {r.name!r} "
                                 f"are stale ({[tuple(theirs[k][1]) for theirs in everyone]}): a bug or a version "
                                 f"mismatch between ranks")
            self.rows_total += c.owned.numel()
            sending.append((r, c, counts))
        if sending:
            changed = allgather_ids([c.which if r.table.layout.spread else c.owned[c.which] for r, c, _ in sending],
                                    [counts for _, _, counts in sending],
                                    [r.table.num_embeddings for r, _, _ in sending], group)
            routes = [self._route(r, c, counts, ids, me, n) for (r, c, counts), ids in zip(sending, changed)]
            for batch in _batches(routes):   # one exchange unless the rows of all of them would make a large buffer
                if any(route.total for route in batch):   # the same on every rank
                    self._exchange(batch, group)
        kept = {r.name for r, _, _ in sending}
        return [c.copy if r.name in kept else None for r, c in zip(tables, changes)]

    def _pending_of(self, name: str, n: int, device: torch.device) -> _Pending:
        pending = self._pending.get(name)
        if pending is None or pending.stale.shape[1] != n:
            pending = _Pending(torch.zeros(0, dtype=torch.int64, device=device),
                               torch.zeros((0, n), dtype=torch.bool, device=device))
        return pending

    def _route(self, r: Refresh, c: "_Changes", counts: List[int], changed: torch.Tensor, me: int, n: int) -> _Route:
        """Where table ``r``'s rows go (no communication; the same sets on every rank).

        ``changed``: every rank's changed ids, in rank order. This rank's own
        copy takes its own changed rows first (where its shard is not the
        copy's memory). A row goes to every rank that holds it at the new
        placement and whose copy has it stale, from a copy that holds it
        current (its owner's at the placement the table leaves, or one that
        received it at an earlier move: :func:`_sources` spreads the sending
        over them); the rest stays pending for a later move.
        """
        table = r.table
        start = sum(counts[:me])
        if counts[me] and not same_memory(c.current[0], c.stale[0]):
            mine = changed[start:start + counts[me]]
            for cur, old in zip(c.current, c.stale):
                old[mine.to(old.device)] = cur[c.which.to(cur.device)].to(old)
        old = self._pending_of(r.name, n, changed.device)
        ids, inverse = torch.unique(torch.cat([old.ids, changed]), return_inverse=True)
        stale = torch.zeros((ids.numel(), n), dtype=torch.bool, device=ids.device)
        stale[inverse[:old.ids.numel()]] = old.stale
        fresh = inverse[old.ids.numel():]
        if fresh.unique().numel() != fresh.numel():
            raise ValueError("sparsecomm stale replicas: two ranks changed the same row: the shards overlap (a bug "
                             "or a version mismatch between ranks)")
        stale[fresh] = True   # changed: stale everywhere but at the rank that changed it
        stale[fresh, torch.repeat_interleave(torch.arange(n, device=ids.device),
                                             torch.tensor(counts, device=ids.device))] = False
        owners = table.layout.owners(ids).to(ids.device)
        stale[torch.arange(ids.numel(), device=ids.device), owners] = False   # an owner's copy holds its rows
        # Two ranks: the rows the other rank lacks ride in the direction a move leaves idle (links are full
        # duplex), so every stale row goes; from three on, only where the new placement needs it.
        send = stale & r.needs(ids, n) if n > 2 else stale.clone()
        source = _sources(ids, ~stale, n)
        stale &= ~send
        keep = stale.any(1)
        self._pending[r.name] = _Pending(ids[keep], stale[keep])
        route = _Route(r, c, [ids[send[:, q] & (source[:, q] == me)] for q in range(n)],
                       [ids[send[:, me] & (source[:, me] == s)] for s in range(n)], int(send.sum()))
        self.rows_sent += sum(x.numel() for x in route.send)
        return route

    @staticmethod
    def _exchange(routes: Sequence[_Route], group: Any) -> None:
        """Send the routes' rows in one exchange (from the sender's copy, current at those rows) and patch the
        copies with them."""
        blocks = []
        for route in routes:
            ids = torch.cat(route.send)
            blocks.append(torch.cat([x[ids.to(x.device)] for x in route.changes.stale], 1))
        got = exchange_blocks(blocks, [[x.numel() for x in route.send] for route in routes],
                              [[x.numel() for x in route.recv] for route in routes], group, None)
        for route, rows in zip(routes, got):
            ids, at = torch.cat(route.recv), 0
            for target in route.changes.stale:
                width = target.shape[1]
                target[ids.to(target.device)] = rows[:, at:at + width].to(target)
                at += width

    def _changes(self, r: "Refresh", optimizer: Any) -> "_Changes":
        """What this rank's shard of ``r.table`` holds against its copy (no communication)."""
        table = r.table
        copy = self._tables.get(r.name)
        mine = _row_state(table, optimizer)
        current = [_rows(table.local_weight.detach())] + [_rows(mine[n]) for n in mine]
        owned = table.layout.owned_ids()
        if copy is None or not self.fits(r.name, table.local_weight, mine):
            return _Changes(copy, current, [], owned, None)
        stale = [_rows(copy.weight)] + [_rows(copy.state[n]) for n in mine]   # views: patched in place
        which = self._changed(r.name, table, owned, current, stale, [table.local_weight, *mine.values()])
        return _Changes(copy, current, stale, owned, which)

    def _changed(self, name: str, table: Any, owned: torch.Tensor, current: Sequence[torch.Tensor],
                 stale: Sequence[torch.Tensor], watched: Sequence[torch.Tensor]) -> torch.Tensor:
        """Slots of this rank's rows that differ from the copy: the log's when it saw every write since the
        copy was current, every owned slot of a shard that is the copy's memory when it did not (comparing
        would find nothing), else those whose bits differ."""
        log = self._logs.get(name)
        if log is not None and table.row_log is log and log.complete(watched):
            return log.slots().to(owned.device)
        if same_memory(current[0], stale[0]):
            return owned if table.layout.spread else torch.arange(owned.numel(), device=owned.device)
        self.rows_compared += owned.numel()
        return changed_rows(owned, current, stale)

    def watch(self, name: str, table: Any, optimizer: Any) -> None:
        """Log the rows the library writes into ``table`` (``name``'s shard, just cut from its current copy) from
        now on, so that its next move sends them without comparing (:mod:`sparsecomm.sharded.row_log`)."""
        copy = self._tables.get(name)
        if copy is None or not hasattr(table, "row_log"):   # no copy, or a replica (its copy is dropped)
            return
        table.row_log = RowLog([table.local_weight, *_row_state(table, optimizer).values()])
        self._logs[name] = table.row_log

    def fits(self, name: str, weight: torch.Tensor, state: Dict[str, torch.Tensor]) -> bool:
        """Whether ``name`` has a copy whose rows are shaped like the table's ``weight`` and ``state`` rows."""
        copy = self._tables.get(name)
        if copy is None or set(copy.state) != set(state) or weight.shape[1:] != copy.weight.shape[1:] or \
                weight.dtype != copy.weight.dtype:
            return False
        return all(state[n].shape[1:] == s.shape[1:] and state[n].dtype == s.dtype for n, s in copy.state.items())


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether non-empty ``a`` lives in ``b``'s memory (a shard that is its stale copy)."""
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _row_state(table: Any, optimizer: Any) -> Dict[str, torch.Tensor]:
    """The row state ``optimizer`` keeps for ``table``'s shard, by name in sorted order (the order moves use)."""
    state = optimizer.state.get(table.local_weight, {})
    return {n: state[n] for n in sorted(optimizer.row_state_names) if n in state}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its rows (a row state of one value per row is a column)."""
    width = 1
    for size in t.shape[1:]:
        width *= size
    return t.view(t.shape[0], width)
