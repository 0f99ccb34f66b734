"""Future callbacks a process can exit past: ``then`` for the library's ``Future.then`` calls, drained at exit.

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
counts each job from its start until its future is complete
(:func:`working`). An exit handler (registered when this module is
imported) waits, with the GIL released, until nothing is counted or
:data:`DRAIN_SECONDS` have passed. Callbacks whose future never completes
are not waited for: they are let go with their group, not at a step's end.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from typing import Callable, Iterator, TypeVar

import torch

__all__ = ["then", "working", "unfinished", "drain", "DRAIN_SECONDS"]

#: The most an exiting process waits for called callbacks to be let go and jobs to complete their futures.
DRAIN_SECONDS = 5.0

T = TypeVar("T")
_lock = threading.Lock()
_unfinished = 0   # callbacks called and not let go, plus jobs under way


class _Callback:
    """Wraps a callback; counts itself from its call until it is let go (its ``__del__``, on whichever thread
    drops it)."""

    __slots__ = ("fn", "called")

    def __init__(self, fn: Callable[[torch.futures.Future], T]) -> None:
        self.fn = fn
        self.called = False

    def __call__(self, fut: torch.futures.Future) -> T:
        with _lock:
            first = not self.called
            self.called = True
        if first:
            _count(1)
        return self.fn(fut)

    def __del__(self) -> None:
        if self.called:
            _count(-1)


def _count(delta: int) -> None:
    global _unfinished
    with _lock:
        _unfinished += delta


def then(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], T]) -> torch.futures.Future:
    """``fut.then(fn)``, with ``fn`` counted until torch lets it go, so that the process's exit waits for it."""
    return fut.then(_Callback(fn))


@contextlib.contextmanager
def working() -> Iterator[None]:
    """Count a library thread's job, from its start until its future is complete, for the exit to wait for."""
    _count(1)
    try:
        yield
    finally:
        _count(-1)


def unfinished() -> int:
    """How many callbacks chained by :func:`then` have been called and not yet let go, plus jobs under way."""
    with _lock:
        return _unfinished


def drain(timeout: float = DRAIN_SECONDS) -> bool:
    """Wait, with the GIL released, until every called callback has been let go and every job has completed
    its future (at most ``timeout`` seconds). Returns whether nothing is left."""
    deadline = time.monotonic() + timeout
    while unfinished():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


atexit.register(drain)
