"""The sharded lookup's metadata row and pooled extras: layout, encode, decode and validate in one place.

The first all-to-all of every lookup round
(:func:`sparsecomm.collectives.sharded_exchange.start_request`) sends every
peer one row of int64 words. Every rank sends every peer the same row (only
the padded ids differ), so every rank holds every rank's numbers and reaches
the same verdict on them:

=====================  ===========  ===============================================================
columns                width        meaning
=====================  ===========  ===============================================================
status                 1            this rank's input verdict (:class:`~sparsecomm.types.WireStatus`)
detail                 1            an int for the message (the offending id for ``ID_RANGE``)
round                  1            rounds this set of tables has done (equal on every rank)
capacity               1            ids per peer padded behind the row (equal on every rank)
tables                 1            ``T``, the tables of the round
width                  1            columns this rank needs: the row, then ``capacity``
*per table*            3N + 12      ``T`` blocks of :class:`TableMeta`:
  present              1              whether this rank looked the table up this round
  owned                1              rows this rank owns
  fingerprint          6              ``FINGERPRINT_LEN`` ints every rank must agree on
  counts               N              unique ids this rank asks of each owner
  path                 1              0: rows, 1: pooled at the owners
  weight bytes         1              bytes of one per-sample weight (0: none)
  occurrences          N              id occurrences sent to each owner (pooled path)
  bags                 N              bags with ids at each owner (pooled path)
  estimates            2              this rank's numbers for the rows and the pooled path
padded ids             capacity     for peer j: every table's ids for owner j (then pooled extras)
=====================  ===========  ===============================================================

A row is therefore ``6 + T * (3N + 12)`` int64 (:func:`row_width`) and the
message to each peer that plus ``capacity``, then zeros up to the group's
message width (the largest width any rank needed the round before).

A pooled lookup's extras for one owner (:func:`encode_pooled`) follow that
owner's unique ids, as int64 words: every occurrence's position among those
ids (int32), each bag's length (int32), then the per-sample weights (the
table's dtype) when it has any, each part padded to whole words
(:func:`pooled_words`).

Decoding trusts nothing: :func:`check_widths` bounds the announced widths
before a resend is sized from them, :func:`table_count_mismatch` compares the
table counts before the row is split into blocks, :func:`validate` checks
every count before anything is sized from it, and :func:`ids_problem` /
:func:`pooled_problem` check what arrived before an owner indexes with it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sparsecomm import ops
from sparsecomm.types import WireStatus

__all__ = ["FINGERPRINT_LEN", "MAX_OCCURRENCES", "META_HEAD", "MAX_WIDTH", "InputStatus", "MetaHeader", "copy_words",
           "TableMeta", "Announced", "PooledPart", "table_width", "row_width", "encode_row", "encode_message",
           "widen", "decode_headers", "check_widths", "table_count_mismatch", "decode_tables", "padded_words",
           "validate", "ids_problem", "pooled_problem", "pack_words", "words_for", "pooled_words", "encode_pooled",
           "decode_pooled"]

# Columns of the row's header (status, detail, round, capacity, tables, width).
META_HEAD = 6
FINGERPRINT_LEN = 6
# Per table: present, owned, the fingerprint, N counts, path, weight bytes, N occurrences, N bags, 2 estimates.
_TABLE_FIXED = 2 + FINGERPRINT_LEN + 2 + 2
_TABLE_PER_RANK = 3
# No rank needs more columns than this (a peer announcing more is refused before anything is sized from it).
MAX_WIDTH = 1 << 22
# No requester sends one owner more id occurrences than this in one round (refused before anything is sized).
MAX_OCCURRENCES = 1 << 28


class InputStatus(NamedTuple):
    """A rank's verdict on its own lookup input: the row's status and detail, and its own message."""

    code: WireStatus = WireStatus.OK
    detail: int = 0
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == WireStatus.OK


@dataclass(frozen=True)
class MetaHeader:
    """The first ``META_HEAD`` columns of a row (ints as received: a peer's status may be any code)."""

    status: int
    detail: int
    round: int
    capacity: int
    num_tables: int
    width: int

    def encode(self) -> List[int]:
        return [int(self.status), self.detail, self.round, self.capacity, self.num_tables, self.width]


@dataclass(frozen=True)
class TableMeta:
    """One table's block of a row (``3N + 12`` columns; ints as received, checked by :func:`validate`)."""

    present: int
    num_local: int
    fingerprint: Tuple[int, ...]
    counts: Tuple[int, ...]
    path: int = 0
    weight_bytes: int = 0
    occurrences: Optional[Tuple[int, ...]] = None   # None: zeros (the rows path)
    bags: Optional[Tuple[int, ...]] = None
    estimates: Tuple[int, int] = (0, 0)

    def encode(self) -> List[int]:
        n = len(self.counts)
        if len(self.fingerprint) != FINGERPRINT_LEN:
            raise ValueError(f"a table fingerprint has {FINGERPRINT_LEN} ints, got {len(self.fingerprint)}")
        zeros = [0] * n
        return [int(self.present), self.num_local, *self.fingerprint, *self.counts, self.path, self.weight_bytes,
                *(self.occurrences if self.occurrences is not None else zeros),
                *(self.bags if self.bags is not None else zeros), *self.estimates]

    @classmethod
    def decode(cls, block: Sequence[int], n: int) -> "TableMeta":
        fp_end = 2 + FINGERPRINT_LEN
        pool_at = fp_end + n
        return cls(block[0], block[1], tuple(block[2:fp_end]), tuple(block[fp_end:pool_at]), block[pool_at],
                   block[pool_at + 1], tuple(block[pool_at + 2:pool_at + 2 + n]),
                   tuple(block[pool_at + 2 + n:pool_at + 2 + 2 * n]), (block[-2], block[-1]))


class Announced(NamedTuple):
    """Every rank's row, decoded (the same on every rank).

    Attributes:
        headers: per rank, its :class:`MetaHeader`.
        tables: per rank, per table, its :class:`TableMeta`.
        counts: ``[table, rank, owner]`` int64: the ids each rank asks of each owner.
        occurrences, bags: the same layout: what a pooled lookup adds (zeros on the rows path).
    """

    headers: List[MetaHeader]
    tables: List[Tuple[TableMeta, ...]]
    counts: torch.Tensor
    occurrences: torch.Tensor
    bags: torch.Tensor


def table_width(n: int) -> int:
    """Columns of one table's block on ``n`` ranks: ``3n + 12``."""
    return _TABLE_FIXED + _TABLE_PER_RANK * n


def row_width(num_tables: int, n: int) -> int:
    """Columns of a row without its padded ids: ``6 + T (3N + 12)``."""
    return META_HEAD + num_tables * table_width(n)


def encode_row(header: MetaHeader, tables: Sequence[TableMeta]) -> List[int]:
    """The row: the header, then every table's block."""
    row = header.encode()
    for t in tables:
        row += t.encode()
    return row


def encode_message(row: Sequence[int], words: Optional[torch.Tensor], lengths: Sequence[int], n: int,
                   width: int) -> torch.Tensor:
    """``(n, max(need, width))`` int64 on the CPU: the row for every peer, then the first ``capacity`` of peer j's
    words.

    ``words`` holds every peer's int64 words (ids, then pooled extras) back to
    back, peer 0's first, ``lengths[j]`` of them peer j's; only the first
    ``capacity`` of each peer's travel here (the rest, if any, take a second
    all-to-all, which every rank sees from the counts).
    """
    head, capacity, need = len(row), row[3], row[5]
    full = torch.zeros(n, max(need, width), dtype=torch.int64)
    full[:, :head] = torch.tensor(row, dtype=torch.int64)
    if capacity and words is not None:   # behind peer j's row, from where its words start
        starts = itertools.accumulate(lengths, initial=0)
        copy_words(full.view(-1), words.cpu(), [(j * full.shape[1] + head, start, min(count, capacity))
                                                for j, (start, count) in enumerate(zip(starts, lengths))])
    return full


def widen(message: torch.Tensor, width: int) -> torch.Tensor:
    """``message`` with zero columns up to ``width`` (the resend at the largest need)."""
    return torch.nn.functional.pad(message, (0, width - message.shape[1]))


def decode_headers(received: torch.Tensor) -> List[MetaHeader]:
    """Every rank's header from the received rows (``(n, >= META_HEAD)``, one per source rank)."""
    return [MetaHeader(*h) for h in received[:, :META_HEAD].tolist()]


def check_widths(headers: Sequence[MetaHeader]) -> int:
    """The largest width any rank needs.

    Raises:
        ValueError: a rank announced a width outside ``[META_HEAD, MAX_WIDTH]``
            (on every rank: all hold the same headers).
    """
    needs = [h.width for h in headers]
    bad = next((r for r, w in enumerate(needs) if not META_HEAD <= w <= MAX_WIDTH), None)
    if bad is not None:
        raise ValueError(f"sparsecomm sharded lookup: rank {bad} announced a {needs[bad]}-column request, outside "
                         f"[{META_HEAD}, {MAX_WIDTH}]: a bug or a version mismatch between ranks; nothing was "
                         f"exchanged")
    return max(needs)


def table_count_mismatch(headers: Sequence[MetaHeader], num_tables: int) -> Optional[int]:
    """The first rank whose round holds another number of tables than ``num_tables``, or None."""
    return next((r for r, h in enumerate(headers) if h.num_tables != num_tables), None)


def decode_tables(received: torch.Tensor, headers: List[MetaHeader], num_tables: int) -> Announced:
    """Every rank's table blocks (every header announced ``num_tables``: :func:`table_count_mismatch`)."""
    n = received.shape[0]
    per_table = table_width(n)
    blocks = received[:, META_HEAD:row_width(num_tables, n)].reshape(n, num_tables, per_table)
    tables = [tuple(TableMeta.decode(b, n) for b in tb) for tb in blocks.tolist()]
    counts_at = 2 + FINGERPRINT_LEN
    occ_at = counts_at + n + 2
    counts = blocks[:, :, counts_at:counts_at + n].permute(1, 0, 2)                  # [table, rank, owner]
    occurrences = blocks[:, :, occ_at:occ_at + n].permute(1, 0, 2)
    bags = blocks[:, :, occ_at + n:occ_at + 2 * n].permute(1, 0, 2)
    return Announced(headers, tables, counts, occurrences, bags)


def padded_words(received: torch.Tensor, num_tables: int, words: Sequence[int]) -> torch.Tensor:
    """The words each source rank padded behind its row for this rank (``words[r]`` of rank r), concatenated."""
    head, stride = row_width(num_tables, received.shape[0]), received.shape[1]
    out = received.new_empty(sum(words))
    copy_words(out, received, [(start, r * stride + head, count) for r, (start, count)
                               in enumerate(zip(itertools.accumulate(words, initial=0), words))])
    return out


def copy_words(out: torch.Tensor, words: torch.Tensor, pieces: Sequence[Tuple[int, int, int]]) -> None:
    """Copy int64 words in one call: each ``(to, at, count)`` piece copies ``count`` words of ``words`` (flat)
    from word ``at`` to ``out[to:to + count]`` (``out``: 1-D int64); empty pieces are left out."""
    segments = [(to, count, 8 * at) for to, at, count in pieces if count]
    if segments:
        ops.unpack_rows(out, words.contiguous().view(-1).view(torch.uint8), segments)


def _describe_status(rank: int, status: int, detail: int, num_rows: Optional[int]) -> str:
    if status == WireStatus.ID_RANGE:
        where = f"[0, {num_rows})" if num_rows is not None else "its table's rows"
        return f"rank {rank} looked up id {detail}, outside {where}"
    return f"rank {rank} passed an invalid input"


def validate(a: Announced, me: int, num_rows: Sequence[int], weight_itemsize: Sequence[int]) -> Optional[str]:
    """The first problem in every rank's row, or None; the same answer on every rank but ``me``'s wording.

    ``num_rows`` and ``weight_itemsize`` per table of the round. Every rank
    holds the same rows, so every rank reaches the same verdict: all raise,
    or none does. Counts are checked before anything is sized from them: a
    peer never asks an owner for more ids than the owner has rows (the ids it
    sends are unique), nor for ids of a table it did not look up.
    """
    for r, h in enumerate(a.headers):
        if h.status != WireStatus.OK:
            return _describe_status(r, h.status, h.detail, num_rows[0] if len(num_rows) == 1 else None)
    ours = [t.fingerprint for t in a.tables[me]]
    for r, tables in enumerate(a.tables):
        theirs = [t.fingerprint for t in tables]
        if theirs != ours:
            return (f"rank {me} is looking up tables {ours} (num_embeddings, embedding_dim, table id, kind, "
                    f"hot-row version, wire dtype) but rank {r} is looking up {theirs}: ranks must call the same "
                    f"tables in the same order, with the same compression (and load states into them on every rank)")
    first, mine = a.headers[0], a.headers[me]
    for r, h in enumerate(a.headers):
        if h.capacity != first.capacity:
            return (f"ranks pad their ids to different capacities (rank 0: {first.capacity}, rank {r}: "
                    f"{h.capacity}): a bug or a version mismatch between ranks")
        if h.round != mine.round:
            return (f"rank {me} is in lookup round {mine.round} of its tables but rank {r} in round {h.round}: "
                    f"ranks must look up the same tables in the same order (the same code path)")
    for t, rows in enumerate(num_rows):
        problem = _counts_problem(a, t, rows) or _pooled_counts_problem(a, t, weight_itemsize[t])
        if problem:
            return problem
    return None


def _counts_problem(a: Announced, t: int, num_rows: int) -> Optional[str]:
    """Table ``t``'s owned rows and id counts: within the table, adding up, within each owner's rows.

    On the decoded ints (a few per rank): cheaper than tensor ops at these sizes.
    """
    owned = [tables[t].num_local for tables in a.tables]
    for r, c in enumerate(owned):
        if not 0 <= c <= num_rows:
            return f"rank {r} announced {c} owned rows, outside [0, {num_rows}]: a bug or a version mismatch"
    if sum(owned) != num_rows:
        return (f"the ranks announce {owned} owned rows, which do not add up to the table's {num_rows}: "
                f"a bug or a version mismatch between ranks")
    for r, tables in enumerate(a.tables):
        m = tables[t]
        if m.present not in (0, 1):
            return f"rank {r} announced presence {m.present} for table {t}: a bug or a version mismatch"
        for j, c in enumerate(m.counts):
            limit = owned[j] if m.present else 0
            if not 0 <= c <= limit:
                return (f"rank {r} announced {c} ids to look up on rank {j}, outside "
                        f"[0, {limit}] (rank {j}'s rows): a bug or a version mismatch between ranks")
    return None


def _pooled_counts_problem(a: Announced, t: int, itemsize: int) -> Optional[str]:
    """Table ``t``'s path, weight bytes, estimates, occurrences and bags: possible for the ids announced."""
    for r, tables in enumerate(a.tables):
        m = tables[t]
        est_rows, est_pooled = m.estimates
        if m.path not in (0, 1) or (m.path and not m.present) or m.weight_bytes not in (0, itemsize) or \
                (m.weight_bytes and not m.path) or est_rows < 0 or est_pooled < 0:
            return (f"rank {r} announced an impossible pooled lookup of table {t} (path {m.path}, weight bytes "
                    f"{m.weight_bytes}): a bug or a version mismatch between ranks")
        for j, (occ, bg, cnt) in enumerate(zip(m.occurrences, m.bags, m.counts)):
            if m.path:
                bad = occ < cnt or occ > MAX_OCCURRENCES or bg < 0 or bg > occ or (occ > 0 and bg == 0)
            else:
                bad = occ != 0 or bg != 0
            if bad:
                return (f"rank {r} announced {occ} id occurrences in {bg} bags for {cnt} "
                        f"ids to pool on rank {j}: impossible (a bug or a version mismatch between ranks)")
    return None


def ids_problem(requested: torch.Tensor, recv_counts: List[int], me: int, num_rows: int,
                owns: Optional[Callable[[torch.Tensor], torch.Tensor]],
                owned_range: Optional[Tuple[int, int]] = None) -> Optional[str]:
    """Why this owner refuses the ids its peers sent (outside the table, or not its own), or None.

    ``owned_range``: the ids this rank owns when they are one range ``[start, stop)`` (table-wise and range
    layouts): ids whose smallest and largest lie in it pass on those two alone; anything else is checked id by
    id (``owns``), which also finds the first bad one for the message.
    """
    if requested.numel() == 0:
        return None
    if owned_range is not None:
        lo, hi = (int(x) for x in torch.aminmax(requested))
        if max(owned_range[0], 0) <= lo and hi < min(owned_range[1], num_rows):
            return None
    ok = (requested >= 0) & (requested < num_rows)
    if owns is not None:
        ok &= owns(requested)
    if bool(ok.all()):
        return None
    first = int((~ok).nonzero()[0, 0])
    src = next(r for r, end in enumerate(torch.tensor(recv_counts).cumsum(0).tolist()) if first < end)
    bad = int(requested[first])
    where = f"outside [0, {num_rows})" if not 0 <= bad < num_rows else "owned by another rank"
    return f"rank {src} asked rank {me} for id {bad}, {where}: a bug or a version mismatch between ranks"


class PooledPart(NamedTuple):
    """What one requester's pooled lookup asked of this owner (checked by :func:`pooled_problem`).

    Attributes:
        positions: ``(n,)`` int64, each occurrence's index among the unique ids
            that requester sent for the table.
        lengths: ``(m,)`` int64, each bag's occurrences (all >= 1, sum ``n``).
        weights: ``(n,)`` per-sample weights, or None.
    """

    positions: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor]


def pooled_problem(part: PooledPart, unique: int, src: int, me: int) -> Optional[str]:
    """Why this owner refuses what requester ``src`` sent for a pooled lookup, or None."""
    pos, lengths = part.positions, part.lengths
    if not pos.numel() and not lengths.numel():
        return None
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= unique):
        return f"rank {src} sent rank {me} an occurrence position outside [0, {unique}) for a pooled lookup"
    if lengths.numel() and int(lengths.min()) < 1:
        return f"rank {src} sent rank {me} an empty bag for a pooled lookup"
    if int(lengths.sum()) != pos.numel():
        return f"rank {src} sent rank {me} bag lengths that do not add up to its {pos.numel()} occurrences"
    return None


def pack_words(*tensors: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensors`` (each padded to 8 bytes) as one int64 tensor (see :func:`words_for`)."""
    sizes = [words_for(t.numel(), t.element_size()) for t in tensors]
    out = torch.zeros(sum(sizes), dtype=torch.int64, device=tensors[0].device if tensors else None)
    raw, at = out.view(torch.uint8), 0
    for t, size in zip(tensors, sizes):
        b = t.contiguous().view(-1).view(torch.uint8)
        raw[at:at + b.numel()] = b
        at += size * 8
    return out


def words_for(count: int, itemsize: int) -> int:
    """int64 words :func:`pack_words` takes for ``count`` items of ``itemsize`` bytes."""
    return (count * itemsize + 7) // 8


def _unpack(words: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    itemsize = dtype.itemsize
    return words.contiguous().view(torch.uint8)[:count * itemsize].view(dtype)


def pooled_words(occurrences: int, bags: int, weight_bytes: int) -> int:
    """int64 words of one requester's pooled extras for one owner (positions, lengths, weights)."""
    return words_for(occurrences, 4) + words_for(bags, 4) + words_for(occurrences, weight_bytes)


def encode_pooled(positions: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """One owner's pooled extras: int32 positions, int32 bag lengths, then the weights, as int64 words."""
    if not positions.numel() and not lengths.numel():   # an owner asked nothing (most, for a table-wise table)
        return torch.zeros(0, dtype=torch.int64, device=positions.device)
    parts = [positions.to(torch.int32), lengths.to(torch.int32)]
    return pack_words(*parts, *([weights] if weights is not None else []))


def decode_pooled(words: torch.Tensor, occurrences: int, bags: int, weight_dtype: Optional[torch.dtype]
                  ) -> PooledPart:
    """The :class:`PooledPart` in ``words`` (what :func:`encode_pooled` made; ``weight_dtype`` None: no weights).

    The counts come from a validated row; the contents are checked by :func:`pooled_problem`.
    """
    if not occurrences and not bags:   # nothing asked of this owner: no words to read
        empty = words.new_zeros(0)
        return PooledPart(empty, empty, words.new_zeros(0, dtype=weight_dtype) if weight_dtype is not None else None)
    wp, wl = words_for(occurrences, 4), words_for(bags, 4)
    return PooledPart(_unpack(words[:wp], torch.int32, occurrences).to(torch.int64),
                      _unpack(words[wp:wp + wl], torch.int32, bags).to(torch.int64),
                      _unpack(words[wp + wl:], weight_dtype, occurrences) if weight_dtype is not None else None)
