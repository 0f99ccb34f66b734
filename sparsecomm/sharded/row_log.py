"""RowLog: which rows of one shard the library wrote since a point in time, and whether anything else wrote.

A stale replica (:mod:`sparsecomm.stale`) needs, at a table's next move, the
rows of each shard that changed since the last one. Comparing every row
with the copy reads the shard and the copy whole (a 1M x 64 table with
Adam's moments: 1.5 GB, about 0.2-0.5 s), and cannot work at all when the
shard *is* the copy's memory (a table-wise owner's shard, and a hash shard
spread over a kept replica, :mod:`sparsecomm.sharded.layout`).
A log costs one ``mask[slots] = True`` per optimizer update instead.

Trust: the log is complete only for writes it is told of (the owner-side
optimizer's updates and hot-row write-throughs, :mod:`sparsecomm.sharded.optimizer`).
Every other in-place write through torch (``copy_``, ``index_copy_``,
indexing assignment, a checkpoint load, a user's edit under ``no_grad``) bumps
the written tensor's version counter, so :meth:`RowLog.complete` is False
after it and the caller falls back to treating rows as unknown. A
replaced state tensor fails the same check (it is another object). Writes
that bypass torch's version counter (through ``.data``, ``.numpy()`` or a
raw pointer) are not seen: drop the copy (``StaleReplicas.drop``) after
such an edit.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

__all__ = ["RowLog"]


class RowLog:
    """The slots of a shard's rows written since the log began (weight and row state alike).

    Args:
        tensors: the shard's ``local_weight`` and its row-aligned optimizer state, the tensors watched.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("RowLog needs the shard's weight (and its row state) to watch")
        self._tensors = tuple(tensors)
        self._mask = torch.zeros(tensors[0].shape[0], dtype=torch.bool, device=tensors[0].device)
        self._versions = self._read(self._tensors)

    @staticmethod
    def _read(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
        return tuple(t._version for t in tensors)

    def mark(self, slots: torch.Tensor) -> None:
        """Record that rows ``slots`` (and nothing else) were just written, in the weight or the state."""
        if slots.numel():
            self._mask[slots.to(device=self._mask.device, dtype=torch.int64)] = True
        self._versions = self._read(self._tensors)

    def complete(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the log holds every write since it began: ``tensors`` (the shard's weight and state now) are
        the watched ones and no write it was not told of bumped their versions."""
        return len(tensors) == len(self._tensors) and all(a is b for a, b in zip(tensors, self._tensors)) and \
            self._read(tensors) == self._versions

    def slots(self) -> torch.Tensor:
        """The written slots, ascending (int64)."""
        return self._mask.nonzero().view(-1)
