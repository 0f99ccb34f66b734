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
        grow = lambda old, need: max(need, 0 if old is None else old.numel())  # noqa: E731
        send = torch.empty(grow(send, send_bytes), dtype=torch.uint8, device=device)
        recv = torch.empty(grow(recv, recv_bytes), dtype=torch.uint8, device=device)
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


def _exchange_packed(send: torch.Tensor, send_counts: List[int], recv_counts: List[int], row_bytes: List[int],
                     group: Optional[dist.ProcessGroup], device: torch.device, stats: Optional[SparseSyncStats],
                     peer_node: Optional[Sequence[int]]) -> List[torch.Tensor]:
    """One all-to-all of packed rows; returns each tensor's received bytes, in source-rank order.

    Layout of every peer's chunk, both ways: the chunk's rows of tensor 0,
    then of tensor 1, ... (row widths ``row_bytes``).
    """
    per_row = sum(row_bytes)
    recv = torch.empty(sum(recv_counts) * per_row, dtype=torch.uint8, device=device)
    s_bytes = [c * per_row for c in send_counts]
    r_bytes = [c * per_row for c in recv_counts]
    dist.all_to_all_single(recv, send, r_bytes, s_bytes, group=group)
    count_bytes(stats, s_bytes, r_bytes, dist.get_rank(group), peer_node)
    if len(row_bytes) == 1:
        return [recv]
    chunks: List[List[torch.Tensor]] = [[] for _ in row_bytes]
    offset = 0
    for c in recv_counts:
        for i, rb in enumerate(row_bytes):
            chunks[i].append(recv[offset:offset + c * rb])
            offset += c * rb
    return [torch.cat(ch) for ch in chunks]


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
    row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]
    flat = [_as_bytes(t.to(device)) for t in tensors]
    if len(tensors) == 1:
        send = flat[0]
    else:
        pieces, offset = [], 0
        for c in send_counts:
            pieces += [f[offset * rb:(offset + c) * rb] for f, rb in zip(flat, row_bytes)]
            offset += c
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    parts = _exchange_packed(send, send_counts, recv_counts, row_bytes, group, device, stats, peer_node)
    return [p.view(t.dtype).view(-1, *t.shape[1:]) for p, t in zip(parts, tensors)]


def exchange_counts(send_counts: torch.Tensor, group: Optional[dist.ProcessGroup], device: torch.device,
                    stats: Optional[SparseSyncStats] = None, peer_node: Optional[Sequence[int]] = None
                    ) -> List[int]:
    """All-to-all of one int64 per peer: how many rows each rank will send me."""
    n = dist.get_world_size(group)
    recv = torch.empty(n, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, send_counts.to(device), group=group)
    count_bytes(stats, [8] * n, [8] * n, dist.get_rank(group), peer_node)
    return recv.tolist()


def exchange_tables(parts: Sequence[Tuple[torch.Tensor, torch.Tensor]], send_counts: Sequence[Sequence[int]],
                    recv_counts: Sequence[Sequence[int]], repeat: Sequence[bool],
                    group: Optional[dist.ProcessGroup], device: torch.device
                    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """One all-to-all carrying the (ids, rows) of several tensors at once.

    Args:
        parts: per tensor, ``(ids, values)`` with one value row per id, the
            rows for peer j consecutive (peer order), unless ``repeat``.
        send_counts, recv_counts: per tensor, rows sent to / received from each
            peer (received counts must already be validated).
        repeat: per tensor, True to send all of its rows to every peer (an allgather).

    Returns:
        Per tensor, the received ``(ids, values)``, in source-rank order.
    """
    n = dist.get_world_size(group)
    widths = [[i.element_size(), math.prod(v.shape[1:]) * v.element_size()] for i, v in parts]
    flat = [(_as_bytes(i.to(device)), _as_bytes(v.to(device))) for i, v in parts]
    offsets = [0] * len(parts)
    pieces = []
    for j in range(n):
        for t, ((fi, fv), (wi, wv)) in enumerate(zip(flat, widths)):
            c = send_counts[t][j]
            a = 0 if repeat[t] else offsets[t]
            pieces += [fi[a * wi:(a + c) * wi], fv[a * wv:(a + c) * wv]]
            offsets[t] = a + c
    s_bytes = [sum(send_counts[t][j] * sum(widths[t]) for t in range(len(parts))) for j in range(n)]
    r_bytes = [sum(recv_counts[t][j] * sum(widths[t]) for t in range(len(parts))) for j in range(n)]
    send, recv = wire_buffers(group, sum(s_bytes), sum(r_bytes), device)
    if pieces:
        torch.cat(pieces, out=send)
    dist.all_to_all_single(recv, send, r_bytes, s_bytes, group=group)
    chunks: List[List[List[torch.Tensor]]] = [[[], []] for _ in parts]
    pos = 0
    for j in range(n):
        for t, (wi, wv) in enumerate(widths):
            c = recv_counts[t][j]
            chunks[t][0].append(recv[pos:pos + c * wi])
            pos += c * wi
            chunks[t][1].append(recv[pos:pos + c * wv])
            pos += c * wv
    out = []  # torch.cat copies: nothing returned aliases the reused receive buffer
    for (ids, values), (ci, cv) in zip(parts, chunks):
        out.append((torch.cat(ci).view(ids.dtype), torch.cat(cv).view(values.dtype).view(-1, *values.shape[1:])))
    return out


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
    # The same rows go to every peer: pack them once and repeat, so one
    # all-to-all sends exact sizes (no padding to the largest rank).
    wire = ids.to(wire_ids)
    packed = torch.cat([_as_bytes(wire.to(device)), _as_bytes(values.to(device))])
    row_bytes = [wire.element_size(), math.prod(values.shape[1:]) * values.element_size()]
    parts = _exchange_packed(packed.repeat(n), [ids.shape[0]] * n, list(counts), row_bytes, group, device, stats,
                             peer_node)
    out_ids = parts[0].view(wire_ids)
    out_values = parts[1].view(values.dtype).view(-1, *values.shape[1:])
    return kernel_ids(out_ids.to(ids.device)), out_values.to(values.device)
