"""Exchanges of the sharded (parameter-server) embedding: request rows, return rows, push gradients.

One lookup on N ranks (shared/DESIGN.md, "Sharded mode"):

1. :func:`request_rows`: every rank sends each owner the ids it needs from it.
   A small all-to-all of metadata goes first (row counts, an input-status
   code and the table's fingerprint), so that a bad id or a mismatched call on
   any rank raises ``ValueError`` on *every* rank before any row moves,
   instead of one rank raising while the others wait in the next collective.
2. :func:`exchange_rows` (owner -> requester): owners send the rows back, in
   the order they were asked for.
3. :func:`exchange_rows` (requester -> owner), in backward: the gradient rows
   travel the same routes reversed; the ids need not travel again.

The bytes go through :func:`sparsecomm.collectives.exchange.all_to_all_rows`.
Tables talk over a dedicated twin of the caller's group (:func:`sharded_group`)
so their synchronous all-to-alls never interleave with DDP's asynchronous
allreduces on the default group, which run during the same backward pass.
A ``group`` of None here means "no peers": everything stays local.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.exchange import all_to_all_rows, allgather_rows, wire_index_dtype
from sparsecomm.collectives.groups import comm_device, group_ranks
from sparsecomm.types import SparseSyncStats

__all__ = [
    "STATUS_OK", "STATUS_ID_RANGE", "STATUS_BAD_INPUT",
    "world", "sharded_group", "request_rows", "exchange_rows", "allgather_table_rows",
    "all_gather_objects", "barrier", "agree", "broadcast_int",
]

# Input status a rank reports with its row counts (column 1 of the metadata).
STATUS_OK, STATUS_ID_RANGE, STATUS_BAD_INPUT = 0, 1, 2
_META_COLS = 7  # count, status, detail, num_rows, dim, table uid, table kind

_groups: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
_lock = threading.Lock()


def world(group: Optional[dist.ProcessGroup] = None) -> Tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def sharded_group(group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
    """Return the dedicated group sharded tables exchange over, or None for a world of one.

    Created once per set of ranks and cached. Collective on first call for a
    set of ranks: every process of the default group must make it, in the same
    order (tables are constructed on every rank, which is where it happens).
    """
    rank, size = world(group)
    if size == 1:
        return None
    ranks = tuple(group_ranks(group))
    with _lock:
        if ranks not in _groups:
            _groups[ranks] = dist.new_group(list(ranks), backend=dist.get_backend(group))
        return _groups[ranks]


class _Meta(NamedTuple):
    count: int
    status: int
    detail: int
    fingerprint: Tuple[int, ...]


def _describe_status(rank: int, status: int, detail: int, num_rows: int) -> str:
    if status == STATUS_ID_RANGE:
        return f"rank {rank} looked up id {detail}, outside [0, {num_rows})"
    return f"rank {rank} passed an invalid input"


def request_rows(ids_by_owner: torch.Tensor, counts: torch.Tensor, *, status: int, detail: int,
                 message: str, fingerprint: Sequence[int], num_rows: int,
                 group: Optional[dist.ProcessGroup], stats: Optional[SparseSyncStats] = None
                 ) -> Tuple[List[int], List[int], torch.Tensor]:
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
        group: from :func:`sharded_group`; None: no peers.
        stats: counters to add the bytes moved to.

    Returns:
        ``(send_counts, recv_counts, requested_ids)``: ids sent to / received
        from each rank, and the received ids (int64, grouped by source rank).

    Raises:
        ValueError: on every rank, naming the first rank whose input was bad
            or whose call does not match this one. Nothing else was exchanged.
    """
    send_counts = counts.tolist()
    fp = tuple(int(x) for x in fingerprint)
    if group is None:
        if status != STATUS_OK:
            raise ValueError(message)
        return send_counts, send_counts, ids_by_owner.to(torch.int64)
    me, n = world(group)
    dev = comm_device(group, ids_by_owner.device)
    meta = torch.tensor([[c, status, detail, *fp] for c in send_counts], dtype=torch.int64)
    (recv_meta,) = all_to_all_rows([meta], [1] * n, [1] * n, group, dev, stats)
    rows = [_Meta(int(r[0]), int(r[1]), int(r[2]), tuple(int(x) for x in r[3:])) for r in recv_meta.tolist()]
    if status != STATUS_OK:
        raise ValueError(message)  # a rank with a bad input of its own hears about its own
    for r, m in enumerate(rows):
        if m.status != STATUS_OK:
            raise ValueError(f"sparsecomm sharded lookup: {_describe_status(r, m.status, m.detail, num_rows)}; "
                             f"nothing was exchanged")
    for r, m in enumerate(rows):
        if m.fingerprint != fp:
            raise ValueError(f"sparsecomm sharded lookup: rank {me} is looking up table {fp} "
                             f"(num_embeddings, embedding_dim, table id, kind) but rank {r} is looking up "
                             f"{m.fingerprint}: ranks must call the same tables in the same order")
    recv_counts = [m.count for m in rows]
    wire = wire_index_dtype(num_rows)
    (requested,) = all_to_all_rows([ids_by_owner.to(wire)], send_counts, recv_counts, group, dev, stats)
    return send_counts, recv_counts, requested.to(device=ids_by_owner.device, dtype=torch.int64)


def exchange_rows(rows: torch.Tensor, send_counts: List[int], recv_counts: List[int],
                  group: Optional[dist.ProcessGroup], stats: Optional[SparseSyncStats] = None) -> torch.Tensor:
    """Send ``send_counts[j]`` consecutive rows of ``rows`` to rank j; return what arrives, by source rank.

    Used both ways: owners returning looked-up rows, and requesters pushing
    gradient rows back along the same routes.
    """
    if group is None:
        return rows
    dev = comm_device(group, rows.device)
    (out,) = all_to_all_rows([rows.contiguous()], send_counts, recv_counts, group, dev, stats)
    return out.to(rows.device)


def allgather_table_rows(ids: torch.Tensor, values: torch.Tensor, num_rows: int,
                         group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Give every rank every rank's ``(ids, rows)``: assembles a full table from its shards."""
    if group is None:
        return ids, values
    dev = comm_device(group, values.device)
    out_ids, out_values = allgather_rows(ids, values.contiguous(), group, wire_ids=wire_index_dtype(num_rows),
                                         device=dev)
    return out_ids.to(torch.int64), out_values


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
