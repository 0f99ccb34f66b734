"""Stale replicas: a whole copy of each sharded table kept on every rank, so that moves send only changed rows.

Moving a replicated table to a sharded placement communicates nothing (each
rank keeps its rows); the way back, or to another scheme, moves the whole
table with its optimizer state: at 1 Gbit/s, seconds for a table of a few
hundred MB. A placement trial (:mod:`sparsecomm.trial`) makes such moves a few
steps apart, between placements that touch a small part of the table.
:class:`StaleReplicas` keeps, when a table leaves its replica, that replica's
weight and row state (the replica's own tensors: no copy). It is the same on
every rank. When the table moves again, only the rows that changed since
travel, in one all-gather (one for all the tables of a move). Every rank
then patches its copy and holds the
whole current table, weight and state, from which the next placement is cut
locally, with nothing copied: a table-wise owner's shard is the copy's
memory itself, and a hash shard spreads over it (its slots are its ids, and
the rows other ranks own stay the copy's; :mod:`sparsecomm.sharded.layout`).
Moving out of a replica therefore writes nothing and allocates nothing.
Which rows changed: the shard's row log (:mod:`sparsecomm.sharded.row_log`)
of the rows the owner-side optimizer wrote, while the versions of the
shard's tensors show that nothing else wrote them; after any other write
(a checkpoint load, a user's edit) each owner compares its rows with the
copy, bit for bit (NaNs and signed zeros included), and a shard that is its
copy's memory sends every row. The result is the same bits as a move of
the whole table.

Trust: the copies stay equal on every rank because they start from
replicas that DDP keeps equal and change only by the same all-gather
everywhere. :func:`sparsecomm.replan` uses a table's copy only when every
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

from sparsecomm import ops
from sparsecomm.collectives.objects import all_gather_objects
from sparsecomm.collectives.sharded_exchange import Shard, allgather_shards
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
    moves to (None: to a replica)."""

    name: str
    table: Any
    to_scheme: Optional[str] = None


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


def _batches(sending: List[Tuple[Refresh, _Changes, List[int]]]) -> List[List[Tuple[Refresh, _Changes, List[int]]]]:
    """The tables in order, in batches whose rows from every rank together stay under :data:`_EXCHANGE_BYTES`
    (a table over it alone): the bound on one exchange's buffers. From the gathered counts: the same on every rank."""
    out: List[List[Tuple[Refresh, _Changes, List[int]]]] = []
    size = 0
    for item in sending:
        _, c, counts = item
        nbytes = sum(counts) * (8 + sum(x.shape[1] * x.element_size() for x in c.current))
        if not out or size + nbytes > _EXCHANGE_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


class StaleReplicas:
    """The stale copies of a model's sharded tables, by table name (module docstring); one per rank, used alike.

    Attributes:
        rows_sent: rows this rank has sent to refresh copies (all moves together).
        rows_total: rows a whole-table move would have sent from this rank instead.
        rows_compared: rows compared bit by bit with the copy (where a shard's row log could not answer).
    """

    def __init__(self) -> None:
        self._tables: Dict[str, StaleTable] = {}
        self._logs: Dict[str, RowLog] = {}   # the row log of each copy's current shard (set by watch)
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

    def drop(self, name: Optional[str] = None) -> None:
        """Forget ``name``'s copy (every copy: None)."""
        if name is None:
            self._tables.clear()
            self._logs.clear()
        else:
            self._tables.pop(name, None)
            self._logs.pop(name, None)

    def current_tables(self, tables: Sequence["Refresh"], optimizer: Any) -> List[Optional[StaleTable]]:
        """The whole current tables (weight and row state): each one's copy, patched with the rows that changed.

        Collective over the tables' group: every rank calls it for the same
        tables in the same order, those every rank holds a copy of (``replan``
        agrees on the copies first and drops the others). One all-gather of
        every rank's count of changed rows of every table, then one of those
        rows, all tables in one exchange. Every rank holds the same whole
        tables after it.

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
            sending the changed rows to every rank costs the busiest rank more
            rows than the whole move would.
        """
        out: List[Optional[StaleTable]] = [None] * len(tables)
        for group in {id(r.table.group): r.table.group for r in tables}.values():   # one group in practice
            at = [i for i, r in enumerate(tables) if r.table.group is group]
            for i, copy in zip(at, self._refresh([tables[i] for i in at], optimizer, group)):
                out[i] = copy
        return out

    def _refresh(self, tables: Sequence["Refresh"], optimizer: Any, group: Any) -> List[Optional[StaleTable]]:
        """:meth:`current_tables` for tables of one group."""
        changes = [self._changes(r, optimizer) for r in tables]
        everyone = all_gather_objects([-1 if c.which is None else c.which.numel() for c in changes], group)
        if any(len(theirs) != len(tables) for theirs in everyone):
            raise ValueError(f"sparsecomm stale replicas: the ranks refresh different numbers of tables "
                             f"({[len(theirs) for theirs in everyone]}): a bug or a version mismatch between ranks")
        sending: List[Tuple[Refresh, _Changes, List[int]]] = []
        for k, (r, c) in enumerate(zip(tables, changes)):
            counts = [int(theirs[k]) for theirs in everyone]
            if max(counts) > r.table.num_embeddings:
                raise ValueError(f"sparsecomm stale replicas: a rank announced {max(counts)} changed rows of table "
                                 f"{r.name!r}, which has {r.table.num_embeddings}: a bug or a version mismatch "
                                 f"between ranks")
            if min(counts) < 0 or _busiest(counts) > _whole_move(r):
                self.drop(r.name)
                continue
            self.rows_sent += c.which.numel()
            self.rows_total += c.owned.numel()
            sending.append((r, c, counts))
        for batch in _batches(sending):   # one exchange unless the rows of all of them would make a large buffer
            self._patch(batch, group)
        kept = {r.name for r, _, _ in sending}
        return [c.copy if r.name in kept else None for r, c in zip(tables, changes)]

    @staticmethod
    def _patch(sending: Sequence[Tuple[Refresh, "_Changes", List[int]]], group: Any) -> None:
        """Send every rank's changed rows of these tables in one exchange; patch every copy with them."""
        shards = [Shard(c.which if r.table.layout.spread else c.owned[c.which],   # a spread shard's slots are its ids
                        torch.cat([x[c.which.to(x.device)] for x in c.current], 1), c.copy.weight.shape[0])
                  for r, c, _ in sending]
        got = allgather_shards(shards, [counts for _, _, counts in sending], group)
        for (r, c, _), (ids, rows) in zip(sending, got):
            ordered = torch.sort(ids).values   # sorting the rows sent, not counting into a table-sized array
            if bool((ordered[1:] == ordered[:-1]).any()):
                raise ValueError("sparsecomm stale replicas: two ranks sent the same row: the shards overlap (a bug "
                                 "or a version mismatch between ranks)")
            at = 0
            for target in c.stale:
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
