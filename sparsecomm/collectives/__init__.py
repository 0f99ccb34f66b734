"""Collectives: the only layer that calls torch.distributed."""

from sparsecomm.collectives.sparse import last_stats, sparse_allreduce, sparse_allreduce_coalesced

__all__ = ["sparse_allreduce", "sparse_allreduce_coalesced", "last_stats"]
