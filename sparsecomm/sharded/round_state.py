"""What a lookup round carries from its request to its rows and its backward (:class:`RoundState`).

A round (:mod:`sparsecomm.sharded.lookup`) is requested, possibly early
(prefetch), then finished when its results are needed, and its gradient is
pushed in backward, or later, riding in the next round's request
(:class:`DeferredPush`, optimizers with ``defer=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, NamedTuple, Optional, Sequence

import torch

from sparsecomm.collectives.sharded_exchange import Carry, PendingRequest, Routes
from sparsecomm.collectives.sharded_wire import InputStatus
from sparsecomm.sharded.pending import Lookup
from sparsecomm.sharded.requester import TableRound

__all__ = ["DeferredPush", "RoundState"]


class DeferredPush(NamedTuple):
    """A round's gradient rows whose push waits for the next round's request (optimizers with ``defer=True``)."""

    tables: List[TableRound]      # the round's owner-side records (where each gradient row goes)
    pushing: List[bool]           # per table: whether it gets a gradient (the same on every rank)
    routes: Routes                # the round's routes: rows_send / rows_recv count the gradient rows per peer
    rows: List[torch.Tensor]      # per table, the gradient rows, those for each owner consecutive
    # Per table, its optimizer when it was deferred: held strongly (a table holds it weakly), so an update
    # whose step() ran lands even when the user dropped the optimizer meanwhile.
    optimizers: List[Any]

    def carry(self) -> Carry:
        """The rows as a request carries them."""
        return Carry(self.rows, self.routes.rows_send, self.routes.rows_recv)


@dataclass
class RoundState:
    """One round from its request to its rows (what prefetch, flush and the round's autograd pass along).

    Attributes:
        lookups: the round's lookups, in submission order.
        status: the first bad input among them, or OK (then every rank raises when the round runs).
        grad: whether any lookup records autograd (the round then awaits its backward).
        tables: per table of the set, what the round keeps of it (made with the request).
        pending: the started request, until the round finishes it.
        deferred: an earlier backward's gradient rows that ride in this round's request.
    """

    lookups: List[Lookup]
    status: InputStatus = InputStatus()
    grad: bool = False
    tables: List[TableRound] = field(default_factory=list)
    pending: Optional[PendingRequest] = None
    deferred: Optional[DeferredPush] = None

    @classmethod
    def of(cls, lookups: Sequence[Lookup]) -> "RoundState":
        bad = next((lk.status for lk in lookups if not lk.status.ok), None)
        return cls(list(lookups), bad or InputStatus())
