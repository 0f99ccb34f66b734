"""Exchanges of the sharded (parameter-server) embedding: request rows, return rows, push gradients.

One lookup on N ranks (docs/DESIGN.md, "Sharded mode"):

1. :func:`request_rows`: every rank sends each owner the ids it needs from it.
   A small all-to-all of metadata goes first: each rank sends every peer the
   same row (input-status code, its number of owned rows, the table's
   fingerprint and its whole vector of row counts), so every rank holds every
   rank's row and validates the same numbers. A bad id, a mismatched call or
   an impossible count on any rank raises ``ValueError`` on *every* rank
   before any id moves or any buffer is sized from a peer's count, instead of
   one rank raising while the others wait in the next collective. The owners
   then check the ids they receive (inside the table and owned by them).
2. :func:`pull_rows` (owner -> requester): owners send the rows back, in the
   order they were asked for, each peer's rows behind a one-row header that
   says whether this owner accepted the ids it was sent. An owner that
   refused sends no table rows and every rank raises ``ValueError``: the
   verdict rides on this all-to-all, so it costs no extra collective.
3. :func:`exchange_rows` (requester -> owner), in backward: the gradient rows
   travel the same routes reversed; the ids need not travel again.

The bytes go through :func:`sparsecomm.collectives.exchange.all_to_all_rows`.
Tables talk over a dedicated twin of the caller's group (:func:`sharded_group`)
so their synchronous all-to-alls never interleave with DDP's asynchronous
allreduces on the default group, which run during the same backward pass.
A ``group`` of None here means "no peers": everything stays local.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.exchange import all_to_all_rows, allgather_rows, wire_index_dtype
from sparsecomm.collectives.groups import comm_device, twin_group
from sparsecomm.types import SparseSyncStats

__all__ = [
    "STATUS_OK", "STATUS_ID_RANGE", "STATUS_BAD_INPUT",
    "world", "sharded_group", "request_rows", "pull_rows", "exchange_rows", "allgather_table_rows",
    "all_gather_objects", "barrier", "agree", "broadcast_int",
]

# Input status a rank reports with its row counts (column 0 of the metadata).
STATUS_OK, STATUS_ID_RANGE, STATUS_BAD_INPUT = 0, 1, 2
# A metadata row: status, detail, owned rows, then the fingerprint, then one count per rank.
_META_HEAD = 3


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
    num_local: int                 # rows the rank says it owns
    fingerprint: Tuple[int, ...]


def _describe_status(rank: int, status: int, detail: int, num_rows: int) -> str:
    if status == STATUS_ID_RANGE:
        return f"rank {rank} looked up id {detail}, outside [0, {num_rows})"
    return f"rank {rank} passed an invalid input"


def _meta_problem(rows: List[_Meta], counts: torch.Tensor, me: int, fp: Tuple[int, ...], num_rows: int
                  ) -> Optional[str]:
    """The first problem in every rank's metadata, or None; the same answer on every rank but ``me``'s wording.

    ``counts[r, j]``: the ids rank r says it asks of rank j. Every rank holds
    the same rows, so every rank reaches the same verdict: all raise, or none
    does. Counts are checked before anything is sized from them: a peer never
    asks an owner for more ids than the owner has rows (the ids it sends are unique).
    """
    for r, m in enumerate(rows):
        if m.status != STATUS_OK:
            return _describe_status(r, m.status, m.detail, num_rows)
    for r, m in enumerate(rows):
        if m.fingerprint != fp:
            return (f"rank {me} is looking up table {fp} (num_embeddings, embedding_dim, table id, kind) but "
                    f"rank {r} is looking up {m.fingerprint}: ranks must call the same tables in the same order")
    owned = [m.num_local for m in rows]
    for r, c in enumerate(owned):
        if not 0 <= c <= num_rows:
            return f"rank {r} announced {c} owned rows, outside [0, {num_rows}]: a bug or a version mismatch"
    if sum(owned) != num_rows:
        return (f"the ranks announce {owned} owned rows, which do not add up to the table's {num_rows}: "
                f"a bug or a version mismatch between ranks")
    bad = (counts < 0) | (counts > torch.tensor(owned).view(1, -1))
    if bool(bad.any()):
        r, j = (int(x) for x in bad.nonzero()[0])
        return (f"rank {r} announced {int(counts[r, j])} ids to look up on rank {j}, outside [0, {owned[j]}] "
                f"(rank {j}'s rows): a bug or a version mismatch between ranks")
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


def request_rows(ids_by_owner: torch.Tensor, counts: torch.Tensor, *, status: int, detail: int,
                 message: str, fingerprint: Sequence[int], num_rows: int, num_local: int,
                 group: Optional[dist.ProcessGroup], owns: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 stats: Optional[SparseSyncStats] = None
                 ) -> Tuple[List[int], List[int], torch.Tensor, Optional[str]]:
    """Send each owner the ids this rank needs from it; receive the ids others need from me.

    Args:
        ids_by_owner: ``(n,)`` unique ids grouped by owner (owner 0's first),
            as :func:`sparsecomm.ops.partition_rows` returns them.
        counts: ``(N,)`` int64, ids per owner.
        status: this rank's input status (``STATUS_*``); anything but OK makes
            every rank raise before rows move.
        detail: an int for the message (the offending id for ``STATUS_ID_RANGE``).
        message: this rank's own description of its bad input (used on this rank).
        fingerprint: ints that must be equal on every rank (table shape and
            identity): a mismatch means the ranks are in different calls.
        num_rows: table size (bounds the ids; sizes them on the wire).
        num_local: rows this rank owns (bounds what a peer may ask of it).
        group: from :func:`sharded_group`; None: no peers.
        owns: ``owns(ids) -> bool tensor``, whether this rank owns each id;
            the received ids are checked with it (and against ``num_rows``).
        stats: counters to add the bytes moved to.

    Returns:
        ``(send_counts, recv_counts, requested_ids, problem)``: ids sent to /
        received from each rank, the received ids (int64, grouped by source
        rank), and None, or why this owner refuses those ids: then pass it to
        :func:`pull_rows`, which makes every rank raise.

    Raises:
        ValueError: on every rank, naming the first rank whose input was bad,
            whose call does not match this one, or whose counts are impossible
            (negative, more than the owner's rows, or not adding up). Nothing
            else was exchanged and nothing was sized from a peer's numbers.

    The metadata is ``N * (N + 7)`` int64 per rank: every rank learns every
    rank's counts, which is what lets all of them agree on a bad one without
    another collective.
    """
    send_counts = [int(c) for c in counts.tolist()]
    fp = tuple(int(x) for x in fingerprint)
    if group is None:
        if status != STATUS_OK:
            raise ValueError(message)
        return send_counts, send_counts, ids_by_owner.to(torch.int64), None
    me, n = world(group)
    dev = comm_device(group, ids_by_owner.device)
    row = [status, detail, num_local, *fp, *send_counts]
    meta = torch.tensor([row] * n, dtype=torch.int64)
    (recv_meta,) = all_to_all_rows([meta], [1] * n, [1] * n, group, dev, stats)
    k = _META_HEAD + len(fp)
    rows = [_Meta(r[0], r[1], r[2], tuple(r[_META_HEAD:])) for r in recv_meta[:, :k].tolist()]
    all_counts = recv_meta[:, k:].cpu()
    if status != STATUS_OK:
        raise ValueError(message)  # a rank with a bad input of its own hears about its own
    problem = _meta_problem(rows, all_counts, me, fp, num_rows)
    if problem is not None:
        raise ValueError(f"sparsecomm sharded lookup: {problem}; nothing was exchanged")
    recv_counts = all_counts[:, me].tolist()
    wire = wire_index_dtype(num_rows)
    (requested,) = all_to_all_rows([ids_by_owner.to(wire)], send_counts, recv_counts, group, dev, stats)
    requested = requested.to(device=ids_by_owner.device, dtype=torch.int64)
    return send_counts, recv_counts, requested, _ids_problem(requested, recv_counts, me, num_rows, owns)


def pull_rows(served: torch.Tensor, send_counts: List[int], recv_counts: List[int], problem: Optional[str],
              group: Optional[dist.ProcessGroup], stats: Optional[SparseSyncStats] = None) -> torch.Tensor:
    """Owners send the rows they were asked for back to the requesters; return the rows this rank asked for.

    Args:
        served: ``(sum(recv_counts), d)`` rows this rank serves, grouped by
            requester (zeros when ``problem``: they are never used).
        send_counts, recv_counts: from :func:`request_rows` (ids this rank
            asked of each owner / each rank asked of it).
        problem: :func:`request_rows`' verdict on the ids this rank received.
        group: from :func:`sharded_group`; None: no peers.
        stats: counters to add the bytes moved to.

    Returns:
        ``(sum(send_counts), d)`` rows, grouped by owner.

    Raises:
        ValueError: on every rank when any owner refused the ids it was sent
            (the refusing owner's message names the sender and the id).
    """
    if group is None:
        return served
    me, n = world(group)
    dev = comm_device(group, served.device)
    # One header row in front of each peer's rows: 1 in its first column when
    # this owner refuses (exact in every float dtype).
    header = served.new_zeros(1, *served.shape[1:])
    if problem is not None:
        header.view(-1)[0] = 1
    pieces: List[torch.Tensor] = []
    offset = 0
    for c in recv_counts:
        pieces += [header, served[offset:offset + c]]
        offset += c
    send = torch.cat(pieces)
    (got,) = all_to_all_rows([send], [c + 1 for c in recv_counts], [c + 1 for c in send_counts], group, dev, stats)
    got = got.to(served.device)
    starts = torch.tensor([0] + send_counts[:-1], dtype=torch.int64).cumsum(0) + torch.arange(n)
    flags = got.index_select(0, starts.to(got.device)).reshape(n, -1)[:, 0]
    if problem is not None:
        raise ValueError(f"sparsecomm sharded lookup: {problem}; no rows were served")
    refused = (flags != 0).nonzero().view(-1).tolist()
    if refused:
        raise ValueError(f"sparsecomm sharded lookup: rank {refused[0]} refused the ids it was sent (outside the "
                         f"table or owned by another rank); no rows were served")
    keep = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    keep[starts.to(got.device)] = False
    return got[keep]


def exchange_rows(rows: torch.Tensor, send_counts: List[int], recv_counts: List[int],
                  group: Optional[dist.ProcessGroup], stats: Optional[SparseSyncStats] = None) -> torch.Tensor:
    """Send ``send_counts[j]`` consecutive rows of ``rows`` to rank j; return what arrives, by source rank.

    Requesters push gradient rows back along a lookup's routes with it; both
    count lists come from that lookup's :func:`request_rows`, so they were
    validated before anything was sized from them.
    """
    if group is None:
        return rows
    dev = comm_device(group, rows.device)
    (out,) = all_to_all_rows([rows.contiguous()], send_counts, recv_counts, group, dev, stats)
    return out.to(rows.device)


def allgather_table_rows(ids: torch.Tensor, values: torch.Tensor, num_rows: int,
                         group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Give every rank every rank's ``(ids, rows)``: assembles a full table from its shards.

    Raises:
        ValueError: on every rank (all receive the same counts and ids), when
            a rank announces more rows than the table has, or the shards do
            not hold every id of ``[0, num_rows)`` exactly once.
    """
    if group is None:
        return ids, values
    dev = comm_device(group, values.device)
    out_ids, out_values = allgather_rows(ids, values.contiguous(), group, wire_ids=wire_index_dtype(num_rows),
                                         device=dev, max_rows=num_rows)
    out_ids = out_ids.to(torch.int64)
    # Checked before the ids index anything: a negative id would silently wrap around.
    if out_ids.numel() != num_rows or (out_ids.numel() and (int(out_ids.min()) < 0 or int(out_ids.max()) >= num_rows)) \
            or not bool((torch.bincount(out_ids, minlength=num_rows) == 1).all()):
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
