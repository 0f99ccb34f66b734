"""sparsecomm: sparsity-aware data-parallel communication for PyTorch.

Dense gradients go through allreduce; sparse (embedding) gradients through a
partitioned parameter-server path: rows pushed to their owner ranks with
all-to-all, summed there, and shared back.
"""

from sparsecomm import ops
from sparsecomm.collectives import last_stats, sparse_allreduce, sparse_allreduce_coalesced
from sparsecomm.collectives.bootstrap import init_distributed, shutdown, topology
from sparsecomm import sharded
from sparsecomm.hooks import HookConfig, SparseCommState, register, sparsecomm_hook
from sparsecomm.planner import Plan, TablePlan, plan
from sparsecomm.parallel import parallelize
from sparsecomm.replan import replan
from sparsecomm.pipeline import Pipeline, pipeline
from sparsecomm.trial import TrialConfig
from sparsecomm.sharded.combined import ParallelOptimizer
from sparsecomm.sharded import ShardedAdagrad, ShardedAdam, ShardedEmbedding, ShardedEmbeddingBag, ShardedSGD
from sparsecomm.types import PartitionScheme, SparseSyncStats, SyncMethod, Topology
from sparsecomm.version import __version__

__all__ = [
    "ops", "init_distributed", "shutdown", "topology",
    "sparse_allreduce", "sparse_allreduce_coalesced", "last_stats", "SparseSyncStats", "SyncMethod", "PartitionScheme", "Topology",
    "register", "sparsecomm_hook", "SparseCommState", "HookConfig",
    "plan", "Plan", "TablePlan", "parallelize", "replan", "pipeline", "Pipeline", "TrialConfig", "ParallelOptimizer",
    "sharded", "ShardedEmbedding", "ShardedEmbeddingBag", "ShardedSGD", "ShardedAdagrad", "ShardedAdam",
    "__version__",
]
