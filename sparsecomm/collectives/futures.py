"""What the library's collectives leave on torch's threads, made safe to exit past: callbacks and work objects.

A callback chained with ``Future.then`` on a collective's future runs on
the backend's own thread (gloo's worker) when the collective completes.
torch wakes whoever waits on the chained future *before* that thread lets
the callback go, and letting a Python callable go takes the GIL. If the
waiter is the main thread finishing a script (DDP's last bucket, then the
script's end), the interpreter can start finalizing first; a thread that
asks for the GIL during finalization is made to exit by unwinding through
torch's C++ frames, and the process aborts (SIGABRT, "terminate called
without an active exception"), its exit code lost. Seen here in about one
run of three of a four-rank training script over gloo on two cores; torch
has no fix (an atexit ``destroy_process_group`` was proposed upstream and
withdrawn: groups the library or DDP still hold live on).

The same holds for a Python thread of the library's (the worker of
:func:`~sparsecomm.collectives.groups.run_async`) completing a future: torch
releases the GIL inside ``set_result`` to wake the waiter, and takes it
back after; a job's collectives release it too.

Every callback the library chains goes through :func:`then`, which counts
the callbacks that have been called and not yet let go, and the worker
counts each job from its submission until its future is complete
(:func:`job_counted`). An exit handler (registered when this module is
imported) waits, with the GIL released, until nothing is counted and
nothing has been for :data:`GRACE_SECONDS`, or :data:`DRAIN_SECONDS` have
passed. The grace covers what Python cannot count: torch lets a callback
go just before the future it completes (whose value, a Python object, takes
the GIL once more when that future is the last of its chain). In a process
that never counted anything the drain returns at once. Callbacks whose future never
completes are not waited for: they are let go with their group, not at a
step's end. A forked child starts with nothing counted (none of the
parent's threads or callbacks are its).

Work objects: torch (2.13) keeps a tensor's Python object alive while C++
holds the tensor too, and lets it go when the last C++ reference beyond it
goes, which takes the GIL. A collective's work holds its tensors; when
Python has already dropped the work (every synchronous ``dist.all_reduce``
does, on return), gloo's worker drops the last reference after the
collective completed, on its own thread, possibly while the interpreter
finalizes: the same abort. The library's collectives that gloo's worker
runs on tensors of a step's size or less therefore go through :func:`keep`
(or :func:`wait_kept`): the work stays referenced from Python for the
group's next :data:`KEPT_WORKS` kept works, so that the last reference to
it goes on a Python thread, during the run, or with this module's globals
as the interpreter finishes. The cost: those tensors live a few collectives
longer. Not kept: point-to-point sends and receives (gloo completes them on
the waiting thread), barriers (no tensors), the densified path's
table-sized buffers (kept, they would pile up), and torch's own
``all_gather_object`` (NCCL groups): the exit's settling covers those.

Collectives the library does not issue (``torch.distributed.checkpoint``'s,
the user's own) cannot be kept; after the drain, the exit handler waits
until no other thread of the process is running (:func:`settle_threads`, at
most :data:`SETTLE_SECONDS`): a worker about to let a tensor go is running,
and gets the GIL while the handler sleeps. Measured: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, TypeVar

import torch
import torch.distributed as dist

__all__ = ["then", "job_counted", "unfinished", "drain", "keep", "wait_kept", "kept", "settle_threads",
           "DRAIN_SECONDS", "GRACE_SECONDS", "KEPT_WORKS", "SETTLE_SECONDS", "QUIET_SAMPLES"]

#: The most an exiting process waits for called callbacks to be let go and jobs to complete their futures.
DRAIN_SECONDS = 5.0
#: How long nothing must have been counted before the exit goes on.
GRACE_SECONDS = 0.05

T = TypeVar("T")
W = TypeVar("W")
_lock = threading.Lock()
_unfinished = 0   # callbacks called and not let go, plus jobs submitted and not done
_last_change = None   # time.monotonic() of the last change of the count (None: never counted)
#: The most an exiting process waits for its other threads to stop running (:func:`settle_threads`).
SETTLE_SECONDS = 0.5
#: Samples 1 ms apart in which no other thread may run before the exit goes on.
QUIET_SAMPLES = 3
#: How many of a group's latest works stay referenced from Python (two gloo workers run a group's works).
KEPT_WORKS = 8
_kept: Dict[int, Deque[object]] = {}   # per group (by id; None is the default group's), its latest works


class _Callback:
    """Wraps a callback; counts itself from its call until it is let go (its ``__del__``, on whichever thread
    drops it)."""

    __slots__ = ("fn", "called")

    def __init__(self, fn: Callable[[torch.futures.Future], T]) -> None:
        self.fn = fn
        self.called = False

    def __call__(self, fut: torch.futures.Future) -> T:
        if not self.called:   # torch calls a callback once; counted from then on
            self.called = True
            _count(1)
        return self.fn(fut)

    def __del__(self) -> None:
        if self.called:
            _count(-1)


def _count(delta: int) -> None:
    global _unfinished, _last_change
    with _lock:
        _unfinished += delta
        _last_change = time.monotonic()


def then(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], T]) -> torch.futures.Future:
    """``fut.then(fn)``, with ``fn`` counted until torch lets it go, so that the process's exit waits for it."""
    return fut.then(_Callback(fn))


def job_counted() -> Callable[[], None]:
    """Count a job of a library thread from now (its submission) until the returned function is called (once
    its future is complete), for the exit to wait for. Call it once."""
    _count(1)
    return lambda: _count(-1)


def keep(work: W, group: Optional[object]) -> W:
    """Keep a collective's ``work`` (from ``async_op=True``) referenced from Python for ``group``'s next
    :data:`KEPT_WORKS` kept works, so that the last reference to it never goes on the backend's thread; returns
    ``work``. ``None`` (a transport that returns no work) is returned as is."""
    if work is not None:
        key = _key(group)
        kept = _kept.get(key)
        if kept is None:
            kept = _kept.setdefault(key, collections.deque(maxlen=KEPT_WORKS))
        kept.append(work)   # a deque's append is atomic: the worker thread's jobs keep works too
    return work


def wait_kept(work: object, group: Optional[object]) -> None:
    """Wait for a collective's ``work`` (from ``async_op=True``), kept (:func:`keep`): a synchronous collective
    whose work the backend's thread cannot be the last to let go. ``None`` (torch's answer on a rank outside
    ``group``) has nothing to wait for."""
    if keep(work, group) is not None:
        work.wait()  # type: ignore[attr-defined]


def _key(group: Optional[object]) -> int:
    """Where ``group``'s works are kept: ``None`` means the default group (as to torch's collectives)."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    return id(group)


def kept(group: Optional[object]) -> List[object]:
    """``group``'s kept works, oldest first (``None``: the default group's)."""
    return list(_kept.get(_key(group), ()))


def unfinished() -> int:
    """How many callbacks chained by :func:`then` have been called and not yet let go, plus jobs submitted and
    not done."""
    with _lock:
        return _unfinished


def drain(timeout: float = DRAIN_SECONDS) -> bool:
    """Wait, with the GIL released, until nothing is counted (callbacks called and not let go, jobs not done) and
    nothing has been for :data:`GRACE_SECONDS`; at most ``timeout`` seconds. Returns whether nothing is left.
    At once when nothing was ever counted."""
    deadline = time.monotonic() + timeout
    while True:
        with _lock:
            left, last = _unfinished, _last_change
        now = time.monotonic()
        if last is None or (not left and now - last >= GRACE_SECONDS):
            return True
        if now >= deadline:
            return not left
        time.sleep(0.001)


def _running_threads() -> Optional[int]:
    """How many threads of this process besides the caller are running or runnable; None where unknown (no
    ``/proc``)."""
    me = threading.get_native_id()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    running = 0
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:   # a name is bytes, not always UTF-8
                stat = f.read()
            running += stat[stat.rindex(b")") + 2] == ord("R")   # "pid (name) S ...": the state follows the name
        except (OSError, ValueError, IndexError):
            continue   # it ended, or an unreadable line: not counted
    return running


def settle_threads(timeout: float = SETTLE_SECONDS) -> bool:
    """Wait, with the GIL released, until no other thread of the process has been running in
    :data:`QUIET_SAMPLES` samples 1 ms apart; at most ``timeout`` seconds. Returns whether they were quiet.

    For what the library cannot keep: torch's own collectives (``torch.distributed.checkpoint``'s gathers,
    ``all_gather_object``) hand tensors with Python objects to gloo's worker, which lets them go after the
    collective completed, taking the GIL. A worker about to do so is running or runnable; one waiting for the
    GIL gets it while this sleeps. Once none runs, none is left to ask for the GIL while the interpreter
    finalizes. A thread that never stops running (a busy thread of the user's) costs the exit ``timeout``."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < QUIET_SAMPLES:
        running = _running_threads()
        if running is None:
            return True
        quiet = quiet + 1 if running == 0 else 0
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def _at_exit() -> None:
    drain()
    if _kept or (dist.is_available() and dist.is_initialized()):   # a process that ran no collective: no wait
        settle_threads()


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads or pending callbacks: nothing of the count is its."""
    global _lock, _unfinished, _last_change
    _lock = threading.Lock()
    _unfinished, _last_change = 0, None


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
