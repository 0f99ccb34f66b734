"""What one backward pass of the DDP hook has in flight (:class:`StepWork`), owned by its state.

The hook holds a step's sparse buckets and synchronizes them together at the
step's last bucket (:mod:`sparsecomm.hooks.hook`); the step closes when all
of their futures have completed; tables that no rank touched get their
``.grad`` reset after DDP's finalize (:mod:`sparsecomm.hooks.unused`). This
module is that bookkeeping, behind methods, so no module mutates another's
fields. It is runtime only: a pickled state does not carry it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List

import torch
import torch.nn as nn

from sparsecomm.types import SyncMethod

__all__ = ["PendingSync", "StepWork"]


@dataclass
class PendingSync:
    """One sparse tensor waiting for the step's fused synchronization."""

    name: str
    grad: torch.Tensor
    method: SyncMethod
    path: str                                   # counter name
    call: int                                   # this parameter's sync count (classifier timing)
    finish: Callable[[torch.Tensor], Any]       # reduced tensor -> the bucket future's value
    future: torch.futures.Future = field(default_factory=torch.futures.Future)
    decide: bool = True


class StepWork:
    """One backward's bookkeeping: the sparse work held for the fused sync, its futures, tables left empty.

    Attributes:
        clears_empty: whether tables no rank touched get ``.grad = None``
            after the step (the model has sparse tables and the unused-table
            hook covers them).
    """

    __slots__ = ("clears_empty", "_held", "_futures", "_empty", "_cleanup_queued")

    def __init__(self) -> None:
        self.clears_empty = False
        self._held: List[PendingSync] = []                # synchronized together at the step's last bucket
        self._futures: List[torch.futures.Future] = []    # the step closes after all of them
        self._empty: List[nn.Parameter] = []              # tables whose synchronized gradient has no row
        self._cleanup_queued = False

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

    def take_futures(self) -> List[torch.futures.Future]:
        """The futures of the step's held work (the step closes after them); the next step starts empty."""
        futures, self._futures = self._futures, []
        return futures

    # ------------------------------------------------------- unused tables

    def note_empty(self, param: nn.Parameter) -> None:
        """``param``'s synchronized gradient has no row: reset its ``.grad`` after DDP's finalize."""
        self._empty.append(param)

    def claim_cleanup(self) -> bool:
        """True once per backward where tables are cleared: the caller queues the cleanup then."""
        if not self.clears_empty or self._cleanup_queued:
            return False
        self._cleanup_queued = True
        return True

    def end_cleanup(self) -> List[nn.Parameter]:
        """The tables noted empty this backward; the next backward may queue its cleanup again."""
        empty, self._empty = self._empty, []
        self._cleanup_queued = False
        return empty
