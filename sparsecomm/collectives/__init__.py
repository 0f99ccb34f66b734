"""Collectives: the only layer that calls torch.distributed."""

from sparsecomm.collectives.sparse import last_stats, sparse_allreduce

__all__ = ["sparse_allreduce", "last_stats"]
