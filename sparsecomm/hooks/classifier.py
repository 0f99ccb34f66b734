"""Which path should a sparse gradient take? A byte-based cost model (docs/DESIGN.md).

Pure arithmetic over numbers every rank agrees on (the world size, the table,
the global row counts of the last exchange), so every rank reaches the same
decision without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from sparsecomm.cost_model import allgather_bytes, dense_allreduce_bytes, partitioned_floor_bytes
from sparsecomm.types import SyncMethod

__all__ = ["Decision", "choose_method", "COLLECTIVES_PER_METHOD"]

# Round trips each method makes; each is charged `latency_bytes` (latency x bandwidth).
# Flat partitioned: metadata (+ push counts), push, pull counts, pull.
# Allgather: metadata + one all-to-all. Torch (gloo's sparse all_reduce): an
# all-gather of sizes, of ids and of values, each several times the latency of an all-to-all.
COLLECTIVES_PER_METHOD = {SyncMethod.PARTITIONED: 4, SyncMethod.ALLGATHER: 2, SyncMethod.DENSIFY: 3,
                          SyncMethod.TORCH: 3}


@dataclass(frozen=True)
class Decision:
    """A path for one parameter, and why."""

    method: SyncMethod
    reason: str
    estimated_bytes: Dict[str, float]


def choose_method(world_size: int, num_rows: int, row_elems: int, elem_bytes: int, index_bytes: int,
                  rows_mean: float, union_rows: int, latency_bytes: float = 64 * 1024,
                  allowed: Optional[Sequence[SyncMethod]] = None) -> Decision:
    """Pick the cheapest of partitioned / allgather / densify by estimated bytes per rank.

    Args:
        world_size: N.
        num_rows: V, rows of the table.
        row_elems, elem_bytes: values per row and bytes per value.
        index_bytes: bytes per id on the wire.
        rows_mean: k, mean rows per rank after local coalescing.
        union_rows: U, rows in the union over ranks.
        latency_bytes: cost of one collective round trip, in bytes (the hook measures it).
        allowed: the methods to choose from (default: all but ``torch``, which needs gloo).

    Returns:
        The :class:`Decision`.
    """
    row = row_elems * elem_bytes + index_bytes
    est = {
        SyncMethod.PARTITIONED.value: partitioned_floor_bytes(world_size, rows_mean, union_rows, row),
        SyncMethod.ALLGATHER.value: allgather_bytes(world_size, rows_mean, row),
        # the table plus a one-byte row mask
        SyncMethod.DENSIFY.value: dense_allreduce_bytes(world_size, num_rows, row_elems * elem_bytes + 1, 1),
        # gloo gathers every rank's ids as int64 and its values
        SyncMethod.TORCH.value: allgather_bytes(world_size, rows_mean, row_elems * elem_bytes + 8),
    }
    allowed = [m for m in SyncMethod if m is not SyncMethod.TORCH] if allowed is None else list(allowed)
    if world_size <= 1:
        return Decision(SyncMethod.PARTITIONED, "world size 1: nothing to exchange", est)
    cost = {m: est[m.value] + COLLECTIVES_PER_METHOD[m] * latency_bytes for m in allowed}
    best = min(cost, key=lambda m: (cost[m], list(SyncMethod).index(m)))
    density = union_rows / max(1, num_rows)
    reason = (f"est. bytes/rank: partitioned {est['partitioned']:.3g}, allgather {est['allgather']:.3g}, "
              f"densify {est['densify']:.3g} (N={world_size}, k={rows_mean:.0f}, U={union_rows}, V={num_rows}, "
              f"union density {density:.2%})")
    return Decision(best, reason, est)
