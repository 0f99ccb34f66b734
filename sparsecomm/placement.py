"""A table's placement as ``sparsecomm.replan`` moves it, and the module options that rebuild it elsewhere."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from sparsecomm.planner import TablePlan
from sparsecomm.sharded.embedding import ShardedEmbedding, ShardedEmbeddingBag
from sparsecomm.sharded.table import ShardedTable

__all__ = ["REPLICATE", "Where", "TableSpec", "planned_placement", "current_placement"]

REPLICATE = "replicate"


@dataclasses.dataclass(frozen=True)
class Where:
    """A table's placement: ``"replicate"`` or a scheme (``"hash"``, ``"range"``, ``"table"`` with its owner)."""

    scheme: str
    owner: Optional[int] = None

    @property
    def replicated(self) -> bool:
        return self.scheme == REPLICATE


def planned_placement(t: TablePlan) -> Where:
    """Where ``t`` places its table."""
    return Where(t.scheme, t.owner if t.scheme == "table" else None) if t.placement == "shard" else Where(REPLICATE)


def current_placement(m: nn.Module) -> Where:
    """Where table module ``m`` is now: a sharded table's scheme and owner, or replicated."""
    return Where(m.scheme, m.owner) if isinstance(m, ShardedTable) else Where(REPLICATE)


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """The module options that rebuild a table under another placement."""

    bag: bool
    num_embeddings: int
    embedding_dim: int
    padding_idx: Optional[int]
    mode: str = "mean"
    include_last_offset: bool = False
    sparse: bool = True              # of the replica (a sharded table's gradient is sparse)
    grad_reduction: str = "mean"     # of the sharded table (a replica's is DDP's mean)

    @classmethod
    def of(cls, m: nn.Module) -> "TableSpec":
        return cls(isinstance(m, (nn.EmbeddingBag, ShardedEmbeddingBag)), m.num_embeddings, m.embedding_dim,
                   m.padding_idx, getattr(m, "mode", "mean"), getattr(m, "include_last_offset", False),
                   getattr(m, "sparse", getattr(m, "replica_sparse", True)), getattr(m, "grad_reduction", "mean"))

    def sharded(self, weight: torch.Tensor, where: Where, group, seed: int, adopt: bool = False,
                agreed: bool = False) -> ShardedTable:
        """The sharded table holding this rank's rows of ``weight`` (a full table, the same on every rank);
        ``adopt``: the shard is ``weight``'s memory itself, not a copy, where it can be (a table-wise owner's
        shard of every row; a hash shard spread over it, :mod:`sparsecomm.sharded.layout`); ``agreed``: every
        rank was checked to pass the same ``where`` and ``seed`` (``replan``), so the table's own check, a
        collective, is left out."""
        common = dict(scheme=where.scheme, owner=where.owner, group=group, grad_reduction=self.grad_reduction,
                      seed=seed, dtype=weight.dtype, device=weight.device, _weight=weight, _adopt=adopt,
                      _agreed=agreed)
        if self.bag:
            table: ShardedTable = ShardedEmbeddingBag(self.num_embeddings, self.embedding_dim, self.mode,
                                                      include_last_offset=self.include_last_offset,
                                                      padding_idx=self.padding_idx, **common)
        else:
            table = ShardedEmbedding(self.num_embeddings, self.embedding_dim, self.padding_idx, **common)
        table.replica_sparse = self.sparse   # how it comes back, should it be replicated again
        return table

    def replica(self, weight: torch.Tensor) -> nn.Module:
        """The ``nn.Embedding(Bag)`` whose weight is ``weight`` (the whole table)."""
        if self.bag:
            return nn.EmbeddingBag(self.num_embeddings, self.embedding_dim, mode=self.mode, sparse=self.sparse,
                                   include_last_offset=self.include_last_offset, padding_idx=self.padding_idx,
                                   _weight=weight)
        return nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, sparse=self.sparse,
                            _weight=weight)
