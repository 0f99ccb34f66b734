"""The allgather path: every rank sends its rows to every rank, and every rank sums them (Horovod's).

Algorithm: one all-to-all in which each rank sends all of its coalesced rows
to every peer (fused: it rides in the call's push with the partitioned
tensors, ``collectives/fused.py``); every rank sums what it received, in rank
order. (N-1) k rows per rank: fewer collectives than the partitioned path
(2 with the metadata), more bytes when ranks share rows. Given capacities
(rows to reserve per rank, say last step's largest k), metadata and rows
travel in ONE all-to-all (:func:`with_metadata`).

Exactness: every rank sums the same bytes in the same (rank) order, so
results are bitwise the same everywhere; fp16/bf16 accumulate in float32.

Trust: row counts come from the validated metadata; received ids are
bounds-checked as they are summed, and every rank received the same rows,
so a bad id makes every rank raise.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from sparsecomm import ops
from sparsecomm.collectives import sync_wire
from sparsecomm.collectives.exchange import Gathered, Region, align8, all_to_all_same_chunk, wire_row_bytes
from sparsecomm.collectives.fused import FusedPush, finish_sums
from sparsecomm.collectives.methods.base import SyncPath, Workload
from sparsecomm.collectives.sync_plan import Peers, SyncPlan, TensorRows
from sparsecomm.collectives.transport import count_copied
from sparsecomm.types import SyncMethod

__all__ = ["PATH", "with_metadata", "host_bytes"]


def host_bytes(w: Workload, hosts: int, lws: int, union_node: float) -> float:
    """L (N-L) k r: a host's L ranks each send their k rows to the N-L ranks of other hosts."""
    n = hosts * lws
    if n <= 1 or hosts <= 1:
        return 0.0
    return lws * (n - lws) * w.rows_mean * w.row_bytes


def _push(t: TensorRows, p: Peers, plan: SyncPlan) -> List[FusedPush]:
    n, me = plan.world_size, plan.rank
    return [FusedPush([Gathered(t.ids, None, t.wire_ids), t.values], [p.k[me]] * n, list(p.k), repeat=True)]


def with_metadata(tensors: List[TensorRows], plan: SyncPlan
                  ) -> Optional[Tuple[List[Peers], List[Tuple[torch.Tensor, torch.Tensor]]]]:
    """Metadata and rows of every tensor in ONE all-to-all, each rank's rows padded to the agreed capacity.

    Every rank sends every rank the same chunk: its metadata records, then
    per tensor ``capacity[t]`` ids and rows (its k rows, then unread padding).
    Receivers check every rank's records first (the same verdict
    everywhere), then sum k rows of each rank straight out of the receive buffer.

    Returns:
        ``(peers, [(ids, values)])``, or None when some rank holds more rows
        than the capacity (every rank sees it: take the two-collective path).
    """
    n, caps = plan.world_size, plan.capacity
    header = torch.tensor(sync_wire.message(tensors, plan), dtype=torch.int64)
    widths = [(wire_row_bytes(Gathered(t.ids, None, t.wire_ids)), wire_row_bytes(t.values)) for t in tensors]
    regions = [Region(header, header.numel() * 8)]
    for t, cap, (wi, wv) in zip(tensors, caps, widths):
        k = min(cap, t.ids.shape[0])
        regions += [Region(t.ids[:k], cap * wi, t.wire_ids), Region(t.values[:k], cap * wv)]
    recv, offsets, size = all_to_all_same_chunk(regions, plan.group, plan.comm_device)
    words = recv.view(n, -1)[:, :header.numel() * 8].reshape(-1).view(torch.int64).view(n, -1).tolist()
    peers = sync_wire.check_all(words, tensors, plan)
    width = sync_wire.record_width(n)
    for t, p, cap, (wi, wv) in zip(tensors, peers, caps, widths):
        span = align8(cap * wi) + align8(cap * wv)
        t.stats.bytes_sent += (n - 1) * (8 * width + span)
        t.stats.bytes_recv += (n - 1) * (8 * width + span)
        # Rows copied into the send buffer: this rank's rows once, then its padded span once per other peer.
        count_copied(t.stats, min(cap, t.ids.shape[0]) * (wi + wv) + (n - 1) * span)
    if any(max(p.k) > cap for p, cap in zip(peers, caps)):
        return None
    out = []
    for i, (t, p) in enumerate(zip(tensors, peers)):
        ids_at, values_at = offsets[1 + 2 * i], offsets[2 + 2 * i]
        segments = [(p.k[r], r * size + ids_at, r * size + values_at) for r in range(n)]
        try:
            ids, sums = ops.coalesce_segments(recv, segments, t.wire_ids, t.values.dtype, t.value_shape(),
                                              t.num_rows, ids_dtype=t.ids.dtype,
                                              accumulate_dtype=t.sum_dtype != t.values.dtype)
        except ValueError:  # every rank received the same rows: every rank raises
            raise ValueError(f"sparse_allreduce: a peer sent row ids outside [0, {t.num_rows}) "
                             f"(inconsistent data between ranks)") from None
        out.append(finish_sums(t, ids, sums, plan))
    return peers, out


PATH = SyncPath(
    name="allgather",
    method=SyncMethod.ALLGATHER,
    round_trips=lambda w: 2,          # metadata, then all rows to every rank
    latency=lambda w, lat: 2 * lat.all_to_all,
    link_bytes=lambda w: host_bytes(w, w.hosts, w.lws, w.host_union),
    fit_steps=lambda n: 2 if n > 1 else 0.0,
    host_bytes=host_bytes,
    merged_rows=lambda w: w.world_size * w.rows_mean,
    fused=True,
    baseline=True,
    push=_push,
    with_metadata=with_metadata,
    compresses=True,
)
