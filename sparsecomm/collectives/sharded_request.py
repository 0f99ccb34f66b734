"""The request of a sharded lookup round: metadata and ids to the owners, checked on every rank.

:func:`request_rows` (or :func:`start_request`, then :func:`finish_request`,
to overlap the first all-to-all with other work) is step 1 of a round
(:mod:`sparsecomm.collectives.sharded_exchange`): every rank sends every peer
its metadata row (:mod:`sparsecomm.collectives.sharded_wire`) with the ids
for that peer padded behind it, every rank decodes and validates every
rank's row, the ids that did not fit take a second all-to-all, and the
owners check the ids they received. The result is the round's
:class:`Routes`, which the pull and the gradient push then follow.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.exchange import (all_to_all, all_to_all_rows, count_bytes, exchange_direct,
                                            wire_index_dtype, wire_row_bytes)
from sparsecomm.collectives.groups import comm_device
from sparsecomm.collectives.objects import world
from sparsecomm.collectives.sharded_wire import (META_HEAD, Announced, InputStatus, MetaHeader, PooledPart, TableMeta,
                                                 check_widths, copy_words, decode_headers, decode_pooled, decode_tables,
                                                 encode_message, encode_row, ids_problem, padded_words,
                                                 pooled_problem, pooled_words, row_width, table_count_mismatch,
                                                 validate, widen)
from sparsecomm.types import SparseSyncStats

__all__ = ["TableRequest", "PooledRequest", "Routes", "Carry", "PendingRequest", "request_rows", "start_request",
           "finish_request", "exchange_blocks", "next_capacity"]

# Per group, the columns the first all-to-all of the next round sends, from the last round (so the same on every
# rank): the larger of the width any rank needed then and, once that round passed its checks, its row (that
# need less its capacity) plus the capacity it gives the next round (next_capacity). Rounds of one table set
# in a row then cost one all-to-all each, also when the capacity grows; another set may need a second.
_MESSAGE_WIDTH: Dict[Any, Tuple[int, int]] = {}
# Beyond this many ids per owner, a second all-to-all costs less than the padding could.
_MAX_CAPACITY = 1 << 16


def next_capacity(largest: int) -> int:
    """The ids per owner the next round of a table set pads behind its rows: the last round's largest count
    (every rank's, so the same on every rank) + 1/8 + 8, at most :data:`_MAX_CAPACITY`."""
    return min(_MAX_CAPACITY, largest + largest // 8 + 8)


class PooledRequest(NamedTuple):
    """What a pooled lookup of one bag table sends each owner besides its unique ids.

    Attributes:
        occurrences: ``(N,)`` int64, id occurrences sent to each owner (ids of
            the bags that owner holds, with repeats).
        bags: ``(N,)`` int64, bags with at least one id at each owner.
        words: per owner, the extras as :func:`~sparsecomm.collectives.sharded_wire.encode_pooled`
            packs them (positions, bag lengths, weights).
        weight_bytes: bytes of one per-sample weight, 0 without weights.
    """

    occurrences: torch.Tensor
    bags: torch.Tensor
    words: List[torch.Tensor]
    weight_bytes: int = 0


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
        owned_range: ``(start, stop)`` when the ids this rank owns are that one range
            (a cheaper check of what peers ask), else None.
        pooled: what a pooled lookup sends besides the ids, or None (rows path).
        weight_dtype: the dtype of the table's per-sample weights.
        estimates: this rank's cost of the rows and the pooled path (non-negative ints).
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
    estimates: Tuple[int, int] = (0, 0)
    owned_range: Optional[Tuple[int, int]] = None

    def meta(self, counts: List[int]) -> TableMeta:
        """This table's block of the metadata row (``counts``: :attr:`counts` as ints)."""
        pr = self.pooled
        if pr is None:
            return TableMeta(int(self.present), self.num_local, tuple(self.fingerprint), tuple(counts),
                             estimates=tuple(self.estimates))
        return TableMeta(int(self.present), self.num_local, tuple(self.fingerprint), tuple(counts), 1,
                         pr.weight_bytes, tuple(pr.occurrences.tolist()), tuple(pr.bags.tolist()),
                         tuple(self.estimates))


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


def request_rows(requests: Sequence[TableRequest], status: InputStatus, *, round: int,
                 group: Optional[dist.ProcessGroup], stats: Optional[SparseSyncStats] = None,
                 capacity: int = 0) -> Routes:
    """Send each owner the ids this rank needs from it, for every table of a lookup round at once.

    Args:
        requests: one per table of the round, in the same order on every rank.
        status: this rank's verdict on its input; anything but OK makes every
            rank raise before rows move (this rank with its own message).
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
    (``6 + T * (3N + 12)`` int64 per peer for T tables on N ranks, laid out in
    :mod:`~sparsecomm.collectives.sharded_wire`: every rank learns every
    rank's counts, which is what lets all of them agree on a bad one without
    another collective) with every peer's ids padded to ``capacity`` behind
    it; when some rank has more ids for some owner than that (every rank sees
    it in the counts), every table's ids travel again in a second all-to-all,
    peer-major, in the widest table's wire dtype. Padded ids are read only
    after the counts that say how many there are passed the checks.
    """
    return finish_request(start_request(requests, status, round=round, group=group, stats=stats,
                                        capacity=capacity))


@dataclass
class PendingRequest:
    """A :func:`start_request` whose first all-to-all may still be in flight; :func:`finish_request` ends it."""

    requests: Sequence[TableRequest]
    send: List[List[int]]                    # per table, ids this rank asks of each owner
    status: InputStatus
    group: Optional[dist.ProcessGroup]
    stats: Optional[SparseSyncStats]
    capacity: int
    # Per table, by source rank: the carried rows that arrived (a deferred push), or None.
    carried: Optional[List[torch.Tensor]] = None
    # With peers only:
    me: int = 0
    n: int = 1
    device: Optional[torch.device] = None
    # Every owner's int64 words (per table: ids, then pooled extras), owner 0's first; how many each owner's.
    words: Optional[torch.Tensor] = None
    lengths: List[int] = field(default_factory=list)
    message: Optional[torch.Tensor] = None              # (n, columns) int64: what this rank sends each peer
    width: int = META_HEAD                              # columns the first all-to-all sent
    received: Optional[torch.Tensor] = None             # (n, width): every peer's row for this rank
    work: Optional[Any] = None                          # the async all-to-all, until finish_request waits
    message_out: Optional[torch.Tensor] = None          # the async all-to-all's send buffer, kept alive


def start_request(requests: Sequence[TableRequest], status: InputStatus, *, round: int,
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
    p = PendingRequest(requests, send, status, group, stats, capacity)
    if group is None:
        p.carried = list(carry.rows) if carry is not None else None
        return p
    p.me, p.n = world(group)
    p.device = comm_device(group, requests[0].ids_by_owner.device)
    n = p.n
    head = MetaHeader(int(status.code), status.detail, round, capacity, len(requests),
                      row_width(len(requests), n) + capacity)
    row = encode_row(head, [r.meta(counts) for r, counts in zip(requests, send)])
    # Per owner, per table: the unique ids (int64), then a pooled lookup's extras (int64 words); one tensor.
    ids = [torch.split(r.ids_by_owner.to(torch.int64), c) for r, c in zip(requests, send)]
    parts: List[torch.Tensor] = []
    for j in range(n):
        count = 0
        for t, r in enumerate(requests):
            parts.append(ids[t][j])
            count += send[t][j]
            extras = r.pooled.words[j] if r.pooled is not None else None
            if extras is not None and extras.numel():
                parts.append(extras.to(ids[t][j].device))
                count += int(extras.numel())
        p.lengths.append(count)
    p.words = torch.cat(parts)
    p.width = max(_MESSAGE_WIDTH.get(id(group), (META_HEAD, 0)))
    p.message = encode_message(row, p.words, p.lengths, n, p.width)
    _send_meta(p, async_op, carry)
    return p


def _send_meta(p: PendingRequest, async_op: bool, carry: Optional[Carry]) -> None:
    """Start the first all-to-all: ``p.width`` columns of the message to every peer (with carried rows behind).

    Every rank sends ``width`` columns (known to all): its whole row when it
    fits, else only its header, which says how many columns it needs; then
    every rank resends at the largest need (:func:`_received_rows`).
    """
    n, width = p.n, p.width
    if async_op:
        p.message_out = p.message[:, :width].contiguous().to(p.device)   # kept until the wait
        p.received = torch.empty_like(p.message_out)
        count_bytes(p.stats, [width * 8] * n, [width * 8] * n, p.me, None)
        p.work = all_to_all(p.received, p.message_out, group=p.group, async_op=True)
    elif carry is not None:
        ones = [1] * n
        p.received, *got = exchange_blocks([p.message[:, :width], *carry.rows], [ones, *carry.send],
                                            [ones, *carry.recv], p.group, p.stats)
        p.carried = [g.to(r.device) for g, r in zip(got, carry.rows)]
    else:
        (p.received,) = all_to_all_rows([p.message[:, :width]], [1] * n, [1] * n, p.group, p.device, p.stats)


class _Sizes(NamedTuple):
    """What the checked rows say every rank sends (per table unless noted)."""

    paths: List[List[int]]          # [table][rank]: 1 pooled, 0 rows
    weight_bytes: List[List[int]]   # [table][rank]
    recv: List[List[int]]           # ids each rank asks of me
    recv_words: List[List[int]]     # int64 words each rank sends me (ids, pooled extras)
    send_words: List[List[int]]     # int64 words I send each owner
    largest: int                    # the most words any rank sends any owner, all tables together
    pooled_any: bool                # some rank looks some table up pooled


def finish_request(p: PendingRequest) -> Routes:
    """The second half of :func:`request_rows` (waits for :func:`start_request`'s all-to-all): the checked routes.

    Decode every rank's row, validate it (raising on every rank alike), move
    the ids that did not fit behind the rows, and split what arrived into
    per-table routes.
    """
    if p.group is None:
        if not p.status.ok:
            raise ValueError(p.status.message)
        return _local_routes(p.requests, p.send)
    received, headers = _received_rows(p)
    announced = _checked(p, received, headers)
    # Only now (the counts passed the checks) is anything sized from a peer's numbers.
    sizes = _sizes(p, announced)
    need = _MESSAGE_WIDTH[id(p.group)][0]
    _MESSAGE_WIDTH[id(p.group)] = (need, need - p.capacity + next_capacity(sizes.largest))
    got = _exchange_ids(p, received, sizes)
    return _split(p, announced, sizes, got)


def _received_rows(p: PendingRequest) -> Tuple[torch.Tensor, List[MetaHeader]]:
    """Wait for the first all-to-all; resend at the largest width when some row did not fit. On the CPU."""
    if p.work is not None:
        p.work.wait()
        p.work = None
    received = p.received
    need = check_widths(decode_headers(received))
    if need > p.width:
        p.width = need
        p.message = widen(p.message, need)
        (received,) = all_to_all_rows([p.message], [1] * p.n, [1] * p.n, p.group, p.device, p.stats)
    _MESSAGE_WIDTH[id(p.group)] = (need, 0)   # the next round's capacity is known once this one passed
    received = received.cpu()
    return received, decode_headers(received)


def _checked(p: PendingRequest, received: torch.Tensor, headers: List[MetaHeader]) -> Announced:
    """Every rank's decoded row, once it passed the checks (a rank with a bad input hears about its own)."""
    count = len(p.requests)
    bad = table_count_mismatch(headers, count)
    if bad is not None:
        if not p.status.ok:
            raise ValueError(p.status.message)
        raise ValueError(f"sparsecomm sharded lookup: rank {p.me} looks up {count} tables in this round "
                         f"but rank {bad} looks up {headers[bad].num_tables}: ranks must call the same tables in "
                         f"the same order; nothing was exchanged")
    announced = decode_tables(received, headers, count)
    if not p.status.ok:
        raise ValueError(p.status.message)
    itemsizes = [r.weight_dtype.itemsize for r in p.requests]
    problem = validate(announced, p.me, [r.num_rows for r in p.requests], itemsizes)
    if problem is not None:
        raise ValueError(f"sparsecomm sharded lookup: {problem}; nothing was exchanged")
    return announced


def _sizes(p: PendingRequest, a: Announced) -> _Sizes:
    """The words every rank sends every owner, from the checked counts (plain ints: a few per rank)."""
    me, n, count = p.me, p.n, len(p.requests)
    paths = [[tables[t].path for tables in a.tables] for t in range(count)]
    weight_bytes = [[tables[t].weight_bytes for tables in a.tables] for t in range(count)]
    words = [[[c + (pooled_words(o, b, m.weight_bytes) if m.path else 0)        # [table][rank][owner]
               for c, o, b in zip(m.counts, m.occurrences, m.bags)]
              for m in (tables[t] for tables in a.tables)] for t in range(count)]
    largest = max(sum(words[t][r][j] for t in range(count)) for r in range(n) for j in range(n))
    pooled_any = any(r.pooled is not None for r in p.requests) or any(any(x) for x in paths)
    return _Sizes(paths, weight_bytes, [[a.tables[r][t].counts[me] for r in range(n)] for t in range(count)],
                  [[words[t][r][me] for r in range(n)] for t in range(count)], [words[t][me] for t in range(count)],
                  largest, pooled_any)


def _exchange_ids(p: PendingRequest, received: torch.Tensor, s: _Sizes) -> torch.Tensor:
    """Every peer's words for this owner: read behind the rows when they fit, else a second all-to-all."""
    n, requests = p.n, p.requests
    if p.capacity and s.largest <= p.capacity:
        got = padded_words(received, len(requests), _by_peer(s.recv_words, n))
    elif s.pooled_any:
        (got,) = all_to_all_rows([p.words], _by_peer(s.send_words, n), _by_peer(s.recv_words, n), p.group, p.device,
                                 p.stats)
    else:   # ids only (nobody pooled): in the narrowest dtype that holds them
        wire = wire_index_dtype(max(r.num_rows for r in requests))
        (got,) = all_to_all_rows([p.words.to(wire)], _by_peer(p.send, n), _by_peer(s.recv, n), p.group, p.device,
                                 p.stats)
    return got.to(device=requests[0].ids_by_owner.device, dtype=torch.int64)


def _split(p: PendingRequest, a: Announced, s: _Sizes, got: torch.Tensor) -> Routes:
    """Per table: the ids each peer asked of me, its pooled extras (checked), and the rows both ways."""
    me, n, count = p.me, p.n, len(p.requests)
    starts = [[0] * n for _ in range(count)]   # [table][source rank]: where its words start in ``got``
    at = 0
    for src in range(n):
        for t in range(count):
            starts[t][src] = at
            at += s.recv_words[t][src]
    requested, pooled_parts, problem = [], [], None
    for t, r in enumerate(p.requests):
        ids_t = got.new_empty(sum(s.recv[t]))   # every source's ids for table t, in source order: one copy
        copy_words(ids_t, got, [(to, at, ids) for to, at, ids in
                                zip(itertools.accumulate(s.recv[t], initial=0), starts[t], s.recv[t])])
        parts_t = []
        for src in range(n):
            part = None
            if s.paths[t][src]:
                m, lo, ids = a.tables[src][t], starts[t][src], s.recv[t][src]
                part = decode_pooled(got[lo + ids:lo + s.recv_words[t][src]], m.occurrences[me], m.bags[me],
                                     r.weight_dtype if s.weight_bytes[t][src] else None)
                problem = problem or pooled_problem(part, ids, src, me)
            parts_t.append(part)
        requested.append(ids_t)
        pooled_parts.append(parts_t)
    for r, ids, counts in zip(p.requests, requested, s.recv):
        problem = problem or ids_problem(ids, counts, me, r.num_rows, r.owns, r.owned_range)
    rows_send = [list(a.tables[me][t].bags if s.paths[t][me] else p.send[t]) for t in range(count)]
    rows_recv = [[a.tables[r][t].bags[me] if s.paths[t][r] else s.recv[t][r] for r in range(n)]
                 for t in range(count)]
    present = [any(tables[t].present for tables in a.tables) for t in range(count)]
    estimates = [[tables[t].estimates for tables in a.tables] for t in range(count)]
    return Routes(p.send, s.recv, requested, present, problem, s.largest, rows_send, rows_recv, pooled_parts,
                  estimates)


def _by_peer(per_table: Sequence[Sequence[int]], n: int) -> List[int]:
    return [sum(c[j] for c in per_table) for j in range(n)]


def _local_routes(requests: Sequence[TableRequest], send: List[List[int]]) -> Routes:
    """A world of one: this rank asks itself (the same routes, no exchange)."""
    parts, rows = [], []
    for r, c in zip(requests, send):
        if r.pooled is None:
            parts.append([None])
            rows.append(c)
            continue
        pr = r.pooled
        bags = int(pr.bags[0])
        parts.append([decode_pooled(pr.words[0], int(pr.occurrences[0]), bags,
                                    r.weight_dtype if pr.weight_bytes else None)])
        rows.append([bags])
    return Routes(send, send, [r.ids_by_owner.to(torch.int64) for r in requests], [r.present for r in requests],
                  None, 0, rows, rows, parts, [[tuple(r.estimates)] for r in requests])


def exchange_blocks(blocks: List[torch.Tensor], send: Sequence[Sequence[int]], recv: Sequence[Sequence[int]],
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
