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

  A *spread* hash layout (``spread=True``) keeps the ownership map but not the
  slots: ``slot = id``, and the shard has ``V`` rows of storage, of which the
  owned ones are the shard's. It is what a shard cut from a kept replica uses
  (:mod:`sparsecomm.stale`): the replica's memory becomes the shard, with
  nothing copied or allocated; the rows this rank does not own are the
  replica's stale ones, never read as the shard's. ``owned_rows`` /
  ``put_owned_rows`` give and take the owned rows in id order under either kind.

  Both come from one bitmap of owned ids (:func:`sparsecomm.ops.owned_bitmap`:
  one pass of the owner map, ``V / 8`` bytes, no ids materialized).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import torch

from sparsecomm import ops, ownership
from sparsecomm.types import PartitionScheme

__all__ = ["RowLayout"]

# The last hash layouts' bitmaps (bits, words before), by rows, world, rank and device: a placement trial builds the
# same layouts again at every move, and a bitmap is one pass of the owner map over every row. Read only, so layouts
# share them (nbytes counts them in each); kept even after their tables go: about 0.19 bytes a row each.
_BITMAPS: "OrderedDict[Tuple[Any, ...], Tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
_BITMAPS_KEPT = 16
_BITMAPS_LOCK = threading.Lock()
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
        spread: under "hash" at a world above one, ``slot = id`` over a ``V``-row
            storage (see the module docstring); ignored elsewhere, where it
            changes nothing (a world of one, or a table-wise owner, already
            has ``slot = id``) or is not offered (range: its blocks).
        device: where the ownership map (hash) lives and where
            :meth:`owned_ids` returns its ids; :meth:`slots` and :meth:`owns`
            accept ids on any device and answer on the ids' device.

    Raises:
        ValueError: a bad size, rank, scheme or owner.
    """

    __slots__ = ("num_embeddings", "world_size", "rank", "scheme", "owner", "range_size", "num_local", "device",
                 "spread",
                 "_owned", "_start", "_bits", "_before")

    def __init__(self, num_embeddings: int, world_size: int, rank: int, scheme: str = "hash",
                 device: Optional[torch.device] = None, owner: Optional[int] = None, spread: bool = False) -> None:
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
        self.spread = bool(spread) and self.scheme == PartitionScheme.HASH and world_size > 1
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

    def _build_owned(self, device: torch.device) -> torch.Tensor:
        dtype = torch.int32 if self.num_embeddings <= 2**31 - 1 else torch.int64
        bits = ops.owned_bitmap(self.num_embeddings, self.world_size, self.rank, self.scheme, **self.owner_map)
        return ops.bitmap_ids(bits, int(_popcount(bits).sum())).to(device=device, dtype=dtype)

    def _build_bitmap(self, device: torch.device) -> None:
        # One pass of the owner map over [0, V) on the CPU (sparsecomm.ops.owned_bitmap), then to the device;
        # or the same layout's, built before.
        index = torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index
        key = (self.num_embeddings, self.world_size, self.rank, self.scheme, device.type, index)
        with _BITMAPS_LOCK:
            if key not in _BITMAPS:
                bits = ops.owned_bitmap(self.num_embeddings, self.world_size, self.rank, self.scheme, **self.owner_map)
                counts = _popcount(bits)
                _BITMAPS[key] = (bits.to(device), (torch.cumsum(counts, 0) - counts).to(
                    torch.int32 if self.num_embeddings < 2**31 else torch.int64).to(device))
                if len(_BITMAPS) > _BITMAPS_KEPT:
                    _BITMAPS.popitem(last=False)
            _BITMAPS.move_to_end(key)
            self._bits, self._before = _BITMAPS[key]

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
        return ids.to(dtype=torch.int64) if self.spread else self.positions(ids)

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Each owned id's index among this rank's owned ids, ascending (int64, on ``ids``' device): its slot,
        except under a spread layout, whose slots are the ids (the index into :meth:`owned_rows`)."""
        where = ids.device
        ids = ids.to(device=self.device, dtype=torch.int64)
        if self._bits is not None and self.device.type == "cpu":
            out = ops.bitmap_positions(self._bits, self._before, ids)
        elif self._bits is not None:
            word = ids >> 6
            below = torch.bitwise_left_shift(torch.ones_like(ids), ids & 63) - 1
            out = self._before[word].to(torch.int64) + _popcount(self._bits[word] & below)
        elif self._owned is None:
            out = ids - self._start
        else:
            out = torch.searchsorted(self._owned, ids.to(self._owned.dtype)).to(torch.int64)
        return out.to(where)

    def owned_range(self) -> Optional[Tuple[int, int]]:
        """``(start, stop)`` when this rank owns exactly the ids ``[start, stop)`` (table-wise and range layouts;
        empty on a table-wise table's other ranks), else None (hash)."""
        if self._owned is None and self._bits is None:
            return self._start, self._start + self.num_local
        return None

    def owns(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether this rank owns each id (bool, on ``ids``' device); ids outside ``[0, V)`` are not owned."""
        where = ids.device
        ids = ids.to(device=self.device, dtype=torch.int64)
        if self._bits is not None and self.device.type == "cpu":
            return ops.bitmap_owns(self._bits, self.num_embeddings, ids).to(where)
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
        """The ids this rank owns, ascending (int64, on the layout's device): slot order, and under a spread
        layout the slots themselves."""
        if self._bits is not None:
            return ops.bitmap_ids(self._bits.cpu(), self.num_local).to(self.device)
        if self._owned is None:
            return torch.arange(self._start, self._start + self.num_local, dtype=torch.int64, device=self.device)
        return self._owned.to(torch.int64)

    @property
    def num_slots(self) -> int:
        """Rows of the shard's storage: ``num_local``, or ``V`` under a spread layout."""
        return self.num_embeddings if self.spread else self.num_local

    def owned_rows(self, storage: torch.Tensor) -> torch.Tensor:
        """The owned rows of ``storage`` (``num_slots`` rows: the shard, a row state), in id order: ``storage``
        itself, or under a spread layout a new tensor of its owned rows."""
        return storage.index_select(0, self.owned_ids().to(storage.device)) if self.spread else storage

    def put_owned_rows(self, storage: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Write ``rows`` (the owned rows in id order, as :meth:`owned_rows` gives them) into ``storage``."""
        if self.spread:
            return storage.index_copy_(0, self.owned_ids().to(storage.device), rows.to(storage))
        return storage.copy_(rows)

    # --------------------------------------------------------------- describe

    @property
    def nbytes(self) -> int:
        """Bytes the ownership map itself takes on this rank."""
        return sum(t.numel() * t.element_size() for t in (self._owned, self._bits, self._before) if t is not None)

    def describe(self) -> Dict[str, Any]:
        """A plain dict of the layout (saved with shards; compared on load). Whether it is spread is how this
        rank stores its rows, not which it owns: a shard saved spread loads dense, and back."""
        return {"num_embeddings": self.num_embeddings, "world_size": self.world_size, "rank": self.rank,
                "scheme": self.scheme, "owner": self.owner, "range_size": self.range_size, "num_local": self.num_local}

    def __repr__(self) -> str:
        owner = f", owner={self.owner}" if self.owner is not None else ""
        spread = ", spread=True" if self.spread else ""
        return (f"RowLayout(num_embeddings={self.num_embeddings}, world_size={self.world_size}, rank={self.rank}, "
                f"scheme={self.scheme!r}{owner}, num_local={self.num_local}{spread})")
