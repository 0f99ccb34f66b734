"""Which rank owns which row of a sharded table, and where the row sits on its owner.

Owners come from :func:`sparsecomm.ops.row_owners` / ``partition_rows``, the
same map the sparse allreduce path uses, and the range scheme's block size from
:mod:`sparsecomm.ownership`, so "hash" and "range" mean the same thing
everywhere in sparsecomm. A row's *slot* is its index in its owner's
local shard:

- ``range``: rank ``r`` owns ``[r * range_size, (r + 1) * range_size)`` and
  ``slot = id - r * range_size``; nothing is stored.
- ``table``: rank ``owner`` holds every row (``slot = id``), the others
  none; nothing is stored. ``range_size`` stays ``ceil(V / N)``: it sizes
  the id-order chunks of checkpoints (:mod:`sparsecomm.sharded.dcp`), which
  do not depend on the scheme.
- ``hash``: the slot is the id's rank among the ids this rank owns, found
  one of two ways, whichever takes less memory:

  * a bitmap of owned ids (``V / 8`` bytes) plus the number of owned ids
    before each 64-id word (``V / 16`` bytes): ``slot = before[id // 64] +
    popcount(word & bits below id)``; a few vectorized ops on data that fits
    in cache, cheaper than a binary search, chosen while
    ``3V / 16 <= 4V / N`` bytes, i.e. up to 21 ranks;
  * past that, the sorted list of owned ids (``V / N`` ids of 4 bytes, or 8
    past 2**31 rows) and ``slot = searchsorted(owned, id)``: memory stays ~V/N.

  Both are built in chunks, so building never holds more than a chunk of the
  ``V`` ids at once.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from sparsecomm import ops, ownership
from sparsecomm.types import PartitionScheme

__all__ = ["RowLayout"]

_BUILD_CHUNK = 1 << 20


_POPCOUNT_BYTE = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def _popcount(words: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 word (int64), through a byte table."""
    table = _POPCOUNT_BYTE.to(words.device)
    return table[words.contiguous().view(torch.uint8).view(-1, 8).long()].sum(dim=1)


class RowLayout:
    """Row ownership of one table on one rank.

    Args:
        num_embeddings: table rows ``V``.
        world_size: number of owners ``N``.
        rank: this rank.
        scheme: ``"hash"`` (balanced under Zipf skew), ``"range"`` (contiguous blocks) or ``"table"``
            (every row on ``owner``).
        owner: the table scheme's owner rank (required by it; the other schemes take None).
        device: where the ownership map (hash) lives and where
            :meth:`owned_ids` returns its ids; :meth:`slots` and :meth:`owns`
            accept ids on any device and answer on the ids' device.

    Raises:
        ValueError: a bad size, rank, scheme or owner.
    """

    __slots__ = ("num_embeddings", "world_size", "rank", "scheme", "owner", "range_size", "num_local", "device",
                 "_owned", "_start", "_bits", "_before")

    def __init__(self, num_embeddings: int, world_size: int, rank: int, scheme: str = "hash",
                 device: Optional[torch.device] = None, owner: Optional[int] = None) -> None:
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise ValueError(f"num_embeddings must be a positive int, got {num_embeddings!r}")
        if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        self.num_embeddings = num_embeddings
        self.world_size = world_size
        self.rank = rank
        self.scheme = ownership.scheme_of(scheme).value
        if self.scheme == PartitionScheme.TABLE:
            ownership.owner_range_size(self.scheme, world_size, num_embeddings, owner=owner)  # checks the owner
        elif owner is not None:
            raise ValueError(f"owner is the table scheme's; scheme={self.scheme!r} takes owner=None, got {owner!r}")
        self.owner = owner
        self.range_size = ownership.range_size(num_embeddings, world_size)
        self._owned: Optional[torch.Tensor] = None
        self._bits: Optional[torch.Tensor] = None
        self._before: Optional[torch.Tensor] = None
        self._start = 0
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.device = device
        if self.scheme == PartitionScheme.TABLE:
            self.num_local = num_embeddings if rank == owner else 0
        elif self.scheme == PartitionScheme.RANGE:
            self._start = min(num_embeddings, rank * self.range_size)
            self.num_local = min(num_embeddings, self._start + self.range_size) - self._start
        elif 3 * num_embeddings // 16 <= 4 * num_embeddings // world_size:
            self._build_bitmap(device)
            self.num_local = int(self._before[-1]) + int(_popcount(self._bits[-1:]).item()) if len(self._bits) \
                else 0
        else:
            self._owned = self._build_owned(device)
            self.num_local = int(self._owned.numel())

    def _owned_mask_chunks(self, device: torch.device):
        for lo in range(0, self.num_embeddings, _BUILD_CHUNK):
            ids = torch.arange(lo, min(self.num_embeddings, lo + _BUILD_CHUNK), dtype=torch.int64, device=device)
            yield ids, self.owners(ids) == self.rank

    def _build_owned(self, device: torch.device) -> torch.Tensor:
        dtype = torch.int32 if self.num_embeddings <= 2**31 - 1 else torch.int64
        parts = [ids[mask].to(dtype) for ids, mask in self._owned_mask_chunks(device)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)

    def _build_bitmap(self, device: torch.device) -> None:
        words = []
        weights = torch.bitwise_left_shift(torch.ones(64, dtype=torch.int64, device=device),
                                           torch.arange(64, device=device))
        for _, mask in self._owned_mask_chunks(device):
            pad = -mask.numel() % 64
            if pad:
                mask = torch.cat([mask, mask.new_zeros(pad)])
            # Distinct powers of two: their sum is their bitwise or (bit 63 included, as INT64_MIN).
            words.append((mask.view(-1, 64).long() * weights).sum(dim=1))
        self._bits = torch.cat(words)
        counts = _popcount(self._bits)
        self._before = (torch.cumsum(counts, 0) - counts).to(torch.int32 if self.num_embeddings < 2**31
                                                             else torch.int64)

    # ------------------------------------------------------------------ maps

    @property
    def owner_map(self) -> Dict[str, Any]:
        """The owner-map keywords of :mod:`sparsecomm.ops` for this layout (``range_size``, ``owner``)."""
        return {"range_size": self.range_size, "owner": self.owner}

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """Owner rank of each id (int64), under this layout's scheme and world size."""
        return ops.row_owners(ids.contiguous(), self.world_size, self.scheme, self.num_embeddings, **self.owner_map)

    def partition(self, ids: torch.Tensor) -> ops.Partition:
        """Group ids by owner (see :func:`sparsecomm.ops.partition_rows`)."""
        return ops.partition_rows(ids.contiguous(), None, self.world_size, self.scheme, self.num_embeddings,
                                  **self.owner_map)

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Local slots (int64, on ``ids``' device) of ids this rank owns; the ids must be owned here.

        Check foreign ids with :meth:`owns` first: an id owned elsewhere gets
        some other row's slot.
        """
        where = ids.device
        ids = ids.to(device=self.device, dtype=torch.int64)
        if self._bits is not None:
            word = ids >> 6
            below = torch.bitwise_left_shift(torch.ones_like(ids), ids & 63) - 1
            out = self._before[word].to(torch.int64) + _popcount(self._bits[word] & below)
        elif self._owned is None:
            out = ids - self._start
        else:
            out = torch.searchsorted(self._owned, ids.to(self._owned.dtype)).to(torch.int64)
        return out.to(where)

    def owns(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether this rank owns each id (bool, on ``ids``' device); ids outside ``[0, V)`` are not owned."""
        where = ids.device
        ids = ids.to(device=self.device, dtype=torch.int64)
        inside = (ids >= 0) & (ids < self.num_embeddings)
        if self._owned is None and self._bits is None:
            return ((ids >= self._start) & (ids < self._start + self.num_local)).to(where)
        safe = torch.where(inside, ids, torch.zeros_like(ids))  # index the map only with ids inside the table
        if self._bits is not None:
            hit = ((self._bits[safe >> 6] >> (safe & 63)) & 1).bool()
        else:
            pos = torch.searchsorted(self._owned, safe.to(self._owned.dtype)).clamp_(max=max(self.num_local - 1, 0))
            hit = self._owned[pos].to(torch.int64) == safe if self.num_local else torch.zeros_like(inside)
        return (inside & hit).to(where)

    def owned_ids(self) -> torch.Tensor:
        """The ids this rank owns, in slot order (int64, on the layout's device)."""
        if self._bits is not None:
            parts = []
            shifts = torch.arange(64, device=self._bits.device)
            step = _BUILD_CHUNK // 64
            for w0 in range(0, len(self._bits), step):
                block = self._bits[w0:w0 + step]
                set_bits = ((block[:, None] >> shifts) & 1).bool().view(-1)
                parts.append(set_bits.nonzero().view(-1) + w0 * 64)
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=self.device)
        if self._owned is None:
            return torch.arange(self._start, self._start + self.num_local, dtype=torch.int64, device=self.device)
        return self._owned.to(torch.int64)

    # --------------------------------------------------------------- describe

    @property
    def nbytes(self) -> int:
        """Bytes the ownership map itself takes on this rank."""
        return sum(t.numel() * t.element_size() for t in (self._owned, self._bits, self._before) if t is not None)

    def describe(self) -> Dict[str, Any]:
        """A plain dict of the layout (saved with shards; compared on load)."""
        return {"num_embeddings": self.num_embeddings, "world_size": self.world_size, "rank": self.rank,
                "scheme": self.scheme, "owner": self.owner, "range_size": self.range_size, "num_local": self.num_local}

    def __repr__(self) -> str:
        owner = f", owner={self.owner}" if self.owner is not None else ""
        return (f"RowLayout(num_embeddings={self.num_embeddings}, world_size={self.world_size}, rank={self.rank}, "
                f"scheme={self.scheme!r}{owner}, num_local={self.num_local})")
