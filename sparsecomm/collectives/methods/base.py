"""What a sync method supplies: how it runs and what it costs (:class:`SyncPath`).

Each method of ``sparse_allreduce`` is one file of this package that builds
one :class:`SyncPath`; the registry (``methods/__init__.py``) lists them.
Everything that needs to know the methods reads the registry: the call
(``collectives/sparse.py``: fused or one by one), the classifier (its
prices), the fitted time model (``cost_model.FittedCost``) and the
benchmarks (their method lists).

Prices are pure arithmetic over a :class:`Workload`: numbers every rank has
(the world size, the table, the global row counts of the last exchange), so
every rank prices the same and picks the same path without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from sparsecomm.cost_model import host_layout, union_rows
from sparsecomm.types import SyncMethod

__all__ = ["InputRuns", "Workload", "Latencies", "SyncPath", "exchange_latency"]


@dataclass(frozen=True)
class InputRuns:
    """What the runs path would send (``methods/runs.py``), per rank on average over the ranks.

    Attributes:
        ids_mean: n, input rows (ids before coalescing).
        runs_mean: m, runs of equal consecutive input rows (one value row each on the wire).
    """

    ids_mean: float
    runs_mean: float


@dataclass(frozen=True)
class Workload:
    """The numbers a method is priced on (the same on every rank).

    Attributes:
        world_size: N.
        num_rows: V, rows of the table.
        row_elems, elem_bytes: d values per row, b bytes per value.
        index_bytes: i, bytes per id on the wire.
        rows_mean: k, mean rows per rank after local coalescing.
        union_rows: U, rows in the union over ranks.
        ranks_per_host: L, ranks sharing a host's link (contiguous ranks);
            :attr:`lws` is the L the formulas can use (1 unless 1 < L < N divides N).
        union_node: rows in the union of one host's ranks (default:
            interpolated from k and U, :func:`~sparsecomm.cost_model.union_rows`).
        local_aggregation: the partitioned path sums inside a host first when L > 1.
        runs: the input's ids and runs per rank (None: not known, the runs path is not priced).
    """

    world_size: int
    num_rows: float
    row_elems: int
    elem_bytes: int
    index_bytes: int
    rows_mean: float
    union_rows: float
    ranks_per_host: int = 1
    union_node: Optional[float] = None
    local_aggregation: bool = True
    runs: Optional[InputRuns] = None

    @property
    def lws(self) -> int:
        return host_layout(self.world_size, self.ranks_per_host)

    @property
    def hosts(self) -> int:
        return self.world_size // self.lws

    @property
    def row_bytes(self) -> int:
        """r = d b + i: one row and its id on the wire."""
        return self.row_elems * self.elem_bytes + self.index_bytes

    @property
    def host_union(self) -> float:
        """U_n: rows in the union of one host's ranks."""
        if self.union_node is not None:
            return self.union_node
        return union_rows(self.lws, self.world_size, self.rows_mean, self.union_rows)


@dataclass(frozen=True)
class Latencies:
    """Fixed costs, in seconds, of the exchanges a method makes.

    Attributes:
        all_to_all: an all-to-all among all N ranks.
        other: one of the backend's other collectives (an all-reduce), when
            all-to-alls take a faster transport (shared memory); else the same.
        pair: an exchange between two ranks (a tree stage, a ring hop).
    """

    all_to_all: float
    other: float
    pair: float


def exchange_latency(ranks: int, world_size: int, latency_s: float, pair_latency_s: float) -> float:
    """Latency of one exchange among ``ranks`` ranks: a pair's at 2, a whole-group all-to-all's at N, linear between.

    An all-to-all posts a send and a receive per peer, so its fixed cost grows with the peers.
    """
    if ranks <= 2 or world_size <= 2:
        return pair_latency_s if ranks <= 2 else latency_s
    return pair_latency_s + (latency_s - pair_latency_s) * min(1.0, (ranks - 2) / (world_size - 2))


RunFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SyncPath:
    """One way a sparse tensor is synchronized: how it runs and what it costs.

    Attributes:
        name: the path's name (benchmarks, fitted models, logs).
        method: the :class:`SyncMethod` a caller asks for to get it.
        hierarchical: taken instead of ``method``'s flat path when the call
            aggregates inside nodes (several ranks per node).
        fused: rides in the call's shared push all-to-all
            (``collectives/fused.py``): ``push`` gives its blocks, ``pulls``
            whether owners share sums back afterwards.
        node_layout: the path's schedule depends on the ranks per node (sent
            in the metadata so that every rank checks it agrees).
        partitions: the call partitions this path's rows by owner up front.
        moves_table: moves the whole V x d table (benchmarks time it for fewer rounds).
        fitted_name: its name in a fitted time model (``benchmarks/cluster.py``'s method), if not ``name``.
        backend: the only backend the path runs on (None: any).
        baseline: what other systems do (Horovod's allgather, DDP's sparse
            all_reduce): benchmarks compare the library's own paths against these.
        compresses: with ``compression=``, its value rows travel in the
            compressed dtype (it sums them in float32 at an owner or a merge);
            a path that does not keeps the tensor's dtype on the wire.
        runs: the call keeps this path's input rows as they are (ids not
            coalesced) and one value row per run of equal consecutive rows.
        run: ``run(rows, peers, plan) -> (ids, values)`` for a path taken one
            by one (not fused).
        push: for a fused path, ``push(rows, peers, plan) -> [FusedPush]``:
            its blocks, one :class:`FusedPush` per set of row counts.
        merge: for a fused path whose received rows the exchange does not sum:
            ``merge(rows, received, peers, plan) -> (ids, sums)``, ``received``
            holding each FusedPush's blocks' rows from every rank, in rank order.
        with_metadata: ``with_metadata(rows, plan)``: metadata and rows in one
            collective, given per-tensor capacities (None: not offered).
        round_trips: ``round_trips(workload)``: collectives per call, each
            charged one latency when prices are in bytes.
        latency: ``latency(workload, latencies)``: fixed seconds per call.
        link_bytes: ``link_bytes(workload)``: bytes on the busiest link (a
            host's when L ranks share it, else a rank's own).
        fit_steps: ``fit_steps(world_size)``: messages on the critical path (a fit's latency term).
        host_bytes: ``host_bytes(workload)``: bytes one host puts on its link (a fit's byte term).
        merged_rows: ``merged_rows(workload)``: rows a rank sorts and sums (a fit's per-row term).
    """

    name: str
    method: SyncMethod
    round_trips: Callable[[Workload], float]
    latency: Callable[[Workload, Latencies], float]
    link_bytes: Callable[[Workload], float]
    fit_steps: Callable[[int], float]
    host_bytes: Callable[[Workload], float]
    merged_rows: Callable[[Workload], float]
    hierarchical: bool = False
    fused: bool = False
    pulls: bool = False
    node_layout: bool = False
    partitions: bool = False
    moves_table: bool = False
    fitted_name: str = ""
    backend: Optional[str] = None
    baseline: bool = False
    compresses: bool = False
    runs: bool = False
    run: Optional[RunFn] = None
    push: Optional[Callable] = None
    merge: Optional[Callable] = None
    with_metadata: Optional[Callable] = None

    @property
    def fit_name(self) -> str:
        return self.fitted_name or self.name
