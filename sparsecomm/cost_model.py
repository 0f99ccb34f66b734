"""Bytes each synchronization scheme moves per rank (docs/DESIGN.md), for benchmarks and the classifier.

Pure arithmetic: no communication, no tensors. Also the per-host-link
formulas and the fitted time model (:class:`FittedCost`) that the cluster
benchmark's fit produces and the classifier uses when given one.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["partitioned_floor_bytes", "sharded_floor_bytes", "allgather_bytes", "dense_allreduce_bytes",
           "tree_schedule", "union_rows", "tree_bytes", "host_link_bytes", "latency_steps", "merged_rows",
           "FittedCost", "load_fitted_cost", "METHODS_ON_CLUSTER"]


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


# ---------------------------------------------------------------- the tree


def tree_schedule(world_size: int, node_size: int = 1) -> Tuple[int, List[int]]:
    """The tree's doubling size P (largest power of two <= N) and each stage's partner bit (``rank ^ bit``).

    Bits that cross nodes come first when ``node_size`` is a power of two
    dividing P (ranks of a node contiguous), so the large late stages stay
    inside a node. Ranks P..N-1 fold into ranks 0..N-P-1 before the stages.
    """
    p = 1 << (world_size.bit_length() - 1) if world_size > 0 else 1
    bits = [1 << i for i in range(p.bit_length() - 1)]
    if 1 < node_size < p and p % node_size == 0 and node_size & (node_size - 1) == 0:
        bits = [b for b in bits if b >= node_size] + [b for b in bits if b < node_size]
    return p, bits


def union_rows(ranks: float, world_size: int, k: float, union: float) -> float:
    """Rows in the union of ``ranks`` ranks' rows, interpolated between k (one rank) and U (all N).

    Power law in the number of ranks (Heaps' law): k (U/k)^(log m / log N).
    Exact when ranks' rows are disjoint (m k) or identical (k).
    """
    if k <= 0 or ranks <= 1 or world_size <= 1:
        return max(0.0, k) * min(1.0, max(0.0, ranks))
    ratio = max(1.0, union / k)
    return min(union, k * ratio ** (math.log(min(ranks, world_size)) / math.log(world_size)))


def tree_bytes(world_size: int, k: float, union: float, row_bytes: float) -> float:
    """Bytes the busiest rank sends on the tree path: sum over log2 P stages of its merged set so far.

        sum_{s < log2 P} u(2^s N/P) r  (+ (k + U) r when N is not a power of two: fold in, result out)

    u(m) is :func:`union_rows`. Disjoint rows: (N-1) k r, like an allgather;
    identical rows: log2(N) k r, against 2 (N-1)/N k r for partitioned.
    """
    n = world_size
    if n <= 1:
        return 0.0
    p, bits = tree_schedule(n)
    total = sum(union_rows((1 << s) * n / p, n, k, union) for s in range(len(bits)))
    if n != p:
        total += k + union
    return total * row_bytes


# ------------------------------------------- bytes on a host's link (clusters)

METHODS_ON_CLUSTER = ("dense", "torch", "allgather", "partitioned", "two_level", "tree")


def host_link_bytes(method: str, hosts: int, ranks_per_host: int, k: float, union: float, union_node: float,
                    num_rows: float, row_elems: int, elem_bytes: int, index_bytes: int) -> float:
    """Bytes one host puts on its link to the others, per call (ranks of a host contiguous).

    - ``dense``: ring allreduce of the V x d table, one ring edge leaves each host: 2 (N-1)/N V d b
    - ``torch`` (gloo's sparse all_reduce: ring all-gathers of int64 ids and values): (N-1) k (d b + 8)
    - ``allgather`` (ours, one all-to-all): L (N-L) k r
    - ``partitioned`` (flat): L (N-L)/N (k + U) r
    - ``two_level``: (M-1)/M (U_n + U) r
    - ``tree`` (node bits first): L sum over stages between hosts of u(ranks covered) r

    N = hosts x L ranks, r = d b + i.
    """
    n, lws, m = hosts * ranks_per_host, ranks_per_host, hosts
    r = row_elems * elem_bytes + index_bytes
    if n <= 1 or m <= 1:
        return 0.0
    if method == "dense":
        return 2 * (n - 1) / n * num_rows * row_elems * elem_bytes
    if method == "torch":
        return (n - 1) * k * (row_elems * elem_bytes + 8)
    if method == "allgather":
        return lws * (n - lws) * k * r
    if method == "partitioned":
        return lws * (n - lws) / n * (k + union) * r
    if method == "two_level":
        return (m - 1) / m * (union_node + union) * r
    if method == "tree":
        p, bits = tree_schedule(n, lws)
        covered, total = 1, 0.0
        for bit in bits:
            if bit >= lws:  # partner on another host
                total += lws * union_rows(covered * n / p, n, k, union)
            covered *= 2
        if n != p:  # folded ranks: assume they sit on other hosts
            total += (n - p) / m * (k + union)
        return total * r
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS_ON_CLUSTER}")


def latency_steps(method: str, world_size: int) -> float:
    """Messages on a call's critical path: what a per-message latency multiplies.

    dense 2(N-1) (ring), torch 3(N-1) (three ring all-gathers), allgather 2,
    partitioned 4, two-level 9, tree 2 + 2 log2 P (+4 when N is not a power of two).
    """
    n = world_size
    if n <= 1:
        return 0.0
    p, bits = tree_schedule(n)
    return {"dense": 2 * (n - 1), "torch": 3 * (n - 1), "allgather": 2, "partitioned": 4, "two_level": 9,
            "tree": 2 + 2 * len(bits) + (4 if n != p else 0)}[method]


def merged_rows(method: str, world_size: int, k: float, union: float, num_rows: float) -> float:
    """Rows a rank sorts and sums per call (the per-row compute term): received rows plus its own."""
    n = world_size
    if method == "dense":
        return num_rows
    if method in ("torch", "allgather"):
        return n * k
    if method == "partitioned":
        return k + union
    if method == "two_level":
        return 2 * (k + union)
    if method == "tree":
        p, bits = tree_schedule(n)
        return sum(2 * union_rows((1 << s) * n / p, n, k, union) for s in range(len(bits))) + k
    raise ValueError(f"unknown method {method!r}")


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

    def seconds(self, method: str, world_size: int, k: float, union: float, num_rows: float, row_elems: int,
                elem_bytes: int, index_bytes: int, union_node: Optional[float] = None) -> float:
        lws = self.ranks_per_host if world_size % max(1, self.ranks_per_host) == 0 else 1
        hosts = max(1, world_size // lws)
        a, b, c = self.terms(method, hosts, lws)
        un = union_rows(lws, world_size, k, union) if union_node is None else union_node
        link = host_link_bytes(method, hosts, lws, k, union, un, num_rows, row_elems, elem_bytes, index_bytes)
        return (a * latency_steps(method, world_size) + b * link / self.link_bytes_per_s
                + c * merged_rows(method, world_size, k, union, num_rows))

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
