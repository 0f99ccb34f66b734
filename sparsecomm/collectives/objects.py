"""Small object collectives that every rank of a group calls together: rank and size, gather, agree, barrier.

The sharded tables, the planner and ``parallelize`` use them for what is not
a row exchange: checkpoint verdicts (:func:`agree`), the shared seed
(:func:`broadcast_int`), the planner's per-rank numbers
(:func:`all_gather_objects`). A ``group`` of None
means "no peers": each helper then answers for this process alone.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from sparsecomm.collectives.launchers import detect_launcher

__all__ = ["world", "all_gather_objects", "barrier", "agree", "broadcast_int"]


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
    """Every rank's picklable ``obj``, in rank order (``[obj]`` with no peers)."""
    if group is None:
        return [obj]
    out: List[Any] = [None] * world(group)[1]
    dist.all_gather_object(out, obj, group=group)
    return out


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
