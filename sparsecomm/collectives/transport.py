"""The all-to-all every exchange of the library goes through, its reused byte buffers, and its counters.

:func:`all_to_all` is ``dist.all_to_all_single``, or shared memory between
ranks of one host (:mod:`sparsecomm.collectives.shm`) for synchronous CPU
calls on a gloo group. Everything above it travels as bytes; the helpers
here size ids on the wire (:func:`wire_index_dtype`), reuse one pair of
byte buffers per group (:func:`wire_buffers`), validate counts received from
peers (:func:`check_counts`) and count bytes in :class:`SparseSyncStats`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives import shm
from sparsecomm.collectives.futures import keep
from sparsecomm.types import SparseSyncStats

# torch >= 2.13 renames all_gather_into_tensor (which then warns) to all_gather_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["all_gather_single", "all_to_all", "all_to_all_calls", "count_call", "wire_index_dtype", "kernel_ids",
           "wire_buffers", "check_counts", "count_bytes", "count_copied", "exchange_counts"]


# All-to-alls this process ran through all_to_all (any group, any transport): what a step costs in collectives.
_CALLS = [0]


def all_to_all_calls() -> int:
    """How many all-to-alls this process has run through :func:`all_to_all` (all groups, both transports)."""
    return _CALLS[0]


def count_call() -> None:
    """Count an all-to-all that went to the shared-memory transport without :func:`all_to_all`."""
    _CALLS[0] += 1


def all_to_all(recv: torch.Tensor, send: torch.Tensor, recv_splits: Optional[List[int]] = None,
               send_splits: Optional[List[int]] = None, *, group: Optional[dist.ProcessGroup],
               async_op: bool = False):
    """``dist.all_to_all_single``, or the group's shared-memory transport; counted in :func:`all_to_all_calls`.

    A synchronous all-to-all of CPU tensors on a gloo group whose ranks share
    a host goes through shared memory (:mod:`sparsecomm.collectives.shm`).
    Otherwise its work is kept (:func:`~sparsecomm.collectives.futures.keep`).
    """
    _CALLS[0] += 1
    if not async_op and send.device.type == "cpu" and recv.device.type == "cpu":
        fast = shm.transport(group)
        if fast is not None:
            shm.run(fast, recv, send, recv_splits, send_splits)
            return None
    work = keep(dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True), group)
    if async_op:
        return work
    work.wait()
    return None


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

    Fresh buffers would cost page faults on every call. One pair per group and device, grown
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


def count_copied(stats: Optional[SparseSyncStats], nbytes: int) -> None:
    """Add bytes copied between tensors and wire buffers to ``stats.bytes_copied``."""
    if stats is not None and nbytes:
        stats.bytes_copied += nbytes


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


def exchange_counts(send_counts: torch.Tensor, group: Optional[dist.ProcessGroup], device: torch.device,
                    stats: Optional[SparseSyncStats] = None, peer_node: Optional[Sequence[int]] = None
                    ) -> List[int]:
    """All-to-all of one int64 per peer: how many rows each rank will send me."""
    n = dist.get_world_size(group)
    recv = torch.empty(n, dtype=torch.int64, device=device)
    all_to_all(recv, send_counts.to(device), group=group)
    count_bytes(stats, [8] * n, [8] * n, dist.get_rank(group), peer_node)
    return recv.tolist()
