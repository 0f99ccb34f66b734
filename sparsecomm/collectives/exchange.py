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

__all__ = ["all_gather_single", "wire_index_dtype", "all_to_all_rows", "exchange_counts", "push_to_owners", "allgather_rows"]


def wire_index_dtype(num_rows: int) -> torch.dtype:
    """Smallest signed integer dtype that holds every id of a ``num_rows`` table."""
    if num_rows <= 2**15:
        return torch.int16
    if num_rows <= 2**31:
        return torch.int32
    return torch.int64


def _kernel_ids(ids: torch.Tensor) -> torch.Tensor:
    # The kernels take int32/int64; int16 only exists on the wire.
    return ids.to(torch.int32) if ids.dtype == torch.int16 else ids


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _count_bytes(stats: Optional[SparseSyncStats], send: Sequence[int], recv: Sequence[int], me: int,
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
    _count_bytes(stats, s_bytes, r_bytes, dist.get_rank(group), peer_node)
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
    _count_bytes(stats, [8] * n, [8] * n, dist.get_rank(group), peer_node)
    return recv.tolist()


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
        recv_counts = exchange_counts(part.counts, group, device, stats, peer_node)
    recv_ids, recv_values = all_to_all_rows([part.ids.to(wire_ids), part.values], send_counts, recv_counts,
                                            group, device, stats, peer_node)
    recv_ids = _kernel_ids(recv_ids.to(ids.device))
    recv_values = recv_values.to(device=values.device, dtype=sum_dtype)
    return ops.coalesce_rows(recv_ids, recv_values)


def allgather_rows(ids: torch.Tensor, values: torch.Tensor, group: Optional[dist.ProcessGroup], *,
                   wire_ids: torch.dtype, device: torch.device, stats: Optional[SparseSyncStats] = None,
                   peer_node: Optional[Sequence[int]] = None, counts: Optional[List[int]] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Give every rank of ``group`` the rows each rank holds (sizes may differ).

    Args:
        counts: every rank's row count, when already known (skips one exchange).

    Returns:
        ``(ids, values)`` of all ranks, concatenated in rank order.
    """
    n = dist.get_world_size(group)
    if counts is None:
        # An all-to-all of one int64, not an all-gather: gloo's all-gather of a
        # few bytes costs several times the latency of its all-to-all.
        counts = exchange_counts(torch.full((n,), ids.shape[0], dtype=torch.int64), group, device, stats,
                                 peer_node)
    # The same rows go to every peer: pack them once and repeat, so one
    # all-to-all sends exact sizes (no padding to the largest rank).
    wire = ids.to(wire_ids)
    packed = torch.cat([_as_bytes(wire.to(device)), _as_bytes(values.to(device))])
    row_bytes = [wire.element_size(), math.prod(values.shape[1:]) * values.element_size()]
    parts = _exchange_packed(packed.repeat(n), [ids.shape[0]] * n, list(counts), row_bytes, group, device, stats,
                             peer_node)
    out_ids = parts[0].view(wire_ids)
    out_values = parts[1].view(values.dtype).view(-1, *values.shape[1:])
    return _kernel_ids(out_ids.to(ids.device)), out_values.to(values.device)
