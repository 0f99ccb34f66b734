"""Which path should a sparse gradient take? A bottleneck-link cost model, or a fitted time model (docs/DESIGN.md).

Pure arithmetic over numbers every rank agrees on (the world size, the table,
the global row counts of the last exchange), so every rank reaches the same
decision without talking. Each method prices itself
(:mod:`sparsecomm.collectives.methods`); this module picks the cheapest.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Union

from sparsecomm.collectives import methods
from sparsecomm.collectives.methods import InputRuns, Latencies, SyncPath, Workload, exchange_latency
from sparsecomm.collectives.probe import LinkProbe
from sparsecomm.cost_model import FittedCost, host_layout, load_fitted_cost
from sparsecomm.types import SyncMethod

__all__ = ["Decision", "choose_method", "collectives", "bottleneck_bytes", "host_layout", "method_costs",
           "latency_seconds", "exchange_latency", "path_of"]


def path_of(method: SyncMethod, world_size: int, ranks_per_host: int = 1, local_aggregation: bool = True
            ) -> SyncPath:
    """The path ``method`` takes at this layout: its hierarchical variant with L > 1 ranks per host and local aggregation."""
    return methods.path_for(method, local_aggregation and host_layout(world_size, ranks_per_host) > 1)


def _workload(world_size: int, num_rows: float, row_elems: int, elem_bytes: int, index_bytes: int,
              rows_mean: float, union_rows: float, ranks_per_host: int = 1, union_node: Optional[float] = None,
              local_aggregation: bool = True, runs: Optional[InputRuns] = None) -> Workload:
    return Workload(world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean, union_rows,
                    ranks_per_host, union_node, local_aggregation, runs)


def collectives(method: SyncMethod, world_size: int, ranks_per_host: int = 1, local_aggregation: bool = True
                ) -> float:
    """Round trips of ``method`` at ``world_size`` ranks (the tree's grow with log2 N, torch's with N)."""
    w = _workload(world_size, 0, 0, 0, 0, 0, 0, ranks_per_host, None, local_aggregation)
    return path_of(method, world_size, ranks_per_host, local_aggregation).round_trips(w)


def latency_seconds(method: SyncMethod, world_size: int, latency_s: float, pair_latency_s: Optional[float] = None,
                    ranks_per_host: int = 1, local_aggregation: bool = True,
                    backend_latency_s: Optional[float] = None) -> float:
    """Fixed cost of one call of ``method``: each of its exchanges priced by how many ranks take part.

    ``latency_s``: an all-to-all among all N ranks; ``backend_latency_s``: one
    of the backend's other collectives, when all-to-alls take a faster
    transport (default: the same); ``pair_latency_s``: an exchange between
    two ranks (default: ``backend_latency_s``, i.e. every exchange costs a
    collective). Each method's ``latency`` says what it pays.
    """
    if world_size <= 1:
        return 0.0
    backend = latency_s if backend_latency_s is None else backend_latency_s
    pair = backend if pair_latency_s is None else pair_latency_s
    w = _workload(world_size, 0, 0, 0, 0, 0, 0, ranks_per_host, None, local_aggregation)
    return path_of(method, world_size, ranks_per_host, local_aggregation).latency(w, Latencies(latency_s, backend,
                                                                                               pair))


def bottleneck_bytes(method: SyncMethod, world_size: int, num_rows: int, row_elems: int, elem_bytes: int,
                     index_bytes: int, rows_mean: float, union_rows_: float, ranks_per_host: int = 1,
                     union_node: Optional[float] = None, local_aggregation: bool = True,
                     runs: Optional[InputRuns] = None) -> float:
    """Bytes ``method`` puts on the busiest link: a host's link when L ranks share it, else a rank's own.

    With L > 1 the partitioned path is two-level when ``local_aggregation``
    is on, as in the hook. ``union_node`` (rows in the union of a host's
    ranks) defaults to the power-law interpolation
    :func:`~sparsecomm.cost_model.union_rows`. ``runs`` (the input's ids and
    runs per rank) prices the runs path; without it that path costs infinity.
    """
    w = _workload(world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean, union_rows_, ranks_per_host,
                  union_node, local_aggregation, runs)
    return path_of(method, world_size, ranks_per_host, local_aggregation).link_bytes(w)


@dataclass(frozen=True)
class Decision:
    """A path for one parameter, and why."""

    method: SyncMethod
    reason: str
    estimated_bytes: Dict[str, float]


def choose_method(world_size: int, num_rows: int, row_elems: int, elem_bytes: int, index_bytes: int,
                  rows_mean: float, union_rows: int, latency_bytes: float = 64 * 1024,
                  allowed: Optional[Sequence[SyncMethod]] = None,
                  fitted: Union[FittedCost, None, bool] = None, *, link: Optional[LinkProbe] = None,
                  ranks_per_host: Optional[int] = None, union_node: Optional[float] = None,
                  local_aggregation: bool = True, runs: Optional[InputRuns] = None) -> Decision:
    """Pick the cheapest allowed method by its time on the bottleneck link, or by fitted seconds when a fit is given.

    Without a fit: seconds(m) = m's latency + bytes on the busiest link(m) /
    that link's bytes per second. The busiest link is a host's when
    ``ranks_per_host`` L > 1 ranks share it (bytes of all L ranks to other
    hosts, :func:`bottleneck_bytes`), else a rank's own. ``link``
    (:func:`~sparsecomm.collectives.probe.measure_link`) gives the latency and
    the link's bytes/s; without it, costs are in bytes and a collective costs
    ``latency_bytes``. With a fit (:class:`~sparsecomm.cost_model.FittedCost`,
    from ``python -m sparsecomm.bench project --save``): its per-method
    latency, per-byte and per-row terms, over the methods it fitted.

    Args:
        world_size: N.
        num_rows: V, rows of the table.
        row_elems, elem_bytes: values per row and bytes per value.
        index_bytes: bytes per id on the wire.
        rows_mean: k, mean rows per rank after local coalescing.
        union_rows: U, rows in the union over ranks.
        latency_bytes: cost of one collective round trip, in bytes (used when ``link`` is None).
        allowed: the methods to choose from (default: all but those that need a particular backend).
        fitted: a fitted time model; None (default) reads ``$SPARSECOMM_COST_FIT``
            when set (every rank must see the same file), False never uses one.
        link: the measured latency and host-link bytes/s (default: price in bytes).
        ranks_per_host: L, ranks sharing a host's link (contiguous ranks); default ``link``'s, else 1.
        union_node: rows in the union of one host's ranks (default: interpolated from k and U).
        local_aggregation: the partitioned path aggregates within a host first (two-level) when L > 1.
        runs: the input's ids and runs of equal rows per rank (prices the runs path; None: it is not offered).

    Returns:
        The :class:`Decision`.
    """
    if ranks_per_host is None:
        ranks_per_host = link.ranks_per_host if link is not None else 1
    lws = host_layout(world_size, ranks_per_host)
    flat = [p for p in methods.PATHS if not p.hierarchical]
    # Bytes per rank (one rank per host), reported with the decision.
    w1 = _workload(world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean, union_rows, runs=runs)
    est = {p.method.value: p.link_bytes(w1) for p in flat}
    allowed = [p.method for p in flat if p.backend is None] if allowed is None else list(allowed)
    if world_size <= 1:
        return Decision(flat[0].method, "world size 1: nothing to exchange", est)
    fit = _fit(fitted)
    shape = _describe_workload(world_size, lws, rows_mean, union_rows, num_rows)
    fitted_paths = _fitted_paths(fit, allowed, world_size)
    if fitted_paths:
        w = _workload(world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean, union_rows, runs=runs)
        cost = {m: fit.seconds(p, w) for m, p in fitted_paths.items()}
        best = min(cost, key=lambda m: (cost[m], _order(m)))
        reason = ("fitted seconds per sync: " + ", ".join(f"{m.value} {c:.3g}" for m, c in cost.items())
                  + " (" + shape + ")")
        return Decision(best, reason, est)
    cost = method_costs(world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean, union_rows,
                        allowed, latency_bytes, link, lws, union_node, local_aggregation, runs=runs)
    if not cost:
        raise ValueError(f"choose_method: none of {[m.value for m in allowed]} can be priced "
                         f"(the runs path needs runs=InputRuns(...))")
    best = min(cost, key=lambda m: (cost[m], _order(m)))
    if link is not None:
        other = f", other collectives {link.other_latency_s * 1e3:.3g} ms" if link.backend_latency_s is not None \
            else ""
        reason = (f"estimated ms per sync: " + ", ".join(f"{m.value} {c * 1e3:.3g}" for m, c in cost.items())
                  + f" (an all-to-all costs {link.latency_s * 1e3:.3g} ms{other}, an exchange between two ranks "
                  f"{link.hop_latency_s * 1e3:.3g} ms; a host's link moves {link.bytes_per_s / 1e6:.0f} MB/s"
                  + (f", a merge sums {1e-6 / link.merge_s_per_byte:.0f} MB/s" if link.merge_s_per_byte else "")
                  + "; " + shape + ")")
    else:
        reason = (f"estimated bytes on the busiest link, a collective priced at {latency_bytes:.3g} bytes: "
                  + ", ".join(f"{m.value} {c:.3g}" for m, c in cost.items()) + " (" + shape + ")")
    return Decision(best, reason, est)


def _describe_workload(world_size: int, lws: int, rows_mean: float, union_rows: float, num_rows: int) -> str:
    """The numbers a decision was made on, in words."""
    per_host = f" ({lws} per host)" if lws > 1 else ""
    return (f"{world_size} ranks{per_host}; {rows_mean:.0f} distinct rows per rank, {union_rows:.0f} over all "
            f"ranks, of a {num_rows}-row table ({union_rows / max(1, num_rows):.1%})")


def _order(method: SyncMethod) -> int:
    # Ties go to the earlier method of SyncMethod.
    return list(SyncMethod).index(method)


def _fitted_paths(fit: Optional[FittedCost], allowed: Sequence[SyncMethod], world_size: int
                  ) -> Dict[SyncMethod, SyncPath]:
    """The path a fit prices for each allowed method it covers: hierarchical ones where its cluster has L > 1."""
    if fit is None:
        return {}
    lws = fit.ranks_per_host
    several = lws > 1 and world_size > lws and world_size % lws == 0
    out = {}
    for m in allowed:
        flat, path = methods.path_for(m), methods.path_for(m, several)
        if flat.fit_name in fit.coef:
            out[m] = path if path.fit_name in fit.coef else flat
    return out


def method_costs(world_size: int, num_rows: int, row_elems: int, elem_bytes: int, index_bytes: int,
                 rows_mean: float, union_rows_: float, allowed: Sequence[SyncMethod], latency_bytes: float = 64 * 1024,
                 link: Optional[LinkProbe] = None, ranks_per_host: int = 1, union_node: Optional[float] = None,
                 local_aggregation: bool = True, runs: Optional[InputRuns] = None) -> Dict[SyncMethod, float]:
    """The default model's cost of each allowed method: seconds with ``link``, else bytes (latency as bytes).

    With ``link``: latency + bytes on the busiest link / its rate + the
    rows the method merges x the link's measured ``merge_s_per_byte``.

    A method it cannot price (the runs path without ``runs``) is left out.
    """
    lws = host_layout(world_size, ranks_per_host)
    w = _workload(world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean, union_rows_, lws,
                  union_node, local_aggregation, runs)
    paths = {m: path_of(m, world_size, lws, local_aggregation) for m in allowed}
    if link is not None:
        # Latency, and the rows a rank sorts and sums at the measured price (the runs path merges N n rows).
        merge = link.merge_s_per_byte * row_elems * elem_bytes
        fixed = {m: latency_seconds(m, world_size, link.latency_s, link.hop_latency_s, lws, local_aggregation,
                                    link.other_latency_s) + merge * p.merged_rows(w)
                 for m, p in paths.items()}
        bps = link.bytes_per_s
    else:
        fixed = {m: collectives(m, world_size, lws, local_aggregation) * latency_bytes for m in allowed}
        bps = 1.0
    cost = {m: fixed[m] + p.link_bytes(w) / bps for m, p in paths.items()}
    return {m: c for m, c in cost.items() if math.isfinite(c)}


def _fit(fitted: Union[FittedCost, None, bool]) -> Optional[FittedCost]:
    if fitted is False:
        return None
    if isinstance(fitted, FittedCost):
        return fitted
    path = os.environ.get("SPARSECOMM_COST_FIT")
    if not path:
        return None
    if path not in _LOADED:
        _LOADED[path] = load_fitted_cost(path)
    return _LOADED[path]


_LOADED: Dict[str, Optional[FittedCost]] = {}
