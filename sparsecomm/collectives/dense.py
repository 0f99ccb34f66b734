"""Dense allreduce of a gradient bucket: averaged like DDP's default, optionally fp16/bf16-compressed."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from sparsecomm.collectives.futures import keep, then, wait_kept

__all__ = ["COMPRESSION_DTYPES", "all_finite", "allreduce_mean_async", "ring_allreduce_bytes", "max_over_ranks",
           "broadcast_"]

COMPRESSION_DTYPES = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def all_finite(values: torch.Tensor) -> bool:
    """True when ``values`` holds no NaN/Inf: one reduction, an exact elementwise check only if its sum is not finite.

    A NaN/Inf anywhere makes the sum non-finite; a finite-valued tensor can
    still overflow its sum, which the exact check then clears. One host
    synchronization either way.
    """
    if values.numel() == 0:
        return True
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(values.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(values).all())


def ring_allreduce_bytes(numel: int, elem_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring allreduce: 2 (N-1)/N of the buffer."""
    if world_size <= 1:
        return 0
    return int(2 * (world_size - 1) / world_size * numel * elem_bytes)


def allreduce_mean_async(buffer: torch.Tensor, group: Optional[dist.ProcessGroup],
                         compression: Optional[str] = None) -> torch.futures.Future:
    """Average ``buffer`` over ``group`` in place; return a Future of it.

    Divides before the sum (as DDP's default hook does): fp16 overflows otherwise.
    With ``compression`` "fp16"/"bf16" the bucket travels in half precision and
    is copied back into ``buffer`` (in its dtype) when the reduction completes.
    """
    if compression not in COMPRESSION_DTYPES:
        raise ValueError(f"compression must be one of {sorted(k for k in COMPRESSION_DTYPES if k)} or None, "
                         f"got {compression!r}")
    n = dist.get_world_size(group)
    wire = COMPRESSION_DTYPES[compression]
    if wire is None or wire == buffer.dtype:
        buffer.div_(n)
        fut = keep(dist.all_reduce(buffer, group=group, async_op=True), group).get_future()
        return then(fut, lambda f: f.value()[0])
    # Divide in full precision first: a value in (65504, 65504 N) fits fp16 only after the divide.
    packed = buffer.div_(n).to(wire)
    fut = keep(dist.all_reduce(packed, group=group, async_op=True), group).get_future()

    def unpack(f: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer

    return then(fut, unpack)


def max_over_ranks(values: Sequence[float], group: Optional[dist.ProcessGroup], device: torch.device) -> List[float]:
    """Each value's maximum over the ranks of ``group`` (one all-reduce of float64, under the group's timeout).

    ``device``: where the all-reduce runs (a CUDA device for NCCL groups).
    Every rank gets the same list: what a decision every rank must share
    (the slowest rank's time) is built from.
    """
    out = torch.tensor(list(values), dtype=torch.float64, device=device)
    wait_kept(dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group, async_op=True), group)
    return out.tolist()


def broadcast_(tensor: torch.Tensor, src: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s (``src`` is a global rank, as in ``dist.broadcast``)."""
    wait_kept(dist.broadcast(tensor, src, group=group, async_op=True), group)
    return tensor
