"""Byte formulas shared by the cost models (docs/DESIGN.md), and the fitted time model.

Pure arithmetic: no communication, no tensors. Each sync method prices
itself in its own file (``collectives/methods/``) with these helpers; the
planner prices sharded rounds with them; :class:`FittedCost` is the time
model the cluster benchmark's fit produces and the classifier uses when
given one.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

__all__ = ["partitioned_floor_bytes", "sharded_floor_bytes", "allgather_bytes", "dense_allreduce_bytes",
           "union_rows", "host_layout", "FittedCost", "load_fitted_cost"]


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


def union_rows(ranks: float, world_size: int, k: float, union: float) -> float:
    """Rows in the union of ``ranks`` ranks' rows, interpolated between k (one rank) and U (all N).

    Power law in the number of ranks (Heaps' law): k (U/k)^(log m / log N).
    Exact when ranks' rows are disjoint (m k) or identical (k).
    """
    if k <= 0 or ranks <= 1 or world_size <= 1:
        return max(0.0, k) * min(1.0, max(0.0, ranks))
    ratio = max(1.0, union / k)
    return min(union, k * ratio ** (math.log(min(ranks, world_size)) / math.log(world_size)))


def host_layout(world_size: int, ranks_per_host: Optional[int]) -> int:
    """Ranks per host L the cost model can use: ``ranks_per_host`` if 1 < L < N and L divides N, else 1."""
    lws = ranks_per_host or 1
    return lws if 1 < lws < world_size and world_size % lws == 0 else 1


@dataclass(frozen=True)
class FittedCost:
    """Per-method seconds = latency x steps + per_byte x host-link bytes / link rate + per_row x rows merged.

    Fitted by ``python -m sparsecomm.bench project`` from emulated-cluster runs
    (``benchmarks/cluster.py``); ``link_bytes_per_s`` and ``ranks_per_host``
    describe the cluster it prices (they can be overridden when loading).
    ``topologies`` holds a fit per topology (``"HxR"``, from ``--per-topology``):
    a call at a topology the runs covered uses its own terms (a shared CPU
    makes latency and per-row costs depend on how many ranks share it),
    any other the pooled ``coef``.
    """

    coef: Dict[str, Tuple[float, float, float]]  # method -> (latency s, per-byte factor, per-row s)
    link_bytes_per_s: float
    ranks_per_host: int = 1
    topologies: Dict[str, Dict[str, Tuple[float, float, float]]] = field(default_factory=dict)

    def terms(self, method: str, hosts: int, ranks_per_host: int) -> Tuple[float, float, float]:
        """(latency s, per-byte factor, per-row s) of ``method`` at ``hosts`` x ``ranks_per_host``."""
        own = self.topologies.get(f"{hosts}x{ranks_per_host}", {})
        return own[method] if method in own else self.coef[method]

    def layout(self, world_size: int) -> Tuple[int, int]:
        """``(hosts, ranks per host)`` of ``world_size`` ranks on the fitted cluster's hosts."""
        lws = self.ranks_per_host if world_size % max(1, self.ranks_per_host) == 0 else 1
        return max(1, world_size // lws), lws

    def seconds(self, path: Any, workload: Any) -> float:
        """Seconds of one call of ``path`` (a ``SyncPath``) on ``workload`` (a ``Workload``), on this fit's cluster.

        latency x the path's messages + per-byte x its host-link bytes / the
        link rate + per-row x the rows it merges.
        """
        n, k, union = workload.world_size, workload.rows_mean, workload.union_rows
        hosts, lws = self.layout(n)
        a, b, c = self.terms(path.fit_name, hosts, lws)
        un = union_rows(lws, n, k, union) if workload.union_node is None else workload.union_node
        link = path.host_bytes(workload, hosts, lws, un)
        return a * path.fit_steps(n) + b * link / self.link_bytes_per_s + c * path.merged_rows(workload)

    def to_json(self) -> dict:
        return {"coef": {m: list(v) for m, v in self.coef.items()}, "link_bytes_per_s": self.link_bytes_per_s,
                "ranks_per_host": self.ranks_per_host,
                "topologies": {t: {m: list(v) for m, v in c.items()} for t, c in self.topologies.items()}}

    @staticmethod
    def from_json(obj: dict) -> "FittedCost":
        def terms(c: dict) -> Dict[str, Tuple[float, float, float]]:
            return {m: tuple(float(x) for x in v) for m, v in c.items()}

        return FittedCost(terms(obj["coef"]), float(obj["link_bytes_per_s"]), int(obj.get("ranks_per_host", 1)),
                          {t: terms(c) for t, c in obj.get("topologies", {}).items()})


def load_fitted_cost(path: Optional[str] = None) -> Optional[FittedCost]:
    """The fit in ``path`` or in ``$SPARSECOMM_COST_FIT`` (a JSON from ``sparsecomm.bench project --save``), else None."""
    path = path or os.environ.get("SPARSECOMM_COST_FIT")
    if not path:
        return None
    with open(path) as f:
        return FittedCost.from_json(json.load(f))
