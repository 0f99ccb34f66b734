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

Every callback the library chains goes through :func:`then`, which counts
the callbacks that have been called and not yet let go. An exit handler
(registered when this module is imported) waits, with the GIL released,
until that count is zero or :data:`DRAIN_SECONDS` have passed. Callbacks
whose future never completes are not waited for: they are let go with
their group, not at a step's end.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Callable, TypeVar

import torch

__all__ = ["then", "callbacks_in_flight", "drain", "DRAIN_SECONDS"]

#: The most an exiting process waits for called callbacks to be let go.
DRAIN_SECONDS = 5.0

T = TypeVar("T")
_lock = threading.Lock()
_called_not_released = 0


class _Callback:
    """Wraps a callback; counts itself from its call until it is let go (its ``__del__``, on whichever thread
    drops it)."""

    __slots__ = ("fn", "called")

    def __init__(self, fn: Callable[[torch.futures.Future], T]) -> None:
        self.fn = fn
        self.called = False

    def __call__(self, fut: torch.futures.Future) -> T:
        global _called_not_released
        with _lock:
            if not self.called:
                self.called = True
                _called_not_released += 1
        return self.fn(fut)

    def __del__(self) -> None:
        global _called_not_released
        if self.called:
            with _lock:
                _called_not_released -= 1


def then(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], T]) -> torch.futures.Future:
    """``fut.then(fn)``, with ``fn`` counted until torch lets it go, so that the process's exit waits for it."""
    return fut.then(_Callback(fn))


def callbacks_in_flight() -> int:
    """How many callbacks chained by :func:`then` have been called and not yet let go."""
    with _lock:
        return _called_not_released


def drain(timeout: float = DRAIN_SECONDS) -> bool:
    """Wait, with the GIL released, until every called callback has been let go (at most ``timeout``
    seconds). Returns whether none is left."""
    deadline = time.monotonic() + timeout
    while callbacks_in_flight():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


atexit.register(drain)
