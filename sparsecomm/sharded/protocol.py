"""What a lookup round needs of a sharded table, and what a table needs of the set whose rounds it joins.

The round (:class:`sparsecomm.sharded.lookup.TableSet` and the requester /
owner halves beside it) uses a table through :class:`LookupTable` only; the
sharded tables (:class:`sparsecomm.sharded.table.ShardedTable`) implement it.
A table's lookups reach their set through :class:`LookupRounds`, which
``TableSet`` implements. Neither side reads the other's private members.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.sharded.hot import HotRows
from sparsecomm.sharded.layout import RowLayout
from sparsecomm.types import SparseSyncStats

__all__ = ["LookupTable", "LookupRounds"]


class LookupRounds(Protocol):
    """The rounds a table's lookups join (``TableSet``)."""

    def submit(self, lookup: Any) -> torch.Tensor:
        """Add a lookup to the open round; its result, or a placeholder (lazy set)."""

    def run(self, lookup: Any) -> torch.Tensor:
        """Run a lookup now, with any already open; its real result."""

    def flush(self) -> None:
        """Run the open round (collective)."""

    def settle(self) -> None:
        """Run the open round and push a pending deferred gradient (collective)."""

    def push_deferred(self) -> None:
        """Push and apply a gradient a ``defer=True`` optimizer left pending (collective)."""

    def prefetch(self, lookups: Sequence[Any]) -> None:
        """Start the id exchange of a round now (collective)."""


class LookupTable(Protocol):
    """One sharded table as a lookup round sees it.

    Attributes:
        num_embeddings, embedding_dim: table shape.
        padding_idx: the row that never gets a gradient, or None.
        grad_reduction: ``"mean"`` (owners divide by the world size) or ``"sum"``.
        owner_pooling: ``"auto"``, ``"bytes"``, ``"always"`` or ``"never"``
            (who pools a bag lookup; ``"never"`` for tables without bags).
        layout: owners and slots of the rows.
        stats: the table's own counters (lookups by path, rows in).
        hot: the replicated hot rows, or None.
        local_weight: the rows this rank owns.
        table_set: the set whose rounds this table's lookups join.
    """

    num_embeddings: int
    embedding_dim: int
    padding_idx: Optional[int]
    grad_reduction: str
    owner_pooling: str
    layout: RowLayout
    stats: SparseSyncStats
    hot: Optional[HotRows]
    local_weight: torch.Tensor
    table_set: LookupRounds

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The dedicated group the table exchanges over (None: no peers)."""

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype the table's rows and gradient rows travel in between ranks, or None: its own."""

    @property
    def optimizer(self) -> Optional[Any]:
        """The attached sharded optimizer (``fused``, ``defer``, ``apply_rows``...), or None."""

    def fingerprint(self) -> Tuple[int, ...]:
        """Ints every rank's lookup of this table must agree on."""

    def padding_position(self, unique: torch.Tensor) -> Optional[int]:
        """Position of the padding row among a round's sorted unique ids, or None."""

    def owner_gradient(self, slots: torch.Tensor, requested: torch.Tensor, rows: torch.Tensor,
                       coalesced: bool = False) -> Optional[torch.Tensor]:
        """The sparse gradient of ``local_weight`` from the rows pushed to this owner (None: applied, fused)."""

    def hot_gradient(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Take the hot rows' gradient, summed over ranks (applied now when fused, else kept for ``step()``)."""
