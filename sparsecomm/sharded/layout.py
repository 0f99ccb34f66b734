"""Which rank owns which row of a sharded table, and where the row sits on its owner.

Owners come from :func:`sparsecomm.ops.row_owners` / ``partition_rows``, the
same map the sparse allreduce path uses, so "hash" and "range" mean the same
thing everywhere in sparsecomm. A row's *slot* is its index in its owner's
local shard:

- ``range``: rank ``r`` owns ``[r * range_size, (r + 1) * range_size)`` and
  ``slot = id - r * range_size``; nothing is stored.
- ``hash``: rank ``r`` keeps the sorted list of ids it owns (``V / N`` ids of
  4 bytes, or 8 past 2**31 rows) and ``slot = searchsorted(owned, id)``.
  It is built in chunks, so building it never holds more than a chunk of the
  ``V`` ids at once.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from sparsecomm import ops
from sparsecomm.types import PartitionScheme

__all__ = ["RowLayout"]

_BUILD_CHUNK = 1 << 20


class RowLayout:
    """Row ownership of one table on one rank.

    Args:
        num_embeddings: table rows ``V``.
        world_size: number of owners ``N``.
        rank: this rank.
        scheme: ``"hash"`` (balanced under Zipf skew) or ``"range"`` (contiguous blocks).
        device: where the ownership list (hash) lives.

    Raises:
        ValueError: a bad size, rank or scheme.
    """

    __slots__ = ("num_embeddings", "world_size", "rank", "scheme", "range_size", "num_local", "_owned",
                 "_start")

    def __init__(self, num_embeddings: int, world_size: int, rank: int, scheme: str = "hash",
                 device: Optional[torch.device] = None) -> None:
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise ValueError(f"num_embeddings must be a positive int, got {num_embeddings!r}")
        if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        self.num_embeddings = num_embeddings
        self.world_size = world_size
        self.rank = rank
        self.scheme = PartitionScheme(scheme).value
        # ops' default for the range scheme: ceil(V / N), at least 1.
        self.range_size = max(1, -(-num_embeddings // world_size))
        self._owned: Optional[torch.Tensor] = None
        if self.scheme == "range":
            self._start = min(num_embeddings, rank * self.range_size)
            self.num_local = min(num_embeddings, self._start + self.range_size) - self._start
        else:
            self._start = 0
            self._owned = self._build_owned(device or torch.device("cpu"))
            self.num_local = int(self._owned.numel())

    def _build_owned(self, device: torch.device) -> torch.Tensor:
        dtype = torch.int32 if self.num_embeddings <= 2**31 - 1 else torch.int64
        parts = []
        for lo in range(0, self.num_embeddings, _BUILD_CHUNK):
            ids = torch.arange(lo, min(self.num_embeddings, lo + _BUILD_CHUNK), dtype=torch.int64, device=device)
            mine = ids[self.owners(ids) == self.rank]
            parts.append(mine.to(dtype))
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)

    # ------------------------------------------------------------------ maps

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """Owner rank of each id (int64), under this layout's scheme and world size."""
        return ops.row_owners(ids.contiguous(), self.world_size, self.scheme, self.num_embeddings,
                              range_size=self.range_size)

    def partition(self, ids: torch.Tensor) -> ops.Partition:
        """Group ids by owner (see :func:`sparsecomm.ops.partition_rows`)."""
        return ops.partition_rows(ids.contiguous(), None, self.world_size, self.scheme, self.num_embeddings,
                                  range_size=self.range_size)

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Local slots (int64) of ids this rank owns; the ids must be owned here."""
        if self._owned is None:
            return ids.to(torch.int64) - self._start
        return torch.searchsorted(self._owned, ids.to(self._owned.dtype)).to(torch.int64)

    def owned_ids(self) -> torch.Tensor:
        """The ids this rank owns, in slot order (int64)."""
        if self._owned is None:
            return torch.arange(self._start, self._start + self.num_local, dtype=torch.int64)
        return self._owned.to(torch.int64)

    # --------------------------------------------------------------- describe

    @property
    def nbytes(self) -> int:
        """Bytes the ownership map itself takes on this rank."""
        return 0 if self._owned is None else self._owned.numel() * self._owned.element_size()

    def describe(self) -> Dict[str, Any]:
        """A plain dict of the layout (saved with shards; compared on load)."""
        return {"num_embeddings": self.num_embeddings, "world_size": self.world_size, "rank": self.rank,
                "scheme": self.scheme, "range_size": self.range_size, "num_local": self.num_local}

    def __repr__(self) -> str:
        return (f"RowLayout(num_embeddings={self.num_embeddings}, world_size={self.world_size}, rank={self.rank}, "
                f"scheme={self.scheme!r}, num_local={self.num_local})")
