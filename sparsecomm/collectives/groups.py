"""Process-group plumbing: node subgroups, twin groups for async work, the async runner."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.bootstrap import detect_launcher

__all__ = ["group_ranks", "comm_device", "env_local_world_size", "node_groups", "twin_group", "run_async"]

_node_groups: Dict[Tuple[Tuple[int, ...], int], Tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
_twins: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
_lock = threading.Lock()


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """Global ranks of ``group`` (the default group when None), in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def comm_device(group: Optional[dist.ProcessGroup], like: torch.device) -> torch.device:
    """Device the exchange buffers live on: CPU for gloo (its all-to-all is CPU-only), else ``like``."""
    backend = dist.get_backend(group)
    return torch.device("cpu") if backend == "gloo" or like.type == "cpu" else like


def env_local_world_size() -> Optional[int]:
    """Ranks per node as the launcher tells it (torchrun, Open MPI, MPICH/Intel MPI, Slurm), or None."""
    launcher, topo = detect_launcher()  # one table of launcher variables, shared with init_distributed
    return None if launcher == "none" else topo.local_world_size


def node_groups(group: Optional[dist.ProcessGroup], local_world_size: int
                ) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Return (ranks of my node, ranks with my local rank on every node), built once and cached.

    Ranks of ``group`` are split into nodes of ``local_world_size`` consecutive
    group ranks. Every process of the default group must make the first call
    for a given (group, local_world_size) together: ``new_group`` is collective.
    """
    ranks = tuple(group_ranks(group))
    key = (ranks, local_world_size)
    with _lock:
        if key in _node_groups:
            return _node_groups[key]
        n, lws = len(ranks), local_world_size
        if lws < 1 or n % lws:
            raise ValueError(f"local_world_size={lws} does not divide the group size {n}")
        me = ranks.index(dist.get_rank())
        local = cross = None
        # Same creation order on every rank: all node groups, then all cross groups.
        for node in range(n // lws):
            g = dist.new_group([ranks[node * lws + i] for i in range(lws)])
            if me // lws == node:
                local = g
        for lr in range(lws):
            g = dist.new_group([ranks[node * lws + lr] for node in range(n // lws)])
            if me % lws == lr:
                cross = g
        _node_groups[key] = (local, cross)
        return local, cross


def twin_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """A second process group over the same ranks, for work run off the calling thread.

    Async sparse synchronization runs its collectives on a worker thread; on
    the caller's group they could interleave with the caller's own collectives
    in a different order on different ranks. The twin keeps the two streams of
    collectives apart. Collective to create: all ranks make the first call together.
    """
    ranks = tuple(group_ranks(group))
    with _lock:
        if ranks not in _twins:
            _twins[ranks] = dist.new_group(list(ranks), backend=dist.get_backend(group))
        return _twins[ranks]


class _Runner:
    """One worker thread running submitted jobs in submission order.

    Order matters: every rank submits its jobs in the same program order, and
    the jobs' collectives must meet in that order on every rank.
    """

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Tuple[Callable[[], object], torch.futures.Future]]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="sparsecomm-async", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job, fut = self._jobs.get()
            try:
                result = job()
            except BaseException as exc:  # delivered to whoever waits on the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def submit(self, job: Callable[[], object]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, fut))
        return fut


_runner: Optional[_Runner] = None


def run_async(job: Callable[[], object]) -> torch.futures.Future:
    """Run ``job`` on the sparsecomm worker thread; return a Future of its result."""
    global _runner
    with _lock:
        if _runner is None:
            _runner = _Runner()
    return _runner.submit(job)
