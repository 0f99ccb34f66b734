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


def all_to_all_rows(tensors: Sequence[torch.Tensor], send_counts: List[int], recv_counts: List[int],
                    group: Optional[dist.ProcessGroup], device: torch.device,
                    stats: Optional[SparseSyncStats] = None, peer_node: Optional[Sequence[int]] = None
                    ) -> List[torch.Tensor]:
    """Send rows ``[offset_j, offset_j + send_counts[j])`` of each tensor to group rank j.

    All tensors share the row counts (e.g. ids and their value rows); their
    exchanges are issued together and awaited together.

    Returns:
        One tensor per input: the received rows, ordered by source rank.
    """
    me = dist.get_rank(group)
    works, outs = [], []
    for t in tensors:
        row_bytes = math.prod(t.shape[1:]) * t.element_size()
        send = _as_bytes(t.to(device))
        recv = torch.empty(sum(recv_counts) * row_bytes, dtype=torch.uint8, device=device)
        s_bytes = [c * row_bytes for c in send_counts]
        r_bytes = [c * row_bytes for c in recv_counts]
        works.append(dist.all_to_all_single(recv, send, r_bytes, s_bytes, group=group, async_op=True))
        outs.append((recv, t))
        _count_bytes(stats, s_bytes, r_bytes, me, peer_node)
    for w in works:
        w.wait()
    return [recv.view(t.dtype).view(-1, *t.shape[1:]) for recv, t in outs]


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
                   stats: Optional[SparseSyncStats] = None, peer_node: Optional[Sequence[int]] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Send each row to its owner in ``group`` and sum what this rank owns.

    Args:
        ids, values: this rank's coalesced rows.
        num_owners: ranks of ``group``; owner of id = (bucket(id) // stride) % num_owners.
        sum_dtype: dtype the owner accumulates in (float32 for fp16/bf16).

    Returns:
        ``(owned_ids, sums)``: sorted ids this rank owns, and the sum over ranks
        of their rows (in ``sum_dtype``), added in rank order: deterministic.
    """
    part = ops.partition_rows(ids, values, num_owners, scheme, num_rows, range_size=range_size, stride=stride)
    send_counts = part.counts.tolist()
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
        gathered = torch.empty(n, dtype=torch.int64, device=device)
        all_gather_single(gathered, torch.tensor([ids.shape[0]], dtype=torch.int64, device=device), group=group)
        _count_bytes(stats, [8] * n, [8] * n, dist.get_rank(group), peer_node)
        counts = gathered.tolist()
    recv_counts = list(counts)
    # The same rows go to every peer: repeat them so one all-to-all sends exact sizes (no padding).
    rep_ids = ids.to(wire_ids).repeat(n)
    rep_values = values.repeat(n, *([1] * (values.dim() - 1)))
    out_ids, out_values = all_to_all_rows([rep_ids, rep_values], [ids.shape[0]] * n, recv_counts, group,
                                          device, stats, peer_node)
    return _kernel_ids(out_ids.to(ids.device)), out_values.to(values.device)
