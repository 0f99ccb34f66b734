"""The exchanges of a sparse synchronization once its metadata is agreed.

:func:`fused_exchange`: every flat-partitioned and allgather tensor of a call
in one push all-to-all, then (partitioned) one pull-count exchange and one
pull all-to-all for all of them. :func:`one_by_one`: the paths that cannot
share those collectives (two-level aggregation, densify, the tree in
``tree.py``, gloo's own sparse all_reduce), per tensor.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives.exchange import (allgather_rows, count_bytes, exchange_tables, kernel_ids,
                                             push_to_owners, wire_buffers)
from sparsecomm.collectives.groups import node_groups
from sparsecomm.collectives.sync_plan import (ERR_OK, ERR_RANGE, Peers, Rows, SyncPlan, check_peers, meta_row,
                                              meta_width)
from sparsecomm.collectives.tree import tree_allreduce
from sparsecomm.types import ReduceOp, SparseSyncStats, SyncMethod

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
    widths = [(torch.empty(0, dtype=t.wire_ids).element_size(), t.stats.row_bytes) for t in tables]
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
    dist.all_to_all_single(recv, send, group=plan.group)
    recv = recv.view(n, -1)
    got = recv[:, :hb].reshape(-1).view(torch.int64).view(n, len(tables), width).tolist()
    peers = [check_peers([got[r][i] for r in range(n)], t, plan) for i, t in enumerate(tables)]
    for t, p, (si, sv) in zip(tables, peers, spans):
        t.stats.bytes_sent += (n - 1) * (8 * width + si + sv)
        t.stats.bytes_recv += (n - 1) * (8 * width + si + sv)
    if any(max(p.k) > cap for p, cap in zip(peers, caps)):
        return None
    out, offset = [], hb
    for t, p, (wi, wv), (si, sv) in zip(tables, peers, widths, spans):
        ids = torch.cat([recv[r, offset:offset + p.k[r] * wi] for r in range(n)]).view(t.wire_ids)
        offset += si
        vals = torch.cat([recv[r, offset:offset + p.k[r] * wv] for r in range(n)]).view(t.values.dtype)
        offset += sv
        vals = vals.view(-1, *t.value_shape()).to(device=t.values.device, dtype=t.sum_dtype)
        ids, vals = _sum_gathered(t, kernel_ids(ids).to(t.ids.device), vals, plan)
        out.append((ids, vals))
    return peers, out


def _align8(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def _sum_gathered(t: Rows, ids: torch.Tensor, values: torch.Tensor, plan: SyncPlan
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank sums the same gathered rows in rank order: identical results everywhere."""
    try:
        ids, values = ops.coalesce_rows(ids, values, t.num_rows)
    except ValueError:  # every rank received the same rows: every rank raises
        raise ValueError(f"sparse_allreduce: a peer sent row ids outside [0, {t.num_rows}) "
                         f"(inconsistent data between ranks)") from None
    if plan.op is ReduceOp.AVG:
        values.div_(plan.world_size)
    return ids, values.to(t.values.dtype)


def fused_exchange(tables: List[Rows], peers: List[Peers], plan: SyncPlan
                    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Push (partitioned) and gather (allgather) every fused tensor in one all-to-all; pull the owned sums in one more."""
    n, me = plan.world_size, plan.rank
    # Push: to peer j, partitioned tensors send the rows j owns, allgather tensors all their rows.
    send_parts, send_counts, recv_counts = [], [], []
    for t, p in zip(tables, peers):
        if t.method is SyncMethod.PARTITIONED:
            ids, values = t.part.ids, t.part.values
            send_counts.append(p.push[me])
            recv_counts.append([p.push[i][me] for i in range(n)])
        else:
            ids, values = t.ids, t.values
            send_counts.append([p.k[me]] * n)
            recv_counts.append(list(p.k))
        send_parts.append((ids.to(t.wire_ids), values))
    received = _all_to_all_tables(send_parts, send_counts, recv_counts, [t.stats for t in tables], plan,
                                  repeat=[t.method is SyncMethod.ALLGATHER for t in tables])
    out: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(tables)
    owned, owned_idx, errors = [], [], []
    for i, (t, (ids, values)) in enumerate(zip(tables, received)):
        ids = kernel_ids(ids).to(t.ids.device)
        values = values.to(device=t.values.device, dtype=t.sum_dtype)
        if t.method is SyncMethod.ALLGATHER:
            out[i] = _sum_gathered(t, ids, values, plan)
            continue
        try:
            # Ids from peers are bounds-checked by the kernel before it indexes with them.
            ids, values = ops.coalesce_rows(ids, values, t.num_rows)
            err = ERR_OK
        except ValueError:
            ids, values, err = ids[:0], values[:0], ERR_RANGE
        if plan.op is ReduceOp.AVG:
            values.div_(n)
        owned.append((ids, values.to(t.values.dtype)))
        owned_idx.append(i)
        errors.append(err)
    if owned:
        pulled = _pull(owned, errors, [tables[i] for i in owned_idx], [peers[i] for i in owned_idx], plan)
        for i, res in zip(owned_idx, pulled):
            out[i] = res
    return out


def _pull(owned, errors, tables: List[Rows], peers: List[Peers], plan: SyncPlan
          ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Every owner shares its summed rows with every rank: one count exchange, one all-to-all."""
    n, me = plan.world_size, plan.rank
    # A count below zero carries an owner's error to every rank (same verdict everywhere).
    mine = [ids.shape[0] if err == ERR_OK else -1 - err for (ids, _), err in zip(owned, errors)]
    send = torch.tensor(mine * n, dtype=torch.int64, device=plan.comm_device).view(n, -1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=plan.group)
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
    send_parts = [(ids.to(t.wire_ids), values) for (ids, values), t in zip(owned, tables)]
    send_counts = [[ids.shape[0]] * n for ids, _ in owned]
    received = _all_to_all_tables(send_parts, send_counts, recv_counts, [t.stats for t in tables], plan,
                                  repeat=[True] * len(tables))
    out = []
    for t, (ids, values) in zip(tables, received):
        # Owners' rows arrive owner by owner, disjoint: one sort makes the result coalesced.
        ids, values = ops.coalesce_rows(kernel_ids(ids).to(t.ids.device), values.to(t.values.device), t.num_rows)
        out.append((ids, values))
    return out


def _all_to_all_tables(parts: List[Tuple[torch.Tensor, torch.Tensor]], send_counts: List[List[int]],
                       recv_counts: List[List[int]], stats: List[SparseSyncStats], plan: SyncPlan,
                       repeat: List[bool]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """One all-to-all carrying (ids, rows) of several tensors; returns each tensor's received rows in rank order.

    ``repeat[t]``: tensor t sends all of its rows to every peer (an allgather);
    else ``send_counts[t][j]`` consecutive rows go to peer j.
    """
    me = plan.rank
    row_bytes = [[ids.element_size(), math.prod(v.shape[1:]) * v.element_size()] for ids, v in parts]
    for t, s in enumerate(stats):
        row = sum(row_bytes[t])
        count_bytes(s, [c * row for c in send_counts[t]], [c * row for c in recv_counts[t]], me, plan.peer_node)
    return exchange_tables(parts, send_counts, recv_counts, repeat, plan.group, plan.comm_device)


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
