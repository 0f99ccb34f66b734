"""Exchanges of the sharded (parameter-server) embedding: request rows, return rows, push gradients.

One lookup round on N ranks covers any number of tables (docs/DESIGN.md,
"Sharded mode"), always in the same four all-to-alls:

1. :func:`request_rows`: every rank sends each owner the ids it needs from it.
   A small all-to-all of metadata goes first: each rank sends every peer the
   same row (:mod:`sparsecomm.collectives.sharded_wire`: input status, round
   number, and per table whether it looked the table up, its number of owned
   rows, the table's fingerprint and its whole vector of row counts), so
   every rank holds every rank's row and validates the same numbers. A bad
   id, a mismatched call or an impossible count on any rank raises
   ``ValueError`` on *every* rank before any id moves or any buffer is sized
   from a peer's count, instead of one rank raising while the others wait in
   the next collective. Then every table's ids travel in one all-to-all, and
   the owners check the ids they receive (inside the table and owned by them).
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

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.exchange import Gathered, allgather_rows, exchange_tables, kernel_ids, wire_index_dtype
from sparsecomm.collectives.groups import comm_device, twin_group
from sparsecomm.collectives.objects import world
from sparsecomm.collectives.sharded_request import (Carry, PendingRequest, PooledRequest, Routes, TableRequest,
                                                    exchange_blocks, finish_request, next_capacity, request_rows,
                                                    start_request)
from sparsecomm.types import SparseSyncStats

__all__ = [
    "TableRequest", "PooledRequest", "Routes", "Carry", "PendingRequest", "request_rows", "start_request",
    "finish_request", "next_capacity", "sharded_group", "pull_rows", "exchange_rows", "allgather_table_rows",
    "Shard", "allgather_shards",
]


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
    got = exchange_blocks([verdict, *served], [ones, *routes.rows_recv], [ones, *routes.rows_send], group, stats)
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
    return exchange_blocks(list(rows), routes.rows_send, routes.rows_recv, group, stats)


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
    if not complete:
        return _inside(out_ids, num_rows), out_values
    # Checked before the ids index anything: a negative id would silently wrap around.
    outside = bool(out_ids.numel()) and (int(out_ids.min()) < 0 or int(out_ids.max()) >= num_rows)
    if out_ids.numel() != num_rows or outside or not bool((torch.bincount(out_ids, minlength=num_rows) == 1).all()):
        raise ValueError(f"sparsecomm sharded table: the ranks' shards do not hold every id of [0, {num_rows}) "
                         f"exactly once: a bug or a version mismatch between ranks")
    return out_ids, out_values


class Shard(NamedTuple):
    """The rows of one table a rank shares (:func:`allgather_shards`): their ids, the rows, the table's row count."""

    ids: torch.Tensor
    rows: torch.Tensor
    num_rows: int


def allgather_shards(shards: Sequence[Shard], counts: Sequence[Sequence[int]], group: Optional[dist.ProcessGroup]
                     ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`allgather_table_rows` (``complete=False``) of several tables in one all-to-all.

    ``counts[k][r]``: the rows rank ``r`` shares of table ``k``, which every
    rank already holds alike (the caller exchanged them, and checked them
    against the table's rows). Returns per table every rank's ``(ids, rows)``,
    in rank order.

    Raises:
        ValueError: on every rank (all receive the same ids), when an id falls outside its table.
    """
    if group is None or not shards:
        return [(s.ids, s.rows) for s in shards]
    n = world(group)[1]
    blocks = [[Gathered(s.ids, None, wire_index_dtype(s.num_rows)), s.rows.contiguous()] for s in shards]
    got = exchange_tables(blocks, [[s.ids.shape[0]] * n for s in shards], [list(c) for c in counts],
                          [True] * len(shards), group, comm_device(group, shards[0].rows.device))
    return [(_inside(kernel_ids(ids).to(torch.int64), s.num_rows).to(s.ids.device), rows.to(s.rows.device))
            for s, (ids, rows) in zip(shards, got)]


def _inside(ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``ids``, checked to lie in ``[0, num_rows)`` before they index anything (a negative id would wrap around)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        raise ValueError(f"sparsecomm sharded table: a rank shared ids outside [0, {num_rows}): a bug or a "
                         f"version mismatch between ranks")
    return ids
