"""Process-group plumbing: node subgroups, twin groups for async work, one worker thread per group.

Every group created here gets the timeout of the group it derives from (the
one given to ``init_process_group``), not torch's 30-minute default, and is
cached once per (group, purpose): a single cache for the whole library.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.futures import job_counted

__all__ = ["group_key", "group_ranks", "group_timeout", "comm_device", "node_groups", "twin_group",
           "run_async", "forget"]

# Keyed by the group object itself (group_key), never by its ranks: a group
# and its twin have the same ranks but must not share subgroups.
_node_groups: Dict[Tuple[object, int], Tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
_twins: Dict[Tuple[object, str], dist.ProcessGroup] = {}
_lock = threading.RLock()


def group_key(group: Optional[dist.ProcessGroup]) -> object:
    """The object that stands for ``group`` in the library's caches: the group itself, the default group for None.

    Never its ranks (a group and its twin have the same ranks but must not
    share subgroups or threads), and one key for both spellings of the default group.
    """
    return dist.group.WORLD if group is None else group


def group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[datetime.timedelta]:
    """The timeout ``group``'s backend was created with (None when the backend does not say)."""
    pg = dist.group.WORLD if group is None else group
    for dev in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(dev)).options._timeout
        except Exception:  # no backend for that device, or an older torch without options
            continue
    return None


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """Global ranks of ``group`` (the default group when None), in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def comm_device(group: Optional[dist.ProcessGroup], like: torch.device) -> torch.device:
    """Device the exchange buffers live on: CPU for gloo (its all-to-all is CPU-only), else ``like``."""
    backend = dist.get_backend(group)
    return torch.device("cpu") if backend == "gloo" or like.type == "cpu" else like


def node_groups(group: Optional[dist.ProcessGroup], local_world_size: int
                ) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Return (ranks of my node, ranks with my local rank on every node), built once and cached.

    Ranks of ``group`` are split into nodes of ``local_world_size`` consecutive
    group ranks. Every process of the default group must make the first call
    for a given (group, local_world_size) together: ``new_group`` is collective.
    """
    ranks = tuple(group_ranks(group))
    key = (group_key(group), local_world_size)
    timeout = group_timeout(group)
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
            g = dist.new_group([ranks[node * lws + i] for i in range(lws)], timeout=timeout)
            if me // lws == node:
                local = g
        for lr in range(lws):
            g = dist.new_group([ranks[node * lws + lr] for node in range(n // lws)], timeout=timeout)
            if me % lws == lr:
                cross = g
        _node_groups[key] = (local, cross)
        return local, cross


def forget() -> None:
    """Drop the cached node groups and twins (after ``destroy_process_group``, which destroyed them).

    Held here they would outlive it: a later ``init_process_group`` would get
    the old twins back, and a gloo group alive at interpreter shutdown keeps
    its threads running there, where one releasing a finished collective's
    tensors aborts the process.
    """
    with _lock:
        _node_groups.clear()
        _twins.clear()
        _runners.clear()   # keyed by groups; their idle daemon threads hold nothing else


def twin_group(group: Optional[dist.ProcessGroup], purpose: str = "async") -> dist.ProcessGroup:
    """A second process group over the same ranks, for one stream of collectives of its own.

    Async sparse synchronization runs its collectives on a worker thread; on
    the caller's group they could interleave with the caller's own collectives
    in a different order on different ranks. The twin keeps the streams apart;
    each ``purpose`` (the async API, the DDP hook, sharded tables) gets its own
    twin, so no two threads ever share one. A twin of a twin is a new group.
    It inherits ``group``'s timeout. Collective to create: all ranks make the
    first call for a (group, purpose) together.
    """
    key = (group_key(group), purpose)
    with _lock:
        if key not in _twins:
            _twins[key] = dist.new_group(group_ranks(group), backend=dist.get_backend(group),
                                         timeout=group_timeout(group))
        return _twins[key]


class _Runner:
    """One worker thread running submitted jobs in submission order.

    Order matters: every rank submits its jobs in the same program order, and
    the jobs' collectives must meet in that order on every rank. A finished
    job is let go at once (its closure, its result, its future): only the
    future's holders keep what it returned. Held until the next job, which
    may come many steps later, a hook's job would keep that step's gradients
    and views of DDP's buckets alive and release them on this thread at an
    arbitrary later point.
    """

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Tuple[Callable[[], object], torch.futures.Future, Any, Callable[[], None]]]" = \
            queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="sparsecomm-async", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job, fut, stream, finished = self._jobs.get()
            try:
                self._run(job, fut, stream)
            finally:
                del job, fut   # its closure and result go now, not at the next job
                finished()     # counted since submit: the exit waits for it (sparsecomm.collectives.futures)

    @staticmethod
    def _run(job: Callable[[], object], fut: torch.futures.Future, stream) -> None:
        try:
            if stream is None:
                result = job()
            else:
                # The caller's stream: the job sees every kernel the caller
                # queued before submitting; its result is complete on return.
                with torch.cuda.stream(stream):
                    result = job()
                stream.synchronize()
        except BaseException as exc:  # delivered to whoever waits on the future
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def submit(self, job: Callable[[], object], stream) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, fut, stream, job_counted()))
        return fut


_runners: Dict[object, _Runner] = {}


def run_async(job: Callable[[], object], group: Optional[dist.ProcessGroup] = None,
              device: Optional[torch.device] = None) -> torch.futures.Future:
    """Run ``job`` on ``group``'s worker thread (one per group, jobs in submission order).

    One thread per group: jobs of two groups on one thread could meet their
    peers' in a different order and deadlock. With a CUDA ``device`` the job
    runs on the caller's current stream and the Future completes once that
    stream has finished the job's work.

    Returns:
        A Future of the job's result (or its exception).
    """
    stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None
    key = group_key(group)
    with _lock:
        if key not in _runners:
            _runners[key] = _Runner()
        runner = _runners[key]
    return runner.submit(job, stream)
