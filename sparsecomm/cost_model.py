"""Bytes each synchronization scheme moves per rank (docs/DESIGN.md), for benchmarks and the classifier.

Pure arithmetic: no communication, no tensors.
"""

from __future__ import annotations

__all__ = ["partitioned_floor_bytes", "sharded_floor_bytes", "allgather_bytes", "dense_allreduce_bytes"]


def partitioned_floor_bytes(world_size: int, k: float, union: float, row_bytes: float) -> float:
    """Per-rank bytes of an owner-based scheme for a replicated table: (N-1)/N (k + U) r."""
    n = world_size
    return (n - 1) / n * (k + union) * row_bytes if n > 1 else 0.0


def sharded_floor_bytes(world_size: int, k: float, row_bytes: float) -> float:
    """Per-rank bytes when a rank pulls only its own k rows (sharded table): (N-1)/N 2k r."""
    n = world_size
    return (n - 1) / n * 2 * k * row_bytes if n > 1 else 0.0


def allgather_bytes(world_size: int, k: float, row_bytes: float) -> float:
    """Per-rank bytes received by an allgather of every rank's k rows: (N-1) k r."""
    return (world_size - 1) * k * row_bytes


def dense_allreduce_bytes(world_size: int, num_rows: float, dim: int, elem_bytes: int) -> float:
    """Per-rank bytes of a ring allreduce of the whole V x d table: 2 (N-1)/N V d b."""
    n = world_size
    return 2 * (n - 1) / n * num_rows * dim * elem_bytes if n > 1 else 0.0
