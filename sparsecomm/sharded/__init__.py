"""Sharded (parameter-server) embeddings: row-sharded tables, owner-side optimizers, resharding checkpoints.

Each rank stores only the rows it owns (~V/N) and their optimizer state;
lookups pull rows from their owners and backward pushes the gradients back
(docs/DESIGN.md, "Sharded mode"). See :class:`ShardedEmbedding`.
"""

from sparsecomm.sharded.checkpoint import CheckpointError, export_full, load, save, verify
from sparsecomm.sharded.embedding import ShardedEmbedding, ShardedEmbeddingBag, prefetch
from sparsecomm.sharded.hot import HotRowConfig
from sparsecomm.sharded.layout import RowLayout
from sparsecomm.sharded.lookup import TableSet
from sparsecomm.sharded.model import flush, group_tables, sharded_modules
from sparsecomm.sharded.optimizer import ShardedAdagrad, ShardedAdam, ShardedOptimizer, ShardedSGD
from sparsecomm.sharded.pending import Prefetched

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "ShardedOptimizer", "ShardedSGD", "ShardedAdagrad",
           "ShardedAdam", "HotRowConfig", "RowLayout", "sharded_modules",
           "TableSet", "group_tables", "flush", "prefetch", "Prefetched", "save", "load", "verify", "export_full",
           "CheckpointError"]
