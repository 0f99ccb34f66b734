"""Row exchanges between ranks: push rows to their owners, share owned rows with all.

Everything travels as bytes (uint8) through ``all_to_all_single`` with uneven
splits: gloo's all-to-all has no int16 and no half-precision reductions are
needed in transit, so one code path serves every dtype.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.types import SparseSyncStats

# torch >= 2.13 renames all_gather_into_tensor (which then warns) to all_gather_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["all_gather_single", "wire_index_dtype", "kernel_ids", "check_counts", "count_bytes", "wire_buffers", "all_to_all_rows", "exchange_counts",
           "exchange_tables", "push_to_owners", "allgather_rows"]


def wire_index_dtype(num_rows: int) -> torch.dtype:
    """Smallest signed integer dtype that holds every id of a ``num_rows`` table."""
    if num_rows <= 2**15:
        return torch.int16
    if num_rows <= 2**31:
        return torch.int32
    return torch.int64


def kernel_ids(ids: torch.Tensor) -> torch.Tensor:
    # The kernels take int32/int64; int16 only exists on the wire.
    return ids.to(torch.int32) if ids.dtype == torch.int16 else ids


_BUFFERS: dict = {}
_MAX_CACHED_BYTES = 256 << 20


def wire_buffers(group: Optional[dist.ProcessGroup], send_bytes: int, recv_bytes: int, device: torch.device
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Send and receive byte buffers for one exchange on ``group``, reused from call to call.

    Fresh buffers cost page faults on every call (measured here: +0.4 ms for a
    0.5 MB all-to-all, half its time). One pair per group and device, grown
    as needed up to 256 MiB each; every group is used by one thread only
    (see ``groups``), and callers copy what they keep out of the receive buffer.
    """
    key = (id(group) if group is not None else None, str(device))
    send, recv = _BUFFERS.get(key, (None, None))
    if send is None or send.numel() < send_bytes or recv.numel() < recv_bytes:
        have = (0, 0) if send is None else (send.numel(), recv.numel())
        send = torch.empty(max(send_bytes, have[0]), dtype=torch.uint8, device=device)
        recv = torch.empty(max(recv_bytes, have[1]), dtype=torch.uint8, device=device)
        if max(send.numel(), recv.numel()) <= _MAX_CACHED_BYTES:
            _BUFFERS[key] = (send, recv)
    return send[:send_bytes], recv[:recv_bytes]


def check_counts(counts: Sequence[int], limit: int, what: str) -> List[int]:
    """Row counts received from peers, validated before they size a buffer or an all-to-all split.

    Raises:
        ValueError: a count is negative or above ``limit`` (a bug, a version
            mismatch or corrupted memory on the sending rank).
    """
    counts = list(counts)
    for r, c in enumerate(counts):
        if not 0 <= c <= limit:
            raise ValueError(f"sparsecomm: rank {r} announced {c} {what}, outside [0, {limit}]: a bug or a "
                             f"version mismatch between ranks; nothing was received")
    return counts


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def count_bytes(stats: Optional[SparseSyncStats], send: Sequence[int], recv: Sequence[int], me: int,
                 peer_node: Optional[Sequence[int]]) -> None:
    if stats is None:
        return
    for peer, (s, r) in enumerate(zip(send, recv)):
        if peer == me:
            continue
        stats.bytes_sent += s
        stats.bytes_recv += r
        if peer_node is not None and peer_node[peer] != peer_node[me]:
            stats.bytes_sent_inter_node += s
            stats.bytes_recv_inter_node += r


def all_to_all_rows(tensors: Sequence[torch.Tensor], send_counts: List[int], recv_counts: List[int],
                    group: Optional[dist.ProcessGroup], device: torch.device,
                    stats: Optional[SparseSyncStats] = None, peer_node: Optional[Sequence[int]] = None
                    ) -> List[torch.Tensor]:
    """Send rows ``[offset_j, offset_j + send_counts[j])`` of each tensor to group rank j.

    All tensors share the row counts (e.g. ids and their value rows). Several
    tensors travel in one all-to-all, each peer's rows of every tensor back to
    back: one collective's latency instead of one per tensor, for a copy on
    each side (at the sizes this library moves, latency is the larger cost).

    Returns:
        One tensor per input: the received rows, ordered by source rank.
    """
    per_row = sum(_row_bytes(t) for t in tensors)
    count_bytes(stats, [c * per_row for c in send_counts], [c * per_row for c in recv_counts],
                dist.get_rank(group), peer_node)
    return exchange_tables([tensors], [send_counts], [recv_counts], [False], group, device)[0]


def exchange_counts(send_counts: torch.Tensor, group: Optional[dist.ProcessGroup], device: torch.device,
                    stats: Optional[SparseSyncStats] = None, peer_node: Optional[Sequence[int]] = None
                    ) -> List[int]:
    """All-to-all of one int64 per peer: how many rows each rank will send me."""
    n = dist.get_world_size(group)
    recv = torch.empty(n, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, send_counts.to(device), group=group)
    count_bytes(stats, [8] * n, [8] * n, dist.get_rank(group), peer_node)
    return recv.tolist()


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def exchange_tables(blocks: Sequence[Sequence[torch.Tensor]], send_counts: Sequence[Sequence[int]],
                    recv_counts: Sequence[Sequence[int]], repeat: Sequence[bool],
                    group: Optional[dist.ProcessGroup], device: torch.device) -> List[List[torch.Tensor]]:
    """One all-to-all carrying several blocks of rows at once: the packing every row exchange uses.

    Args:
        blocks: per block, tensors with one row per entry that share its row
            counts (say a tensor's ids and its value rows); the rows for peer
            j consecutive, in peer order, unless ``repeat``.
        send_counts, recv_counts: per block, rows sent to / received from each
            peer (received counts must already be validated).
        repeat: per block, True to send all of its rows to every peer (an allgather).

    Layout of every peer's chunk, both ways: block 0's rows of each of its
    tensors, then block 1's, ... Buffers are reused (:func:`wire_buffers`).

    Returns:
        Per block, its tensors' received rows in source-rank order (copies:
        nothing returned aliases the reused receive buffer).
    """
    n = dist.get_world_size(group)
    widths = [[_row_bytes(t) for t in block] for block in blocks]
    flat = [[_as_bytes(t.to(device)) for t in block] for block in blocks]
    offsets = [0] * len(blocks)
    pieces = []
    for j in range(n):
        for b, (fb, wb) in enumerate(zip(flat, widths)):
            c = send_counts[b][j]
            a = 0 if repeat[b] else offsets[b]
            pieces += [f[a * w:(a + c) * w] for f, w in zip(fb, wb)]
            offsets[b] = a + c
    s_bytes = [sum(send_counts[b][j] * sum(widths[b]) for b in range(len(blocks))) for j in range(n)]
    r_bytes = [sum(recv_counts[b][j] * sum(widths[b]) for b in range(len(blocks))) for j in range(n)]
    send, recv = wire_buffers(group, sum(s_bytes), sum(r_bytes), device)
    if pieces:
        torch.cat(pieces, out=send)
    dist.all_to_all_single(recv, send, r_bytes, s_bytes, group=group)
    chunks: List[List[List[torch.Tensor]]] = [[[] for _ in block] for block in blocks]
    pos = 0
    for j in range(n):
        for b, wb in enumerate(widths):
            c = recv_counts[b][j]
            for i, w in enumerate(wb):
                chunks[b][i].append(recv[pos:pos + c * w])
                pos += c * w
    return [[torch.cat(ch).view(t.dtype).view(-1, *t.shape[1:]) for ch, t in zip(cb, block)]
            for cb, block in zip(chunks, blocks)]


def push_to_owners(ids: torch.Tensor, values: torch.Tensor, group: Optional[dist.ProcessGroup], *,
                   num_owners: int, stride: int, scheme: str, num_rows: int, range_size: int,
                   wire_ids: torch.dtype, sum_dtype: torch.dtype, device: torch.device,
                   stats: Optional[SparseSyncStats] = None, peer_node: Optional[Sequence[int]] = None,
                   part: Optional[ops.Partition] = None, recv_counts: Optional[List[int]] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Send each row to its owner in ``group`` and sum what this rank owns.

    Args:
        ids, values: this rank's coalesced rows.
        num_owners: ranks of ``group``; owner of id = (bucket(id) // stride) % num_owners.
        sum_dtype: dtype the owner accumulates in (float32 for fp16/bf16).
        part, recv_counts: the partition of ``ids`` and the row counts this
            rank receives, when the caller already has them (the counts can
            travel with other metadata and save a collective).

    Returns:
        ``(owned_ids, sums)``: sorted ids this rank owns, and the sum over ranks
        of their rows (in ``sum_dtype``), added in rank order: deterministic.
    """
    if part is None:
        part = ops.partition_rows(ids, values, num_owners, scheme, num_rows, range_size=range_size, stride=stride)
    send_counts = part.counts.tolist()
    if recv_counts is None:
        # A peer sends me at most its rows, and never more than the table has.
        recv_counts = check_counts(exchange_counts(part.counts, group, device, stats, peer_node), num_rows,
                                   "rows for me to own")
    recv_ids, recv_values = all_to_all_rows([part.ids.to(wire_ids), part.values], send_counts, recv_counts,
                                            group, device, stats, peer_node)
    recv_ids = kernel_ids(recv_ids.to(ids.device))
    recv_values = recv_values.to(device=values.device, dtype=sum_dtype)
    return ops.coalesce_rows(recv_ids, recv_values)


def allgather_rows(ids: torch.Tensor, values: torch.Tensor, group: Optional[dist.ProcessGroup], *,
                   wire_ids: torch.dtype, device: torch.device, stats: Optional[SparseSyncStats] = None,
                   peer_node: Optional[Sequence[int]] = None, counts: Optional[List[int]] = None,
                   max_rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Give every rank of ``group`` the rows each rank holds (sizes may differ).

    Args:
        counts: every rank's row count, when already known (skips one exchange).
        max_rows: the most rows a peer may announce (the table's rows); counts
            received from peers are checked against it before anything is allocated.

    Returns:
        ``(ids, values)`` of all ranks, concatenated in rank order.
    """
    n = dist.get_world_size(group)
    if counts is None:
        # An all-to-all of one int64, not an all-gather: gloo's all-gather of a
        # few bytes costs several times the latency of its all-to-all.
        counts = exchange_counts(torch.full((n,), ids.shape[0], dtype=torch.int64), group, device, stats,
                                 peer_node)
        counts = check_counts(counts, max_rows if max_rows is not None else 2**62, "rows to share")
    # The same rows go to every peer, at their exact sizes (no padding to the largest rank).
    wire = ids.to(wire_ids)
    per_row = wire.element_size() + _row_bytes(values)
    me = dist.get_rank(group)
    count_bytes(stats, [ids.shape[0] * per_row] * n, [c * per_row for c in counts], me, peer_node)
    out_ids, out_values = exchange_tables([[wire, values]], [[ids.shape[0]] * n], [list(counts)], [True], group,
                                          device)[0]
    return kernel_ids(out_ids.to(ids.device)), out_values.to(values.device)
