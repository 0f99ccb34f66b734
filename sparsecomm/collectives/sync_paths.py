"""The exchanges of a sparse synchronization once its metadata is agreed.

:func:`fused_exchange`: every flat-partitioned and allgather tensor of a call
in one push all-to-all, then (partitioned) one pull-count exchange and one
pull all-to-all for all of them. :func:`one_by_one`: the paths that cannot
share those collectives (two-level aggregation, densify, the tree in
``tree.py``, gloo's own sparse all_reduce), per tensor.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.exchange import (Gathered, Reduce, all_to_all, allgather_rows, count_bytes, count_copied,
                                             exchange_tables, push_to_owners, wire_buffers, wire_row_bytes)
from sparsecomm.collectives.groups import node_groups
from sparsecomm.collectives.sync_plan import (ERR_OK, ERR_RANGE, Peers, Rows, SyncPlan, check_peers, meta_row,
                                              meta_width)
from sparsecomm.collectives.tree import tree_allreduce
from sparsecomm.types import ReduceOp, SyncMethod

__all__ = ["capped_allgather", "fused_exchange", "one_by_one"]


def capped_allgather(tables: List[Rows], plan: SyncPlan
                     ) -> Optional[Tuple[List[Peers], List[Tuple[torch.Tensor, torch.Tensor]]]]:
    """Metadata and rows of every tensor in ONE all-to-all, each rank's rows padded to the agreed capacity.

    Every rank sends the same chunk to every rank: its metadata (as in
    :func:`~sparsecomm.collectives.sync_plan.exchange_meta`), then per tensor
    ``capacity[t]`` ids and rows (its k rows, then unread padding). Receivers
    check every rank's metadata first (the same verdict everywhere), then read
    k rows of each. Half the collectives of the two-round path, for the
    padding's bytes.

    Returns:
        ``(peers, [(ids, values)])``, or None when some rank holds more rows
        than the capacity (every rank sees it: call the two-round path).
    """
    n, caps = plan.world_size, plan.capacity
    dev = plan.comm_device
    width = meta_width(plan)
    header = torch.tensor(meta_row(tables, plan), dtype=torch.int64, device=dev)
    widths = [(wire_row_bytes(Gathered(t.ids, None, t.wire_ids)), wire_row_bytes(t.values)) for t in tables]
    hb = header.numel() * 8
    # Every region starts at a multiple of 8 bytes, so each can be viewed in its dtype.
    spans = [(_align8(cap * wi), _align8(cap * wv)) for cap, (wi, wv) in zip(caps, widths)]
    size = hb + sum(a + b for a, b in spans)
    send, recv = wire_buffers(plan.group, n * size, n * size, dev)
    # Rank 0's chunk is written in place (no staging copies; the padding is
    # never read, so it is not cleared), then copied for the other ranks.
    first = send[:size]
    first[:hb].copy_(header.view(torch.uint8))
    offset = hb
    for t, cap, (wi, wv), (si, sv) in zip(tables, caps, widths, spans):
        k = min(cap, t.ids.shape[0])
        first[offset:offset + k * wi].view(t.wire_ids).copy_(t.ids[:k])
        offset += si
        if k:
            first[offset:offset + k * wv].view(t.values.dtype).view(k, -1).copy_(t.values[:k].reshape(k, -1))
        offset += sv
    for j in range(1, n):
        send[j * size:(j + 1) * size].copy_(first)
    all_to_all(recv, send, group=plan.group)
    got = recv.view(n, -1)[:, :hb].reshape(-1).view(torch.int64).view(n, len(tables), width).tolist()
    peers = [check_peers([got[r][i] for r in range(n)], t, plan) for i, t in enumerate(tables)]
    for t, p, cap, (wi, wv), (si, sv) in zip(tables, peers, caps, widths, spans):
        t.stats.bytes_sent += (n - 1) * (8 * width + si + sv)
        t.stats.bytes_recv += (n - 1) * (8 * width + si + sv)
        # Rows copied into the send buffer: this rank's rows once, then its padded span once per other peer.
        count_copied(t.stats, min(cap, t.ids.shape[0]) * (wi + wv) + (n - 1) * (si + sv))
    if any(max(p.k) > cap for p, cap in zip(peers, caps)):
        return None
    out, offset = [], hb
    for t, p, (si, sv) in zip(tables, peers, spans):
        # Every rank's rows summed straight out of the receive buffer, in rank order.
        segments = [(p.k[r], r * size + offset, r * size + offset + si) for r in range(n)]
        offset += si + sv
        try:
            ids, sums = ops.coalesce_segments(recv, segments, t.wire_ids, t.values.dtype, t.value_shape(),
                                              t.num_rows, ids_dtype=t.ids.dtype,
                                              accumulate_dtype=t.sum_dtype != t.values.dtype)
        except ValueError:  # every rank received the same rows: every rank raises
            raise ValueError(f"sparse_allreduce: a peer sent row ids outside [0, {t.num_rows}) "
                             f"(inconsistent data between ranks)") from None
        out.append(_finish_sums(t, ids, sums, plan))
    return peers, out


def _align8(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def fused_exchange(tables: List[Rows], peers: List[Peers], plan: SyncPlan
                    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Push (partitioned) and gather (allgather) every fused tensor in one all-to-all; pull the owned sums in one more.

    Each row is copied once per side: packed into the send buffer (partitioned
    rows through the partition's ``perm``), then summed straight out of the
    receive buffer, by its owner (partitioned) or by every rank (allgather).
    """
    n, me = plan.world_size, plan.rank
    # Push: to peer j, partitioned tensors send the rows j owns, allgather tensors all their rows.
    blocks, send_counts, recv_counts, reduce = [], [], [], []
    for t, p in zip(tables, peers):
        if t.method is SyncMethod.PARTITIONED:
            blocks.append([Gathered(t.part.ids, None, t.wire_ids), Gathered(t.values, t.part.perm)])
            send_counts.append(p.push[me])
            recv_counts.append([p.push[i][me] for i in range(n)])
        else:
            blocks.append([Gathered(t.ids, None, t.wire_ids), t.values])
            send_counts.append([p.k[me]] * n)
            recv_counts.append(list(p.k))
        # Not strict: a bad id from a peer comes back as an empty block, handled below.
        reduce.append(Reduce(t.num_rows, t.ids.dtype, accumulate=t.sum_dtype != t.values.dtype, strict=False))
    received = _exchange(blocks, send_counts, recv_counts, [t.method is SyncMethod.ALLGATHER for t in tables],
                         reduce, tables, plan)
    out: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(tables)
    owned, owned_idx, errors = [], [], []
    for i, (t, got) in enumerate(zip(tables, received)):
        err = ERR_OK
        if got:
            ids, sums = got
        elif t.method is SyncMethod.ALLGATHER:  # every rank received the same rows: every rank raises
            raise ValueError(f"sparse_allreduce: a peer sent row ids outside [0, {t.num_rows}) "
                             f"(inconsistent data between ranks)")
        else:  # an owner records the error and tells every rank in its pull count
            ids, sums, err = t.ids[:0], t.values.new_empty((0, *t.value_shape()), dtype=t.sum_dtype), ERR_RANGE
        ids, sums = _finish_sums(t, ids, sums, plan)
        if t.method is SyncMethod.ALLGATHER:
            out[i] = ids, sums
            continue
        owned.append((ids, sums))
        owned_idx.append(i)
        errors.append(err)
    if owned:
        pulled = _pull(owned, errors, [tables[i] for i in owned_idx], [peers[i] for i in owned_idx], plan)
        for i, res in zip(owned_idx, pulled):
            out[i] = res
    return out


def _finish_sums(t: Rows, ids: torch.Tensor, sums: torch.Tensor, plan: SyncPlan
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sums of received rows (in ``t.sum_dtype``) as results: averaged if asked, in the tensor's dtype and device."""
    if plan.op is ReduceOp.AVG:
        sums.div_(plan.world_size)
    return ids.to(t.ids.device), sums.to(device=t.values.device, dtype=t.values.dtype)


def _pull(owned, errors, tables: List[Rows], peers: List[Peers], plan: SyncPlan
          ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Every owner shares its summed rows with every rank: one count exchange, one all-to-all."""
    n, me = plan.world_size, plan.rank
    # A count below zero carries an owner's error to every rank (same verdict everywhere).
    mine = [ids.shape[0] if err == ERR_OK else -1 - err for (ids, _), err in zip(owned, errors)]
    send = torch.tensor(mine * n, dtype=torch.int64, device=plan.comm_device).view(n, -1)
    recv = torch.empty_like(send)
    all_to_all(recv, send, group=plan.group)
    got = recv.tolist()
    for t in tables:
        count_bytes(t.stats, [8] * n, [8] * n, me, plan.peer_node)
    recv_counts = []
    for j, (t, p) in enumerate(zip(tables, peers)):
        counts = [got[r][j] for r in range(n)]
        for r, c in enumerate(counts):
            if c == -1 - ERR_RANGE:
                raise ValueError(f"sparse_allreduce: owner rank {r} received row ids outside [0, {t.num_rows}) "
                                 f"(inconsistent data between ranks); nothing was shared")
            # An owner holds at most the rows pushed to it, and no more than the table.
            pushed = sum(p.push[i][r] for i in range(n))
            if c < 0 or c > min(t.num_rows, pushed):
                raise ValueError(f"sparse_allreduce: owner rank {r} announced {c} summed rows, inconsistent with "
                                 f"the {pushed} rows pushed to it; nothing was shared")
        recv_counts.append(counts)
    blocks = [[Gathered(ids, None, t.wire_ids), values] for (ids, values), t in zip(owned, tables)]
    send_counts = [[ids.shape[0]] * n for ids, _ in owned]
    # Owners' rows arrive owner by owner, disjoint: coalescing them straight out of the receive buffer
    # writes the sorted result once (and bounds-checks the ids; every rank receives the same rows).
    reduce = [Reduce(t.num_rows, t.ids.dtype) for t in tables]
    received = _exchange(blocks, send_counts, recv_counts, [True] * len(tables), reduce, tables, plan)
    return [(ids.to(t.ids.device), values.to(t.values.device)) for t, (ids, values) in zip(tables, received)]


def _exchange(blocks: List[List[Rows]], send_counts: List[List[int]], recv_counts: List[List[int]],
              repeat: List[bool], reduce: List[Optional[Reduce]], tables: List[Rows], plan: SyncPlan
              ) -> List[List[torch.Tensor]]:
    """One all-to-all carrying several tensors' blocks (:func:`~sparsecomm.collectives.exchange.exchange_tables`),
    with each tensor's bytes on the wire and bytes copied counted in its stats.

    ``repeat[t]``: tensor t sends all of its rows to every peer (an allgather);
    else ``send_counts[t][j]`` consecutive rows go to peer j.
    """
    for block, t, sent, got in zip(blocks, tables, send_counts, recv_counts):
        row = sum(wire_row_bytes(x) for x in block)
        count_bytes(t.stats, [c * row for c in sent], [c * row for c in got], plan.rank, plan.peer_node)
    return exchange_tables(blocks, send_counts, recv_counts, repeat, plan.group, plan.comm_device, reduce=reduce,
                           stats=[t.stats for t in tables])


# --------------------------------------------------- paths taken one by one


def one_by_one(t: Rows, p: Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    n = plan.world_size
    ids, values = t.ids, t.values
    if t.method is SyncMethod.PARTITIONED:  # two-level
        ids, values = _two_level(t, p, plan)
    elif t.method is SyncMethod.DENSIFY:
        if plan.op is ReduceOp.AVG:
            # Divide before the sum, as DDP does: fp16 overflows otherwise.
            values = values.to(t.sum_dtype).div_(n).to(values.dtype)
        ids, values = _densify_allreduce(ids, values, t.num_rows, plan.group, plan.comm_device, t.stats)
    elif t.method is SyncMethod.TREE:
        ids, values = tree_allreduce(t, p, plan)
    else:  # the backend's own sparse all_reduce (gloo: an allgather of sizes, ids and values)
        ids, values = _torch_allreduce(t, plan)
    return ids, values


def _two_level(t: Rows, p: Peers, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Push inside the node, then across nodes; share back across nodes, then inside the node."""
    n, lws, dtype = plan.world_size, plan.local_world_size, t.values.dtype
    local_pg, cross_pg = node_groups(plan.group, lws)
    nodes_local = [0] * lws                    # every peer in my node group is on my node
    nodes_cross = list(range(n // lws))        # every peer in my cross group is on another node
    common = dict(scheme=plan.scheme, num_rows=t.num_rows, range_size=plan.range_size(t.num_rows),
                  wire_ids=t.wire_ids, device=plan.comm_device, stats=t.stats, sum_dtype=t.sum_dtype)
    ids, values = push_to_owners(t.ids, t.values, local_pg, num_owners=lws, stride=1, peer_node=nodes_local,
                                 **common)
    ids, values = push_to_owners(ids, values.to(dtype), cross_pg, num_owners=n // lws, stride=lws,
                                 peer_node=nodes_cross, **common)
    if plan.op is ReduceOp.AVG:
        values.div_(n)
    values = values.to(dtype)
    ids, values = allgather_rows(ids, values, cross_pg, wire_ids=t.wire_ids, device=plan.comm_device,
                                 stats=t.stats, peer_node=nodes_cross, max_rows=t.num_rows)
    ids, values = allgather_rows(ids, values, local_pg, wire_ids=t.wire_ids, device=plan.comm_device,
                                 stats=t.stats, peer_node=nodes_local, max_rows=t.num_rows)
    return ops.coalesce_rows(ids, values, t.num_rows)


def _torch_allreduce(t: Rows, plan: SyncPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    n = plan.world_size
    local = torch.sparse_coo_tensor(t.ids.long()[None], t.values, (t.num_rows, *t.value_shape()),
                                    is_coalesced=True, check_invariants=False).to(plan.comm_device)
    dist.all_reduce(local, group=plan.group)
    row = t.stats.row_bytes + 8
    t.stats.bytes_sent += (n - 1) * t.ids.shape[0] * row
    t.stats.bytes_recv += (t.stats.rows_local_sum - t.ids.shape[0]) * row
    ids, values = local._indices()[0], local._values()
    # Same rows in the same (rank) order on every rank: identical sums everywhere.
    ids, values = ops.coalesce_rows(ids.to(t.ids.device), values.to(t.values.device).to(t.sum_dtype), t.num_rows)
    if plan.op is ReduceOp.AVG:
        values.div_(n)
    return ids, values.to(t.values.dtype)


def _densify_allreduce(ids, values, num_rows, group, cdev, stats) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows into the dense table, allreduce it and a row mask; return the union's rows."""
    n = dist.get_world_size(group)
    dense = torch.zeros((num_rows, *values.shape[1:]), dtype=values.dtype, device=cdev)
    # The mask keeps rows whose sum is exactly zero: optimizers like SparseAdam
    # treat "row present with zero gradient" differently from "row absent".
    mask = torch.zeros(num_rows, dtype=torch.uint8, device=cdev)
    dense[ids.to(cdev).long()] = values.to(cdev)
    mask[ids.to(cdev).long()] = 1
    works = [dist.all_reduce(dense, group=group, async_op=True),
             dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group, async_op=True)]
    for w in works:
        w.wait()
    ring = 2 * (n - 1) / n if n > 1 else 0.0
    for t in (dense, mask):
        stats.bytes_sent += int(ring * t.numel() * t.element_size())
        stats.bytes_recv += int(ring * t.numel() * t.element_size())
    union = mask.nonzero().view(-1)
    return union.to(ids.device), dense.index_select(0, union).to(values.device)
