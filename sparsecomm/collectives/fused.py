"""The fused exchange: every fused tensor of a call in one push all-to-all, then one pull for the owners' sums.

A fused path (``SyncPath.fused``: partitioned, allgather) gives, per tensor,
the blocks it pushes and its row counts (:class:`FusedPush`); every fused
tensor of the call travels in **one** all-to-all
(:func:`~sparsecomm.collectives.exchange.exchange_tables`), and receivers sum
straight out of the receive buffer, in rank order. Paths that pull
(``SyncPath.pulls``: partitioned) then share their owners' sums with every
rank in **one** pull-count exchange and **one** pull all-to-all for all of
them. Each row is copied once per side.

Trust: the counts come from the validated metadata. A bad id an owner
receives comes back as an empty block: the owner records the error and every
rank learns it from that owner's pull count (a negative code), so every rank
raises together. A pull count above what was pushed to its owner is refused
before anything is sized from it.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from sparsecomm.collectives.exchange import Block, Gathered, Reduce, exchange_tables, wire_row_bytes
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.collectives.transport import all_to_all, count_bytes
from sparsecomm.types import ReduceOp, WireStatus

__all__ = ["FusedPush", "fused_exchange", "finish_sums"]

Result = Tuple[torch.Tensor, torch.Tensor]


class FusedPush(NamedTuple):
    """One tensor's part of the fused push.

    Attributes:
        blocks: ``[ids, values]`` to send (a :class:`Gathered` packs through an index).
        send_counts: rows to each peer (all rows to every peer when ``repeat``).
        recv_counts: rows from each peer (validated).
        repeat: send every row to every peer (an allgather).
    """

    blocks: List[Block]
    send_counts: List[int]
    recv_counts: List[int]
    repeat: bool


def fused_exchange(tensors: List[TensorRows], peers: List[Peers], plan: SyncPlan) -> List[Result]:
    """Push every fused tensor in one all-to-all; pull the owned sums of the pulling ones in one more.

    Returns:
        Per tensor, ``(ids, values)``: sorted unique ids and their sums in the
        tensor's dtype and device.
    """
    parts: List[FusedPush] = []
    of: List[int] = []   # the tensor each part belongs to
    for i, (t, p) in enumerate(zip(tensors, peers)):
        for part in t.path.push(t, p, plan):
            parts.append(part)
            of.append(i)
    # Not strict: a bad id from a peer comes back as an empty block, handled below. A path with its own
    # merge gets its received rows as they are.
    reduce = [_reduce(tensors[i]) for i in of]
    received: List[List[List[torch.Tensor]]] = [[] for _ in tensors]
    for i, got in zip(of, _exchange(parts, reduce, [tensors[i] for i in of], plan)):
        received[i].append(got)
    out: List[Optional[Result]] = [None] * len(tensors)
    owned, owned_idx, errors = [], [], []
    for i, (t, got) in enumerate(zip(tensors, received)):
        err = WireStatus.OK
        if t.path.merge is not None:  # every rank received the same rows: it raises on every rank, or none
            ids, sums = t.path.merge(t, got, peers[i], plan)
        elif got[0]:
            ids, sums = got[0]
        elif not t.path.pulls:  # every rank received the same rows: every rank raises
            raise ValueError(f"sparse_allreduce: a peer sent row ids outside [0, {t.num_rows}) "
                             f"(inconsistent data between ranks)")
        else:  # an owner records the error and tells every rank in its pull count
            ids, sums = t.ids[:0], t.values.new_empty((0, *t.value_shape()), dtype=t.sum_dtype)
            err = WireStatus.ID_RANGE
        ids, sums = finish_sums(t, ids, sums, plan, final=not t.path.pulls)
        if not t.path.pulls:
            out[i] = ids, sums
            continue
        owned.append((ids, sums))
        owned_idx.append(i)
        errors.append(err)
    if owned:
        pulled = _pull(owned, errors, [tensors[i] for i in owned_idx], [peers[i] for i in owned_idx], plan)
        for i, res in zip(owned_idx, pulled):
            out[i] = res
    return out


def _reduce(t: TensorRows) -> Optional[Reduce]:
    """How the exchange sums a tensor's received rows: not at all when its path merges them itself."""
    if t.path.merge is not None:
        return None
    return Reduce(t.num_rows, t.ids.dtype, accumulate=t.sum_dtype != t.values.dtype, strict=False)


def finish_sums(t: TensorRows, ids: torch.Tensor, sums: torch.Tensor, plan: SyncPlan, final: bool = True
                ) -> Result:
    """Sums of received rows (in ``t.sum_dtype``), averaged if asked, on the tensor's device.

    ``final``: these are the results, in the tensor's dtype; else they travel
    on (an owner's sums for the pull), in the rows' wire dtype.
    """
    if plan.op is ReduceOp.AVG:
        sums.div_(plan.world_size)
    dtype = t.tensor.dtype if final else t.values.dtype
    return ids.to(t.ids.device), sums.to(device=t.values.device, dtype=dtype)


def _pull_counts(owned: Sequence[Result], errors: Sequence[WireStatus], tensors: List[TensorRows],
                 peers: List[Peers], plan: SyncPlan) -> List[List[int]]:
    """Every owner's summed-row count per tensor, to every rank (one all-to-all), checked the same everywhere."""
    n, me = plan.world_size, plan.rank
    # A count below zero carries an owner's error to every rank (same verdict everywhere).
    mine = [ids.shape[0] if err == WireStatus.OK else -1 - err for (ids, _), err in zip(owned, errors)]
    send = torch.tensor(mine * n, dtype=torch.int64, device=plan.comm_device).view(n, -1)
    recv = torch.empty_like(send)
    all_to_all(recv, send, group=plan.group)
    got = recv.tolist()
    for t in tensors:
        count_bytes(t.stats, [8] * n, [8] * n, me, plan.peer_node)
    recv_counts = []
    for j, (t, p) in enumerate(zip(tensors, peers)):
        counts = [got[r][j] for r in range(n)]
        for r, c in enumerate(counts):
            if c == -1 - WireStatus.ID_RANGE:
                raise ValueError(f"sparse_allreduce: owner rank {r} received row ids outside [0, {t.num_rows}) "
                                 f"(inconsistent data between ranks); nothing was shared")
            # An owner holds at most the rows pushed to it, and no more than the table.
            pushed = sum(p.push[i][r] for i in range(n))
            if c < 0 or c > min(t.num_rows, pushed):
                raise ValueError(f"sparse_allreduce: owner rank {r} announced {c} summed rows, inconsistent with "
                                 f"the {pushed} rows pushed to it; nothing was shared")
        recv_counts.append(counts)
    return recv_counts


def _pull(owned: Sequence[Result], errors: Sequence[WireStatus], tensors: List[TensorRows], peers: List[Peers],
          plan: SyncPlan) -> List[Result]:
    """Every owner shares its summed rows with every rank: one count exchange, one all-to-all."""
    n = plan.world_size
    recv_counts = _pull_counts(owned, errors, tensors, peers, plan)
    pushes = [FusedPush([Gathered(ids, None, t.wire_ids), values], [ids.shape[0]] * n, counts, repeat=True)
              for (ids, values), t, counts in zip(owned, tensors, recv_counts)]
    # Owners' rows arrive owner by owner, disjoint: coalescing them straight out of the receive buffer
    # writes the sorted result once (and bounds-checks the ids; every rank receives the same rows).
    reduce = [Reduce(t.num_rows, t.ids.dtype) for t in tensors]
    received = _exchange(pushes, reduce, tensors, plan)
    return [(ids.to(t.ids.device), values.to(t.values.device)) for t, (ids, values) in zip(tensors, received)]


def _exchange(pushes: List[FusedPush], reduce: List[Optional[Reduce]], tensors: List[TensorRows], plan: SyncPlan
              ) -> List[List[torch.Tensor]]:
    """One all-to-all carrying several tensors' blocks, with each tensor's bytes on the wire and copied counted."""
    for push, t in zip(pushes, tensors):
        row = sum(wire_row_bytes(x) for x in push.blocks)
        count_bytes(t.stats, [c * row for c in push.send_counts], [c * row for c in push.recv_counts], plan.rank,
                    plan.peer_node)
    return exchange_tables([p.blocks for p in pushes], [p.send_counts for p in pushes],
                           [p.recv_counts for p in pushes], [p.repeat for p in pushes], plan.group,
                           plan.comm_device, reduce=reduce, stats=[t.stats for t in tensors])
