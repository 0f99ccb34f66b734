"""Measure the link inside the job: one collective's latency, the bytes/s of a large one, a merge's price.

The classifier prices a collective in bytes (latency x bandwidth); a constant
is wrong on every machine but one, so the hook measures it at registration.
With several ranks per host the bottleneck is the host's link, which its
ranks share: :func:`measure_link` prices bytes on that link, so the
classifier can count the bytes that cross it (each method's ``host_bytes``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from sparsecomm import ops
from sparsecomm.collectives import shm
from sparsecomm.collectives.futures import wait_kept
from sparsecomm.collectives.groups import comm_device
from sparsecomm.collectives.transport import all_to_all
from sparsecomm.cost_model import host_layout

__all__ = ["measure_latency_bytes", "measure_link", "LinkProbe", "alltoall_host_link_bytes", "host_layout"]


_MAX_BYTES_PER_S = 100e9  # no link here is faster: keeps a noisy timing from pricing latency absurdly
_LATENCY_BYTES_RANGE = (1 << 10, 1 << 26)


@dataclass(frozen=True)
class LinkProbe:
    """What one collective costs on this job's slowest link: the same numbers on every rank.

    Attributes:
        latency_s: one tiny all-to-all (a collective's round trip), seconds.
        bytes_per_s: bytes per second through one host's link, measured with
            a large all-to-all whose bytes on that link are known
            (:func:`alltoall_host_link_bytes`); with one rank per host, the
            rank's own bytes.
        ranks_per_host: the L the bytes were counted with.
        pair_latency_s: one tiny exchange between two ranks (a tree stage, a
            ring hop); None: not measured (priced as ``backend_latency_s``).
        backend_latency_s: one tiny all-reduce on the group's backend, when
            the group's all-to-alls take a faster transport than its other
            collectives (shared memory on one host,
            :mod:`sparsecomm.collectives.shm`): what densify's all-reduces and
            gloo's ring hops (torch's sparse all_reduce, the tree's stages)
            pay; None: priced as ``latency_s``.
        merge_s_per_byte: seconds a rank takes to sort and sum one byte of
            value rows (``ops.coalesce_rows`` on rows with repeated ids, on
            the device the exchange receives on): the price of a path's
            merged rows; 0: not measured (merges not priced).
    """

    latency_s: float
    bytes_per_s: float
    ranks_per_host: int = 1
    pair_latency_s: Optional[float] = None
    backend_latency_s: Optional[float] = None
    merge_s_per_byte: float = 0.0

    @property
    def latency_bytes(self) -> float:
        """The latency in bytes of the link: what :func:`measure_latency_bytes` returns for L = 1."""
        lo, hi = _LATENCY_BYTES_RANGE
        return min(hi, max(lo, self.latency_s * self.bytes_per_s))

    @property
    def other_latency_s(self) -> float:
        """What one of the backend's other collectives costs (an all-reduce): ``backend_latency_s`` if timed."""
        return self.latency_s if self.backend_latency_s is None else self.backend_latency_s

    @property
    def hop_latency_s(self) -> float:
        """What one exchange between two ranks costs: ``pair_latency_s`` if timed, else :attr:`other_latency_s`."""
        return self.other_latency_s if self.pair_latency_s is None else self.pair_latency_s


def alltoall_host_link_bytes(world_size: int, ranks_per_host: int, bytes_per_rank: float) -> float:
    """Bytes one host sends to the others in an all-to-all where each rank sends ``bytes_per_rank`` in all.

    Each rank sends ``bytes_per_rank / N`` to every rank; the L ranks of a
    host (contiguous) send to the N - L ranks elsewhere: L (N - L) / N x bytes.
    """
    n, lws = world_size, host_layout(world_size, ranks_per_host)
    return lws * (n - lws) / n * bytes_per_rank


def _time_alltoall(group, dev, n: int, nbytes: int, repeats: int) -> float:
    send = torch.zeros(n * max(1, nbytes // n), dtype=torch.uint8, device=dev)
    recv = torch.empty_like(send)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        all_to_all(recv, send, group=group)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_allreduce(group, dev, repeats: int) -> float:
    """Median time of a tiny all-reduce on ``group``'s backend."""
    x = torch.zeros(2, dtype=torch.float32, device=dev)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        wait_kept(dist.all_reduce(x, group=group, async_op=True), group)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_merge(device: torch.device, repeats: int, rows: int = 8192, width: int = 32) -> float:
    """Median seconds per value byte of ``ops.coalesce_rows`` on ``rows`` float32 rows, each id about twice."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rows // 2, (rows,), generator=g).to(device)
    values = torch.randn(rows, width, generator=g).to(device)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        ops.coalesce_rows(ids, values, rows // 2)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / (rows * width * 4)


def _time_pairs(group, dev, n: int, lws: int, repeats: int) -> float:
    """Median time of a tiny exchange with rank ``me ^ L`` (on another host; L = 1: ``me ^ 1``); 0 without one."""
    me = dist.get_rank(group)
    partner = me ^ (lws if lws & (lws - 1) == 0 else 1)
    if partner >= n:
        return 0.0
    peer = partner if group is None else dist.get_global_rank(group, partner)
    send = torch.zeros(8, dtype=torch.uint8, device=dev)
    recv = torch.empty_like(send)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        works = [dist.isend(send, peer, group=group), dist.irecv(recv, peer, group=group)]
        for w in works:
            w.wait()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_link(group: Optional[dist.ProcessGroup], device: torch.device = torch.device("cpu"),
                 ranks_per_host: int = 1, repeats: int = 5, large_bytes: int = 4 << 20, pairs: bool = False
                 ) -> LinkProbe:
    """Latency of a tiny all-to-all and bytes/s of a host's link under a large one: the same on every rank.

    Collective: every rank of ``group`` calls it together. Takes the median of
    ``repeats`` timings of the large all-to-all and 3 x ``repeats`` of the
    tiny messages (after one warm-up each), then the slowest rank's numbers
    (one all-reduce), so every rank prices collectives alike. ``ranks_per_host`` (L, ranks of a host contiguous in the group) says how
    many ranks share a host's link: the large all-to-all puts
    L (N-L)/N x ``large_bytes`` on it. With ``pairs`` (off by default), also
    a tiny exchange between two ranks on different hosts (rank ^ L): what a
    tree stage or a ring hop might cost. Off because it priced them too low
    here: an idle pair exchange took ~0.1 of an 8-rank all-to-all, a hop
    inside torch's ring ~0.2-0.3, and the classifier then took torch or the
    tree where allgather was up to 2.2x faster (docs/DESIGN.md). And, on
    the exchange's device, the seconds per value byte of a merge (``merge_s_per_byte``).
    """
    n = dist.get_world_size(group)
    if n == 1:
        return LinkProbe(0.0, _MAX_BYTES_PER_S, 1)
    lws = host_layout(n, ranks_per_host)
    dev = comm_device(group, device)
    # Tiny messages are cheap to repeat and their times scatter most (ranks sharing CPUs): 3x the samples.
    tiny = _time_alltoall(group, dev, n, 8 * n, 3 * repeats)
    large = _time_alltoall(group, dev, n, large_bytes, repeats)
    pair = _time_pairs(group, dev, n, lws, 3 * repeats) if pairs else 0.0
    # All-to-alls through shared memory cost a fraction of the backend's own collectives: time one of those too
    # (every rank knows the same: the transport is chosen alike everywhere).
    split = dev.type == "cpu" and shm.active(group)
    backend = _time_allreduce(group, dev, 3 * repeats) if split else 0.0
    merge = _time_merge(dev, 3 * repeats)   # where the received rows are summed
    numbers = torch.tensor([tiny, large, pair, backend, merge], dtype=torch.float64, device=dev)
    wait_kept(dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=group, async_op=True), group)
    tiny, large, pair, backend, merge = numbers.tolist()
    link = alltoall_host_link_bytes(n, lws, n * max(1, large_bytes // n))
    bytes_per_s = min(_MAX_BYTES_PER_S, link / max(large - tiny, link / _MAX_BYTES_PER_S))
    return LinkProbe(tiny, bytes_per_s, lws, min(pair, backend or tiny) if pairs else None,
                     max(backend, tiny) if split else None, merge)


def measure_latency_bytes(group: Optional[dist.ProcessGroup], device: torch.device = torch.device("cpu"),
                          repeats: int = 5, large_bytes: int = 4 << 20) -> float:
    """Latency of one tiny all-to-all, in bytes of a large one: the same number on every rank.

    Collective: every rank of ``group`` calls it together (:func:`measure_link`
    with one rank per host: bytes are a rank's own).

    Returns:
        ``latency_s * bytes_per_s``: the bytes one collective's latency is worth,
        clamped to [1 KiB, 64 MiB].
    """
    if dist.get_world_size(group) == 1:
        return 0.0
    return measure_link(group, device, 1, repeats, large_bytes, pairs=False).latency_bytes
