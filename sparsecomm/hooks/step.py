"""What one backward pass of the DDP hook has in flight (:class:`StepWork`), owned by its state.

The hook holds a step's sparse buckets and synchronizes them together once
the backward's graph has run (:mod:`sparsecomm.hooks.hook`,
:mod:`sparsecomm.collectives.step_order`); the step closes after DDP's
finalize: tables that no rank touched get their ``.grad`` reset
(:mod:`sparsecomm.hooks.unused`), and an error of the step is raised. This
module is that bookkeeping, behind methods, so no module mutates another's
fields. It is runtime only: a pickled state does not carry it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from sparsecomm.types import SyncMethod

__all__ = ["PendingSync", "StepWork", "ClosedStep"]


@dataclass
class PendingSync:
    """One sparse tensor waiting for the step's fused synchronization.

    ``params`` are the parameters whose gradients it feeds and ``fallback``
    the bucket future's value when the sync fails (the step's error is then
    raised when it closes, and those gradients are reset to None).
    """

    name: str
    grad: torch.Tensor
    method: SyncMethod
    path: str                                   # counter name
    call: int                                   # this parameter's sync count (classifier timing)
    finish: Callable[[torch.Tensor], Any]       # reduced tensor -> the bucket future's value
    params: Sequence[torch.Tensor] = ()
    fallback: Optional[torch.Tensor] = None
    future: torch.futures.Future = field(default_factory=torch.futures.Future)
    decide: bool = True


class ClosedStep(NamedTuple):
    """What a step leaves when it closes."""

    error: Optional[BaseException]      # the step's first error, raised by the hook
    failed: List[torch.Tensor]          # parameters whose synchronized gradient is missing (that error)


class StepWork:
    """One backward's bookkeeping: the sparse work held for the fused sync, tables left empty, its error.

    A step opens at its first bucket (:meth:`open`) and closes once (:meth:`close`).

    Attributes:
        clears_empty: whether tables no rank touched get ``.grad = None``
            after the step (the model has sparse tables and the unused-table
            hook covers them).
        eager: this step syncs each sparse bucket as it arrives (the state
            sets it when the step opens; ``HookConfig.eager_sparse``).
    """

    __slots__ = ("clears_empty", "eager", "_held", "_futures", "_empty", "_cleanup_queued", "_task", "_open", "_lock",
                 "_error", "_failed", "_kept")

    def __init__(self) -> None:
        self.clears_empty = False
        self.eager = False
        self._lock = threading.Lock()   # errors arrive from the backend's and the worker's threads
        self._task: Optional[int] = None
        self._open = False
        self._kept: List[Any] = []   # what the last step's work touched off the hook's thread (see keep)
        self._reset()

    def _reset(self) -> None:
        self._held: List[PendingSync] = []                # synchronized together once the graph has run
        self._futures: List[torch.futures.Future] = []    # what the hook returned this step
        self._empty: List[nn.Parameter] = []              # tables whose synchronized gradient has no row
        self._cleanup_queued = False
        self._error: Optional[BaseException] = None
        self._failed: List[torch.Tensor] = []

    # ------------------------------------------------------------ the step

    def open(self, backward: Optional[int]) -> bool:
        """Open the step of backward pass ``backward`` (None: a joined rank's shadow); True at its first bucket.

        A step that never closed (its backward stopped on an error before the
        hook's jobs ran) is forgotten: its work cannot complete any more.
        What the steps before kept (:meth:`keep`) is let go of here, on the
        hook's thread.
        """
        if self._open and self._task == backward:
            return False
        with self._lock:
            self._reset()
            released, self._kept = self._kept, []
        del released
        self._task, self._open = backward, True
        return True

    def close(self) -> ClosedStep:
        """Close the step: its error and failed gradients (the empty tables: :meth:`end_cleanup`). The next
        bucket opens a new step."""
        with self._lock:
            closed = ClosedStep(self._error, self._failed)
            self._error, self._failed = None, []
        self._open = False
        return closed

    def keep(self, *objects: Any) -> None:
        """Hold ``objects`` (a bucket, its tensors, a sync's results) until the next step opens.

        A step's work runs partly off the thread DDP calls the hook on (the group's worker thread, the
        backend's callback threads), and what those threads hold they let go of whenever they finish,
        while DDP goes on with its finalize on the same tensors. Kept here, the last reference to each
        object goes at the next step's first bucket, on the hook's thread, when those threads are long done
        with it: no Python object of DDP's tensors is freed on another thread while DDP works on them (the
        cost: a step's sparse gradients live until the next backward's first bucket). Thread-safe.
        """
        with self._lock:
            self._kept.append(objects)

    def track(self, future: torch.futures.Future) -> None:
        """Count ``future`` (a bucket's) among the step's futures (held work's are counted by :meth:`hold`)."""
        if not any(f is future for f in self._futures):
            self._futures.append(future)

    def take_futures(self) -> List[torch.futures.Future]:
        """The futures of the step's work, in bucket order; the next step starts empty."""
        futures, self._futures = self._futures, []
        return futures

    def fail(self, error: BaseException, params: Sequence[torch.Tensor]) -> None:
        """Record an error of the step (the first one is raised at its close) and the parameters it leaves
        without a synchronized gradient. Thread-safe."""
        with self._lock:
            if self._error is None:
                self._error = error
            self._failed.extend(params)

    # ------------------------------------------------------------ fused sync

    def hold(self, item: PendingSync) -> torch.futures.Future:
        """Keep ``item`` for the step's fused sync; its future completes when that sync does."""
        self._held.append(item)
        self._futures.append(item.future)
        return item.future

    @property
    def has_held(self) -> bool:
        """Whether sparse work waits for the fused sync."""
        return bool(self._held)

    def take_held(self) -> List[PendingSync]:
        """The held work, in bucket order; the next sync starts empty."""
        items, self._held = self._held, []
        return items

    # ------------------------------------------------------- unused tables

    def note_empty(self, param: nn.Parameter) -> None:
        """``param``'s synchronized gradient has no row: reset its ``.grad`` after DDP's finalize."""
        self._empty.append(param)

    def claim_cleanup(self) -> bool:
        """True once per step where tables are cleared (:attr:`clears_empty`): the caller clears them then."""
        if not self.clears_empty or self._cleanup_queued:
            return False
        self._cleanup_queued = True
        return True

    def end_cleanup(self) -> List[nn.Parameter]:
        """The tables noted empty this step; the next step may claim its cleanup again."""
        empty, self._empty = self._empty, []
        self._cleanup_queued = False
        return empty
