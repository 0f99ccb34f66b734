"""Exchanges of the sharded (parameter-server) embedding: request rows, return rows, push gradients.

One lookup round on N ranks covers any number of tables (docs/DESIGN.md,
"Sharded mode"), always in the same four all-to-alls:

1. :func:`request_rows`: every rank sends each owner the ids it needs from it.
   A small all-to-all of metadata goes first: each rank sends every peer the
   same row (input-status code, round number, and per table: whether it
   looked the table up, its number of owned rows, the table's fingerprint and
   its whole vector of row counts), so every rank holds every rank's row and
   validates the same numbers. A bad id, a mismatched call or an impossible
   count on any rank raises ``ValueError`` on *every* rank before any id moves
   or any buffer is sized from a peer's count, instead of one rank raising
   while the others wait in the next collective. Then every table's ids
   travel in one all-to-all, and the owners check the ids they receive
   (inside the table and owned by them).
2. :func:`pull_rows` (owner -> requester): owners send every table's rows
   back in one all-to-all, in the order they were asked for, each peer's rows
   behind one int64 that says whether this owner accepted the ids it was
   sent. An owner that refused sends no table rows and every rank raises
   ``ValueError``: the verdict rides on this all-to-all, so it costs no extra collective.
3. :func:`exchange_rows` (requester -> owner), in backward: every table's
   gradient rows travel the same routes reversed, in one all-to-all; the ids
   need not travel again.

A bag table may be looked up *pooled* (owner-side pooling): with its unique
ids, the requester sends each owner, for the ids that owner holds, every
occurrence's position among those ids, the length of each bag that has ids
there and (optionally) each occurrence's per-sample weight; the owner answers
with one partial pooled bag per such bag instead of one row per id, and
receives one gradient row per bag in backward. Which path a requester took is
in its metadata row, so an owner serves each requester as asked; the extras
ride in the same messages as the ids (packed into int64 words), so the path
costs no extra collective.

The bytes go through :mod:`sparsecomm.collectives.exchange` (one packing path).
Tables talk over a dedicated twin of the caller's group (:func:`sharded_group`)
so their synchronous all-to-alls never interleave with DDP's asynchronous
allreduces on the default group, which run during the same backward pass.
A ``group`` of None here means "no peers": everything stays local.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.exchange import (all_to_all, all_to_all_rows, allgather_rows, count_bytes, exchange_direct,
                                            wire_index_dtype, wire_row_bytes)
from sparsecomm.collectives.groups import comm_device, twin_group
from sparsecomm.types import SparseSyncStats

__all__ = [
    "STATUS_OK", "STATUS_ID_RANGE", "STATUS_BAD_INPUT", "FINGERPRINT_LEN", "MAX_OCCURRENCES", "TableRequest",
    "PooledRequest", "PooledPart", "Routes", "Carry", "pack_words", "words_for", "pooled_words",
    "world", "sharded_group", "request_rows", "start_request", "finish_request", "PendingRequest", "pull_rows",
    "exchange_rows", "allgather_table_rows",
    "all_gather_objects", "barrier", "agree", "broadcast_int",
]

# Input status a rank reports with its row counts (column 0 of the metadata).
STATUS_OK, STATUS_ID_RANGE, STATUS_BAD_INPUT = 0, 1, 2
# A metadata row: status, detail, round, capacity, tables, width (the columns this rank needs), then per table:
# present, owned rows, fingerprint, one count per rank; then (with a capacity) this rank's ids for the
# receiving peer, padded to the capacity; then zeros up to the group's message width.
_META_HEAD = 6
# Per group, the columns of the first all-to-all of the next round: the same on every rank (the largest
# width any rank needed last round), so a round costs one all-to-all while its needs do not grow.
_MESSAGE_WIDTH: Dict[Any, int] = {}
# No rank needs more columns than this (a peer announcing more is refused before anything is sized from it).
_MAX_WIDTH = 1 << 22
FINGERPRINT_LEN = 5
# Per table, after the counts: path (0 rows, 1 pooled), per-sample-weight bytes, per owner the occurrences and
# the bags sent to it (pooled), then this rank's byte estimates of both paths (the next round's choice).
_POOL_HEAD = 2
# No requester sends one owner more id occurrences than this in one round (refused before anything is sized).
MAX_OCCURRENCES = 1 << 28


class PooledRequest(NamedTuple):
    """What a pooled lookup of one bag table sends each owner besides its unique ids.

    Attributes:
        occurrences: ``(N,)`` int64, id occurrences sent to each owner (ids of
            the bags that owner holds, with repeats).
        bags: ``(N,)`` int64, bags with at least one id at each owner.
        words: per owner, the extras packed into int64 words: every
            occurrence's position among the unique ids sent to that owner
            (int32), each bag's length there (int32), then the per-sample
            weights (the table's dtype) when ``weight_bytes``.
        weight_bytes: bytes of one per-sample weight, 0 without weights.
    """

    occurrences: torch.Tensor
    bags: torch.Tensor
    words: List[torch.Tensor]
    weight_bytes: int = 0


class PooledPart(NamedTuple):
    """What one requester's pooled lookup asked of this owner (checked).

    Attributes:
        positions: ``(n,)`` int64, each occurrence's index among the unique ids
            that requester sent for the table.
        lengths: ``(m,)`` int64, each bag's occurrences (all >= 1, sum ``n``).
        weights: ``(n,)`` per-sample weights, or None.
    """

    positions: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor]


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
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return words.contiguous().view(torch.uint8)[:count * itemsize].view(dtype)


def pooled_words(occurrences: int, bags: int, weight_bytes: int) -> int:
    """int64 words of one requester's pooled extras for one owner (positions, lengths, weights)."""
    return words_for(occurrences, 4) + words_for(bags, 4) + words_for(occurrences, weight_bytes)


class TableRequest(NamedTuple):
    """What one table of a lookup round asks of the owners.

    Attributes:
        ids_by_owner: ``(n,)`` unique ids grouped by owner (owner 0's first),
            as :func:`sparsecomm.ops.partition_rows` returns them.
        counts: ``(N,)`` int64, ids per owner.
        fingerprint: ``FINGERPRINT_LEN`` ints that must be equal on every rank
            (table shape and identity): a mismatch means the ranks are in different calls.
        num_rows: table size (bounds the ids; sizes them on the wire).
        num_local: rows this rank owns (bounds what a peer may ask of it).
        present: whether this rank looked the table up in this round (an
            absent table asks for nothing but still serves its rows to peers).
        owns: ``owns(ids) -> bool tensor``, whether this rank owns each id;
            the received ids are checked with it (and against ``num_rows``).
    """

    ids_by_owner: torch.Tensor
    counts: torch.Tensor
    fingerprint: Tuple[int, ...]
    num_rows: int
    num_local: int
    present: bool = True
    owns: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    pooled: Optional[PooledRequest] = None
    weight_dtype: torch.dtype = torch.float32
    estimates: Tuple[int, int] = (0, 0)     # this rank's cost of the rows and the pooled path (non-negative ints)


class Routes(NamedTuple):
    """The validated routes of one lookup round, per table; backward reuses them reversed.

    Attributes:
        send: per table, ids this rank asked of each owner.
        recv: per table, ids each rank asked of me.
        requested: per table, those ids (int64, grouped by source rank).
        present: per table, whether any rank looked it up this round (the
            same on every rank: only those get a gradient).
        problem: None, or why this owner refuses the ids it was sent; pass the
            routes to :func:`pull_rows`, which makes every rank raise.
        largest: the most int64 words (ids and pooled extras) any rank sent
            any one owner (all tables together; the same on every rank):
            sizes the next round's capacity.
        rows_send: per table, rows each owner returns to this rank (its ids,
            or its bags when this rank looked the table up pooled); backward
            sends as many gradient rows back.
        rows_recv: per table, rows this rank serves each requester.
        pooled: per table, per requester, the :class:`PooledPart` it sent, or
            None (rows path).
        estimates: per table, every rank's two numbers for the rows and the
            pooled path (what its table's ``owner_pooling`` rule weighs: bytes,
            or measured microseconds), the same on every rank: the next round's choice.
    """

    send: List[List[int]]
    recv: List[List[int]]
    requested: List[torch.Tensor]
    present: List[bool]
    problem: Optional[str]
    largest: int = 0
    rows_send: Optional[List[List[int]]] = None
    rows_recv: Optional[List[List[int]]] = None
    pooled: Optional[List[List[Optional[PooledPart]]]] = None
    estimates: Optional[List[List[Tuple[int, int]]]] = None


def world(group: Optional[dist.ProcessGroup] = None) -> Tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def sharded_group(group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
    """Return the dedicated group sharded tables exchange over, or None for a world of one.

    The library's twin of ``group`` for sharded tables
    (:func:`sparsecomm.collectives.groups.twin_group`: one cache, the
    group's timeout). Collective on first call for a group: every process of
    the default group must make it, in the same order (tables are constructed
    on every rank, which is where it happens).
    """
    if world(group)[1] == 1:
        return None
    return twin_group(group, "sharded")


class _Meta(NamedTuple):
    """One rank's metadata row, as every rank received it (its counts stay in a tensor)."""

    status: int
    detail: int
    round: int
    capacity: int
    count: int                            # tables in the round
    tables: Tuple[Tuple[int, ...], ...]   # per table: present, then the fingerprint
    num_local: Tuple[int, ...]            # per table: rows the rank says it owns
    pooled: Tuple[Tuple[int, ...], ...]   # per table: path, weight bytes, estimate rows, estimate pooled


def _describe_status(rank: int, status: int, detail: int, num_rows: Optional[int]) -> str:
    if status == STATUS_ID_RANGE:
        where = f"[0, {num_rows})" if num_rows is not None else "its table's rows"
        return f"rank {rank} looked up id {detail}, outside {where}"
    return f"rank {rank} passed an invalid input"


def _meta_problem(rows: List[_Meta], counts: torch.Tensor, occurrences: torch.Tensor, bags: torch.Tensor, me: int,
                  requests: Sequence[TableRequest]) -> Optional[str]:
    """The first problem in every rank's metadata, or None; the same answer on every rank but ``me``'s wording.

    ``counts[t, r, j]``: the ids rank r says it asks of rank j for table t;
    ``occurrences`` and ``bags`` (same layout): what a pooled lookup adds.
    Every rank holds the same rows, so every rank reaches the same verdict:
    all raise, or none does. Counts are checked before anything is sized
    from them: a peer never asks an owner for more ids than the owner has
    rows (the ids it sends are unique), nor for ids of a table it did not look up.
    """
    for r, m in enumerate(rows):
        if m.status != STATUS_OK:
            return _describe_status(r, m.status, m.detail, requests[0].num_rows if len(requests) == 1 else None)
    mine = rows[me]
    for r, m in enumerate(rows):
        theirs = [fp[1:] for fp in m.tables]
        ours = [fp[1:] for fp in mine.tables]
        if theirs != ours:
            return (f"rank {me} is looking up tables {ours} (num_embeddings, embedding_dim, table id, kind, "
                    f"hot-row version) but rank {r} is looking up {theirs}: ranks must call the same tables in the "
                    f"same order (and load states into them on every rank)")
    for r, m in enumerate(rows):
        if m.capacity != rows[0].capacity:
            return (f"ranks pad their ids to different capacities (rank 0: {rows[0].capacity}, rank {r}: "
                    f"{m.capacity}): a bug or a version mismatch between ranks")
        if m.round != mine.round:
            return (f"rank {me} is in lookup round {mine.round} of its tables but rank {r} in round {m.round}: "
                    f"ranks must look up the same tables in the same order (the same code path)")
    for t, req in enumerate(requests):
        owned = [m.num_local[t] for m in rows]
        for r, c in enumerate(owned):
            if not 0 <= c <= req.num_rows:
                return (f"rank {r} announced {c} owned rows, outside [0, {req.num_rows}]: a bug or a version "
                        f"mismatch")
        if sum(owned) != req.num_rows:
            return (f"the ranks announce {owned} owned rows, which do not add up to the table's {req.num_rows}: "
                    f"a bug or a version mismatch between ranks")
        limit = torch.tensor(owned).view(1, -1) * torch.tensor([m.tables[t][0] for m in rows]).view(-1, 1)
        bad = (counts[t] < 0) | (counts[t] > limit)
        if bool(bad.any()):
            r, j = (int(x) for x in bad.nonzero()[0])
            return (f"rank {r} announced {int(counts[t, r, j])} ids to look up on rank {j}, outside "
                    f"[0, {int(limit[r, j])}] (rank {j}'s rows): a bug or a version mismatch between ranks")
        itemsize = torch.empty(0, dtype=req.weight_dtype).element_size()
        for r, m in enumerate(rows):
            path, weight_bytes, est_rows, est_pooled = m.pooled[t]
            occ, bg, cnt = occurrences[t, r], bags[t, r], counts[t, r]
            if path not in (0, 1) or (path and not m.tables[t][0]) or weight_bytes not in (0, itemsize) or \
                    (weight_bytes and not path) or est_rows < 0 or est_pooled < 0:
                return (f"rank {r} announced an impossible pooled lookup of table {t} (path {path}, weight bytes "
                        f"{weight_bytes}): a bug or a version mismatch between ranks")
            if path:
                bad = (occ < cnt) | (occ > MAX_OCCURRENCES) | (bg < 0) | (bg > occ) | ((occ > 0) & (bg == 0))
            else:
                bad = (occ != 0) | (bg != 0)
            if bool(bad.any()):
                j = int(bad.nonzero()[0, 0])
                return (f"rank {r} announced {int(occ[j])} id occurrences in {int(bg[j])} bags for {int(cnt[j])} "
                        f"ids to pool on rank {j}: impossible (a bug or a version mismatch between ranks)")
    return None


def _ids_problem(requested: torch.Tensor, recv_counts: List[int], me: int, num_rows: int,
                 owns: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> Optional[str]:
    """Why this owner refuses the ids its peers sent (outside the table, or not its own), or None."""
    if requested.numel() == 0:
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


def _pooled_problem(part: PooledPart, unique: int, src: int, me: int) -> Optional[str]:
    """Why this owner refuses what requester ``src`` sent for a pooled lookup, or None."""
    pos, lengths = part.positions, part.lengths
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= unique):
        return f"rank {src} sent rank {me} an occurrence position outside [0, {unique}) for a pooled lookup"
    if lengths.numel() and int(lengths.min()) < 1:
        return f"rank {src} sent rank {me} an empty bag for a pooled lookup"
    if int(lengths.sum()) != pos.numel():
        return f"rank {src} sent rank {me} bag lengths that do not add up to its {pos.numel()} occurrences"
    return None


def _by_peer(per_table: Sequence[Sequence[int]], n: int) -> List[int]:
    return [sum(c[j] for c in per_table) for j in range(n)]


def _split_by_peer(flat: torch.Tensor, per_table: Sequence[Sequence[int]]) -> List[List[torch.Tensor]]:
    """Undo the peer-major packing of :func:`request_rows`' messages: per table, one piece per source rank."""
    n = len(per_table[0]) if per_table else 0
    sizes = [per_table[t][j] for j in range(n) for t in range(len(per_table))]
    pieces = torch.split(flat, sizes) if sizes else []
    return [[pieces[j * len(per_table) + t] for j in range(n)] for t in range(len(per_table))]


def request_rows(requests: Sequence[TableRequest], *, status: int, detail: int, message: str, round: int,
                 group: Optional[dist.ProcessGroup], stats: Optional[SparseSyncStats] = None,
                 capacity: int = 0) -> Routes:
    """Send each owner the ids this rank needs from it, for every table of a lookup round at once.

    Args:
        requests: one per table of the round, in the same order on every rank.
        status: this rank's input status (``STATUS_*``); anything but OK makes
            every rank raise before rows move.
        detail: an int for the message (the offending id for ``STATUS_ID_RANGE``).
        message: this rank's own description of its bad input (used on this rank).
        round: how many rounds this set of tables has done (equal on every rank).
        group: from :func:`sharded_group`; None: no peers.
        stats: counters to add the bytes moved to.
        capacity: ids per peer that ride padded in the metadata's all-to-all
            (equal on every rank, e.g. the last round's ``largest`` + slack);
            0: none, the ids take a second all-to-all.

    Returns:
        The validated :class:`Routes`.

    Raises:
        ValueError: on every rank, naming the first rank whose input was bad,
            whose call does not match this one, or whose counts are impossible
            (negative, more than the owner's rows, or not adding up). Nothing
            else was exchanged and nothing was sized from a peer's numbers.

    One or two all-to-alls whatever the number of tables: the metadata
    (``4 + T * (N + 6)`` int64 per peer: every rank learns every rank's
    counts, which is what lets all of them agree on a bad one without another
    collective) with every peer's ids padded to ``capacity`` behind it; when
    some rank has more ids for some owner than that (every rank sees it in
    the counts), every table's ids travel again in a second all-to-all,
    peer-major, in the widest table's wire dtype. Padded ids are read only
    after the counts that say how many there are passed the checks.
    """
    return finish_request(start_request(requests, status=status, detail=detail, message=message, round=round,
                                        group=group, stats=stats, capacity=capacity))


class PendingRequest:
    """A :func:`start_request` whose first all-to-all may still be in flight; :func:`finish_request` ends it."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class Carry(NamedTuple):
    """Rows that ride in a request's first all-to-all: an earlier round's gradient rows, pushed late.

    Attributes:
        rows: per table, ``sum(send[t])`` rows, those for peer j consecutive, in peer order.
        send: per table, rows for each peer.
        recv: per table, rows from each peer. Both count lists come from an
            earlier round's validated routes, so every rank expects what its
            peers send.
    """

    rows: List[torch.Tensor]
    send: List[List[int]]
    recv: List[List[int]]


def start_request(requests: Sequence[TableRequest], *, status: int, detail: int, message: str, round: int,
                  group: Optional[dist.ProcessGroup], stats: Optional[SparseSyncStats] = None, capacity: int = 0,
                  async_op: bool = False, carry: Optional[Carry] = None) -> PendingRequest:
    """The first half of :func:`request_rows`: build the metadata message and send it.

    With ``async_op`` the all-to-all runs in the background (the process
    group's own thread) until :func:`finish_request`, so a lookup's id
    exchange can overlap other work; every rank must start and finish the
    same requests in the same order, as with any collective.

    ``carry`` (not with ``async_op``): rows that travel in the same
    all-to-all, behind the metadata (a deferred gradient push); what arrives
    is in the returned request's ``carried`` (per table, by source rank), as
    soon as this returns, whatever :func:`finish_request` then finds.
    """
    if carry is not None and async_op:
        raise ValueError("start_request: carried rows travel in a synchronous request only")
    send = [[int(c) for c in r.counts.tolist()] for r in requests]
    common = dict(requests=requests, send=send, status=status, message=message, group=group, stats=stats,
                  capacity=capacity)
    if group is None:
        return PendingRequest(**common, carried=list(carry.rows) if carry is not None else None)
    me, n = world(group)
    dev = comm_device(group, requests[0].ids_by_owner.device)
    per_table = 2 + FINGERPRINT_LEN + n + _POOL_HEAD + 2 * n + 2
    head = _META_HEAD + len(requests) * per_table
    need = head + capacity
    row = [status, detail, round, capacity, len(requests), need]
    zeros = [0] * n
    for r, counts in zip(requests, send):
        pr = r.pooled
        row += [int(r.present), r.num_local, *r.fingerprint, *counts,
                int(pr is not None), pr.weight_bytes if pr is not None else 0,
                *(pr.occurrences.tolist() if pr is not None else zeros),
                *(pr.bags.tolist() if pr is not None else zeros), *r.estimates]
    # Per table, per owner: the unique ids (int64), then a pooled lookup's extras (int64 words).
    pieces = []
    for r, c in zip(requests, send):
        ids = torch.split(r.ids_by_owner.to(torch.int64), c)
        pieces.append([torch.cat([ids[j], r.pooled.words[j].to(ids[j].device)]) if r.pooled is not None else ids[j]
                       for j in range(n)])
    key = id(group)
    width = _MESSAGE_WIDTH.get(key, _META_HEAD)
    full = torch.zeros(n, max(need, width), dtype=torch.int64)
    full[:, :head] = torch.tensor(row, dtype=torch.int64)
    if capacity:
        for j in range(n):
            mine = torch.cat([pieces[t][j] for t in range(len(requests))])[:capacity].cpu()
            full[j, head:head + mine.numel()] = mine
    # Every rank sends ``width`` columns (known to all): its whole row when it fits, else only its header,
    # which says how many columns it needs; then every rank resends at the largest need.
    work = recv_meta = message_out = carried = None
    if async_op:
        message_out = full[:, :width].contiguous().to(dev)   # kept in the pending request until the wait
        recv_meta = torch.empty_like(message_out)
        count_bytes(stats, [width * 8] * n, [width * 8] * n, me, None)
        work = all_to_all(recv_meta, message_out, group=group, async_op=True)
    elif carry is not None:
        ones = [1] * n
        recv_meta, *got = _exchange_blocks([full[:, :width], *carry.rows], [ones, *carry.send],
                                           [ones, *carry.recv], group, stats)
        carried = [g.to(r.device) for g, r in zip(got, carry.rows)]
    else:
        (recv_meta,) = all_to_all_rows([full[:, :width]], [1] * n, [1] * n, group, dev, stats)
    return PendingRequest(**common, me=me, n=n, dev=dev, per_table=per_table, head=head, pieces=pieces, key=key,
                          width=width, full=full, recv_meta=recv_meta, work=work, message_out=message_out,
                          carried=carried)


def finish_request(p: PendingRequest) -> Routes:
    """The second half of :func:`request_rows` (waits for :func:`start_request`'s all-to-all): the checked routes."""
    requests, send, status, message, group, stats = p.requests, p.send, p.status, p.message, p.group, p.stats
    if group is None:
        if status != STATUS_OK:
            raise ValueError(message)
        return _local_routes(requests, send)
    if p.work is not None:
        p.work.wait()
        p.work = None
    me, n, dev, per_table, head, pieces, key, width, full, recv_meta, capacity = (
        p.me, p.n, p.dev, p.per_table, p.head, p.pieces, p.key, p.width, p.full, p.recv_meta, p.capacity)
    needs = recv_meta[:, 5].tolist()
    bad = next((r for r, w in enumerate(needs) if not _META_HEAD <= w <= _MAX_WIDTH), None)
    if bad is not None:
        raise ValueError(f"sparsecomm sharded lookup: rank {bad} announced a {needs[bad]}-column request, outside "
                         f"[{_META_HEAD}, {_MAX_WIDTH}]: a bug or a version mismatch between ranks; nothing was "
                         f"exchanged")
    if max(needs) > width:
        width = max(needs)
        full = torch.nn.functional.pad(full, (0, width - full.shape[1]))
        (recv_meta,) = all_to_all_rows([full], [1] * n, [1] * n, group, dev, stats)
    _MESSAGE_WIDTH[key] = max(needs)
    recv_meta = recv_meta.cpu()
    heads = recv_meta[:, :_META_HEAD].tolist()
    for r, h in enumerate(heads):
        if h[4] != len(requests):
            if status != STATUS_OK:
                raise ValueError(message)
            raise ValueError(f"sparsecomm sharded lookup: rank {me} looks up {len(requests)} tables in this round "
                             f"but rank {r} looks up {h[4]}: ranks must call the same tables in the same order; "
                             f"nothing was exchanged")
    blocks = recv_meta[:, _META_HEAD:head].reshape(n, len(requests), per_table)
    fp_end = 2 + FINGERPRINT_LEN
    pool_at = fp_end + n
    rows = [_Meta(h[0], h[1], h[2], h[3], h[4],
                  tuple(tuple([b[0]] + b[2:fp_end]) for b in tb),
                  tuple(b[1] for b in tb),
                  tuple((b[pool_at], b[pool_at + 1], b[-2], b[-1]) for b in tb))
            for h, tb in zip(heads, blocks.tolist())]
    all_counts = blocks[:, :, fp_end:pool_at].permute(1, 0, 2)                     # [table, rank, owner]
    occurrences = blocks[:, :, pool_at + 2:pool_at + 2 + n].permute(1, 0, 2)
    bags = blocks[:, :, pool_at + 2 + n:pool_at + 2 + 2 * n].permute(1, 0, 2)
    if status != STATUS_OK:
        raise ValueError(message)  # a rank with a bad input of its own hears about its own
    problem = _meta_problem(rows, all_counts, occurrences, bags, me, requests)
    if problem is not None:
        raise ValueError(f"sparsecomm sharded lookup: {problem}; nothing was exchanged")
    # Only now (the counts passed the checks) is anything sized from a peer's numbers.
    paths = [[m.pooled[t][0] for m in rows] for t in range(len(requests))]            # [table][rank]
    weight_bytes = [[m.pooled[t][1] for m in rows] for t in range(len(requests))]
    words = torch.zeros_like(all_counts)                                              # [table, rank, owner]
    for t in range(len(requests)):
        for r in range(n):
            words[t, r] = all_counts[t, r]
            if paths[t][r]:
                words[t, r] += torch.tensor([pooled_words(int(o), int(b), weight_bytes[t][r])
                                             for o, b in zip(occurrences[t, r].tolist(), bags[t, r].tolist())])
    recv = [all_counts[t, :, me].tolist() for t in range(len(requests))]
    present = [any(m.tables[t][0] for m in rows) for t in range(len(requests))]
    per_pair = words.sum(0)                                                           # [rank, owner], all tables
    largest = int(per_pair.max()) if per_pair.numel() else 0
    recv_words = [words[t, :, me].tolist() for t in range(len(requests))]
    send_words = [words[t, me, :].tolist() for t in range(len(requests))]
    pooled_any = any(r.pooled is not None for r in requests) or any(any(p) for p in paths)
    if capacity and largest <= capacity:
        got = torch.cat([recv_meta[r, head:head + c] for r, c in enumerate(_by_peer(recv_words, n))])
    elif pooled_any:
        flat = torch.cat([pieces[t][j] for j in range(n) for t in range(len(requests))])
        (got,) = all_to_all_rows([flat], _by_peer(send_words, n), _by_peer(recv_words, n), group, dev, stats)
    else:
        wire = wire_index_dtype(max(r.num_rows for r in requests))
        flat = torch.cat([pieces[t][j].to(wire) for j in range(n) for t in range(len(requests))])
        (got,) = all_to_all_rows([flat], _by_peer(send, n), _by_peer(recv, n), group, dev, stats)
    got = got.to(device=requests[0].ids_by_owner.device, dtype=torch.int64)
    per_source = _split_by_peer(got, recv_words)          # [table][source rank]: ids, then pooled extras
    requested, pooled_parts, problem = [], [], None
    for t, r in enumerate(requests):
        ids_t, parts_t = [], []
        for src in range(n):
            piece, count = per_source[t][src], recv[t][src]
            ids_t.append(piece[:count])
            part = None
            if paths[t][src]:
                occ, bg = int(occurrences[t, src, me]), int(bags[t, src, me])
                extra = piece[count:]
                wp, wl = words_for(occ, 4), words_for(bg, 4)
                part = PooledPart(_unpack(extra[:wp], torch.int32, occ).to(torch.int64),
                                  _unpack(extra[wp:wp + wl], torch.int32, bg).to(torch.int64),
                                  _unpack(extra[wp + wl:], r.weight_dtype, occ) if weight_bytes[t][src] else None)
                problem = problem or _pooled_problem(part, count, src, me)
            parts_t.append(part)
        requested.append(torch.cat(ids_t))
        pooled_parts.append(parts_t)
    for r, ids, counts in zip(requests, requested, recv):
        problem = problem or _ids_problem(ids, counts, me, r.num_rows, r.owns)
    rows_send = [[int(bags[t, me, j]) if paths[t][me] else send[t][j] for j in range(n)]
                 for t in range(len(requests))]
    rows_recv = [[int(bags[t, r, me]) if paths[t][r] else recv[t][r] for r in range(n)]
                 for t in range(len(requests))]
    estimates = [[(m.pooled[t][2], m.pooled[t][3]) for m in rows] for t in range(len(requests))]
    return Routes(send, recv, requested, present, problem, largest, rows_send, rows_recv, pooled_parts, estimates)


def _local_routes(requests: Sequence[TableRequest], send: List[List[int]]) -> Routes:
    """A world of one: this rank asks itself (the same routes, no exchange)."""
    parts, rows = [], []
    for r, c in zip(requests, send):
        if r.pooled is None:
            parts.append([None])
            rows.append(c)
            continue
        pr = r.pooled
        occ, bg = int(pr.occurrences[0]), int(pr.bags[0])
        wp, wl = words_for(occ, 4), words_for(bg, 4)
        w = pr.words[0]
        parts.append([PooledPart(_unpack(w[:wp], torch.int32, occ).to(torch.int64),
                                 _unpack(w[wp:wp + wl], torch.int32, bg).to(torch.int64),
                                 _unpack(w[wp + wl:], r.weight_dtype, occ) if pr.weight_bytes else None)])
        rows.append([bg])
    return Routes(send, send, [r.ids_by_owner.to(torch.int64) for r in requests], [r.present for r in requests],
                  None, 0, rows, rows, parts, [[tuple(r.estimates)] for r in requests])


def _exchange_blocks(blocks: List[torch.Tensor], send: Sequence[Sequence[int]], recv: Sequence[Sequence[int]],
                     group: dist.ProcessGroup, stats: Optional[SparseSyncStats]) -> List[torch.Tensor]:
    """One all-to-all of several row blocks (widths and dtypes may differ); validated counts only."""
    me, n = world(group)
    home = blocks[0].device
    dev = comm_device(group, home)
    widths = [wire_row_bytes(b) for b in blocks]
    count_bytes(stats, [sum(s[j] * w for s, w in zip(send, widths)) for j in range(n)],
                [sum(r[j] * w for r, w in zip(recv, widths)) for j in range(n)], me, None)
    out = exchange_direct([[b.contiguous()] for b in blocks], send, recv, group, dev)
    return [o[0].to(home) for o in out]


def pull_rows(served: Sequence[torch.Tensor], routes: Routes, group: Optional[dist.ProcessGroup],
              stats: Optional[SparseSyncStats] = None) -> List[torch.Tensor]:
    """Owners send the rows they were asked for back to the requesters, every table in one all-to-all.

    Args:
        served: per table, ``(sum(routes.rows_recv[t]), d_t)`` rows this rank
            serves (rows, or partial pooled bags), grouped by requester (zeros
            when ``routes.problem``: never used).
        routes: from :func:`request_rows`.
        group: from :func:`sharded_group`; None: no peers.
        stats: counters to add the bytes moved to.

    Returns:
        Per table, ``(sum(routes.rows_send[t]), d_t)`` rows, grouped by owner.

    Raises:
        ValueError: on every rank when any owner refused the ids it was sent
            (the refusing owner's message names the sender and the id).

    In front of each peer's rows travels one int64: 1 when this owner refuses
    (the verdict costs no extra collective).
    """
    if group is None:
        return list(served)
    me, n = world(group)
    verdict = torch.full((n, 1), int(routes.problem is not None), dtype=torch.int64, device=served[0].device)
    ones = [1] * n
    got = _exchange_blocks([verdict, *served], [ones, *routes.rows_recv], [ones, *routes.rows_send], group, stats)
    if routes.problem is not None:
        raise ValueError(f"sparsecomm sharded lookup: {routes.problem}; no rows were served")
    refused = got[0].view(-1).nonzero().view(-1).tolist()
    if refused:
        raise ValueError(f"sparsecomm sharded lookup: rank {refused[0]} refused the ids it was sent (outside the "
                         f"table or owned by another rank); no rows were served")
    return got[1:]


def exchange_rows(rows: Sequence[torch.Tensor], routes: Routes, group: Optional[dist.ProcessGroup],
                  stats: Optional[SparseSyncStats] = None) -> List[torch.Tensor]:
    """Push rows back along a round's routes (requester -> owner), every table in one all-to-all.

    ``rows[t]`` holds ``routes.rows_send[t][j]`` consecutive rows for owner j;
    returns per table what arrives, by source rank. Both count lists come
    from the round's :func:`request_rows`, so they were validated before
    anything was sized from them.
    """
    if group is None:
        return list(rows)
    return _exchange_blocks(list(rows), routes.rows_send, routes.rows_recv, group, stats)


def allgather_table_rows(ids: torch.Tensor, values: torch.Tensor, num_rows: int,
                         group: Optional[dist.ProcessGroup], complete: bool = True
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Give every rank every rank's ``(ids, rows)``: assembles a full table from its shards.

    Args:
        complete: the ranks' ids together must be every id of ``[0, num_rows)``
            exactly once (a whole table); False: any ids of ``[0, num_rows)``
            (the caller checks which).

    Raises:
        ValueError: on every rank (all receive the same counts and ids), when
            a rank announces more rows than the table has, an id falls outside
            ``[0, num_rows)``, or (``complete``) the shards do not hold every
            id of ``[0, num_rows)`` exactly once.
    """
    if group is None:
        return ids, values
    dev = comm_device(group, values.device)
    out_ids, out_values = allgather_rows(ids, values.contiguous(), group, wire_ids=wire_index_dtype(num_rows),
                                         device=dev, max_rows=num_rows)
    out_ids = out_ids.to(torch.int64)
    # Checked before the ids index anything: a negative id would silently wrap around.
    outside = bool(out_ids.numel()) and (int(out_ids.min()) < 0 or int(out_ids.max()) >= num_rows)
    if not complete:
        if outside:
            raise ValueError(f"sparsecomm sharded table: a rank shared ids outside [0, {num_rows}): a bug or a "
                             f"version mismatch between ranks")
        return out_ids, out_values
    if out_ids.numel() != num_rows or outside or not bool((torch.bincount(out_ids, minlength=num_rows) == 1).all()):
        raise ValueError(f"sparsecomm sharded table: the ranks' shards do not hold every id of [0, {num_rows}) "
                         f"exactly once: a bug or a version mismatch between ranks")
    return out_ids, out_values


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` with no peers)."""
    if group is None:
        return [obj]
    out: List[Any] = [None] * world(group)[1]
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    """Wait for every rank of ``group`` (no-op with no peers)."""
    if group is not None:
        dist.barrier(group=group)


def agree(error: Optional[str], group: Optional[dist.ProcessGroup], what: str) -> None:
    """Raise ``ValueError`` on every rank if any rank reports an error; else return on all.

    A rank that fails a local check alone would leave its peers waiting in the
    next collective; this turns one rank's failure into everyone's, with the
    first failing rank's message.
    """
    errors = all_gather_objects(error, group)
    for r, e in enumerate(errors):
        if e:
            prefix = "" if len(errors) == 1 else f"rank {r}: "
            raise ValueError(f"{what}: {prefix}{e}")


def broadcast_int(value: int, group: Optional[dist.ProcessGroup]) -> int:
    """Rank 0's ``value`` on every rank."""
    return int(all_gather_objects(int(value), group)[0])
