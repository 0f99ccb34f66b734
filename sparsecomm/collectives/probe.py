"""Measure the link inside the job: one collective's latency and the bytes/s of a large one.

The classifier prices a collective in bytes (latency x bandwidth); a constant
is wrong on every machine but one, so the hook measures it at registration.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from sparsecomm.collectives.groups import comm_device

__all__ = ["measure_latency_bytes"]


_MAX_BYTES_PER_S = 100e9  # no link here is faster: keeps a noisy timing from pricing latency absurdly
_LATENCY_BYTES_RANGE = (1 << 10, 1 << 26)


def measure_latency_bytes(group: Optional[dist.ProcessGroup], device: torch.device = torch.device("cpu"),
                          repeats: int = 5, large_bytes: int = 4 << 20) -> float:
    """Latency of one tiny all-to-all, in bytes of a large one: the same number on every rank.

    Collective: every rank of ``group`` calls it together. Takes the median of
    ``repeats`` timings of each size (after one warm-up), then the slowest
    rank's numbers (one all-reduce), so every rank prices collectives alike.

    Returns:
        ``latency_s * bytes_per_s``: the bytes one collective's latency is worth,
        clamped to [1 KiB, 64 MiB].
    """
    n = dist.get_world_size(group)
    if n == 1:
        return 0.0
    dev = comm_device(group, device)

    def timed(nbytes: int) -> float:
        send = torch.zeros(n * max(1, nbytes // n), dtype=torch.uint8, device=dev)
        recv = torch.empty_like(send)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    tiny = timed(8 * n)
    large = timed(large_bytes)
    numbers = torch.tensor([tiny, large], dtype=torch.float64, device=dev)
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=group)
    tiny, large = numbers.tolist()
    per_byte = max((large - tiny) / (large_bytes * (n - 1) / n), 1.0 / _MAX_BYTES_PER_S)
    lo, hi = _LATENCY_BYTES_RANGE
    return min(hi, max(lo, tiny / per_byte))
