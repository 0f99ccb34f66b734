"""Small object collectives that every rank of a group calls together: rank and size, gather, agree, barrier.

The sharded tables, the planner and ``parallelize`` use them for what is not
a row exchange: checkpoint verdicts (:func:`agree`), the shared seed
(:func:`broadcast_int`), the planner's per-rank numbers
(:func:`all_gather_objects`). A ``group`` of None
means "no peers": each helper then answers for this process alone.
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.futures import wait_kept
from sparsecomm.collectives.launchers import detect_launcher

__all__ = ["world", "all_gather_objects", "barrier", "agree", "broadcast_int", "INLINE_BYTES"]

# Pickled bytes of an object that ride in all_gather_objects' first all-gather (a larger one takes a second).
INLINE_BYTES = 1016
_MAX_BYTES = 1 << 32   # a larger announced size is a peer's bug, not an object


def world(group: Optional[dist.ProcessGroup] = None) -> Tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialized.

    Raises:
        RuntimeError: torch.distributed is not initialized although a
            launcher started this process as one of several ranks: each rank
            would otherwise train alone, silently.
    """
    if not dist.is_available() or not dist.is_initialized():
        launcher, topo = detect_launcher()
        if topo.world_size > 1:
            raise RuntimeError(f"sparsecomm: {launcher} started this process as rank {topo.rank} of "
                               f"{topo.world_size}, but torch.distributed is not initialized: call "
                               f"sparsecomm.init_distributed() first, on every rank (alone, each rank would "
                               f"train on its own)")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` with no peers).

    On a group whose CPU tensors go through gloo, in one all-gather when
    every rank's pickled object fits in :data:`INLINE_BYTES` (a verdict, a
    few counts, a plan's placements), where ``torch.distributed.all_gather_object``
    always takes two (the sizes, then the objects); a larger object takes a
    second one, at the largest size, which every rank knows from the first.
    Elsewhere (NCCL) it is torch's.
    """
    if group is None:
        return [obj]
    n = world(group)[1]
    if not _cpu_gloo(group):
        out: List[Any] = [None] * n
        dist.all_gather_object(out, obj, group=group)
        return out
    data = pickle.dumps(obj)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    first = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
    first[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if len(data) <= INLINE_BYTES:
        first[8:8 + len(data)] = payload
    got = [torch.empty_like(first) for _ in range(n)]
    wait_kept(dist.all_gather(got, first, group=group, async_op=True), group)
    sizes = [int(g[:8].view(torch.int64)) for g in got]
    bad = next((r for r, size in enumerate(sizes) if not 0 <= size <= _MAX_BYTES), None)
    if bad is not None:   # every rank sees the same sizes: every rank raises
        raise ValueError(f"sparsecomm: rank {bad} announced a pickled object of {sizes[bad]} bytes in an all-gather of "
                         f"objects (at most {_MAX_BYTES}): a bug or a version mismatch between ranks")
    if max(sizes) > INLINE_BYTES:
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:len(data)] = payload
        got = [torch.empty_like(padded) for _ in range(n)]
        wait_kept(dist.all_gather(got, padded, group=group, async_op=True), group)
    else:
        got = [g[8:] for g in got]
    return [pickle.loads(g[:size].numpy().tobytes()) for g, size in zip(got, sizes)]


def _cpu_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` sends CPU tensors through gloo (``"gloo"``, or ``"cpu:gloo,cuda:nccl"``)."""
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    """Wait for every rank of ``group`` (no-op with no peers)."""
    if group is not None:
        dist.barrier(group=group)


def agree(error: Optional[str], group: Optional[dist.ProcessGroup], what: str) -> None:
    """Raise ``ValueError`` on every rank if any rank reports an error; else return on all.

    A rank that fails a local check alone would leave its peers waiting in the
    next collective; this turns one rank's failure into everyone's, with the
    first failing rank's message.
    """
    errors = all_gather_objects(error, group)
    for r, e in enumerate(errors):
        if e:
            prefix = "" if len(errors) == 1 else f"rank {r}: "
            raise ValueError(f"{what}: {prefix}{e}")


def broadcast_int(value: int, group: Optional[dist.ProcessGroup]) -> int:
    """Rank 0's ``value`` on every rank."""
    return int(all_gather_objects(int(value), group)[0])
