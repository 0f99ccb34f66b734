"""Which path should a sparse gradient take? A bottleneck-link cost model, or a fitted time model (docs/DESIGN.md).

Pure arithmetic over numbers every rank agrees on (the world size, the table,
the global row counts of the last exchange), so every rank reaches the same
decision without talking.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Union

from sparsecomm.collectives.probe import LinkProbe, host_layout
from sparsecomm.cost_model import (FittedCost, allgather_bytes, dense_allreduce_bytes, host_link_bytes,
                                   latency_steps, load_fitted_cost, partitioned_floor_bytes, tree_bytes,
                                   union_rows)
from sparsecomm.types import SyncMethod

__all__ = ["Decision", "choose_method", "COLLECTIVES_PER_METHOD", "collectives", "bottleneck_bytes", "host_layout",
           "method_costs", "latency_seconds", "exchange_latency"]

# Round trips each method makes; each is charged the latency of one collective.
# Flat partitioned: metadata (+ push counts), push, pull counts, pull; two-level
# (local aggregation first): 9 (``cost_model.latency_steps``). Allgather:
# metadata + one all-to-all. Densify: the allreduce and its mask. Torch
# (gloo's sparse all_reduce): three ring all-gathers (sizes, ids, values),
# N-1 hops each. Tree: metadata, a count and a row message per stage, the
# verdict: 2 + 2 log2 N (see `collectives`).
COLLECTIVES_PER_METHOD = {SyncMethod.PARTITIONED: 4, SyncMethod.ALLGATHER: 2, SyncMethod.DENSIFY: 3,
                          SyncMethod.TORCH: 3, SyncMethod.TREE: 6}

# Which fitted cluster method prices each sync method (densify is a dense allreduce plus a 1-byte mask).
_FITTED_NAME = {SyncMethod.PARTITIONED: "partitioned", SyncMethod.ALLGATHER: "allgather",
                SyncMethod.DENSIFY: "dense", SyncMethod.TORCH: "torch", SyncMethod.TREE: "tree"}


def collectives(method: SyncMethod, world_size: int, ranks_per_host: int = 1, local_aggregation: bool = True
                ) -> float:
    """Round trips of ``method`` at ``world_size`` ranks (the tree's grow with log2 N, torch's with N)."""
    if method is SyncMethod.TREE:
        return latency_steps("tree", world_size)
    if method is SyncMethod.TORCH:
        return latency_steps("torch", world_size)
    if method is SyncMethod.PARTITIONED and local_aggregation and host_layout(world_size, ranks_per_host) > 1:
        return latency_steps("two_level", world_size)
    return COLLECTIVES_PER_METHOD[method]


def exchange_latency(ranks: int, world_size: int, latency_s: float, pair_latency_s: float) -> float:
    """Latency of one exchange among ``ranks`` ranks: a pair's at 2, a whole-group all-to-all's at N, linear between.

    An all-to-all posts a send and a receive per peer; its fixed cost grows
    with the peers (measured here: a tree stage's pairwise message ~0.2-0.4
    of an 8-rank all-to-all).
    """
    if ranks <= 2 or world_size <= 2:
        return pair_latency_s if ranks <= 2 else latency_s
    return pair_latency_s + (latency_s - pair_latency_s) * min(1.0, (ranks - 2) / (world_size - 2))


def latency_seconds(method: SyncMethod, world_size: int, latency_s: float, pair_latency_s: Optional[float] = None,
                    ranks_per_host: int = 1, local_aggregation: bool = True,
                    backend_latency_s: Optional[float] = None) -> float:
    """Fixed cost of one call of ``method``: each of its exchanges priced by how many ranks take part.

    ``latency_s``: an all-to-all among all N ranks; ``backend_latency_s``: one
    of the backend's other collectives, when all-to-alls take a faster
    transport (default: the same); ``pair_latency_s``: an exchange between
    two ranks (default: ``backend_latency_s``, i.e. every exchange costs a
    collective). Allgather: 2 all-to-alls; flat partitioned: 4; two-level:
    1 + 4 among a host's L + 4 among the M hosts; tree: 2 + 2 log2 P
    pairwise stages (+4 folding when N is not a power of two); torch (gloo's
    ring all-gathers): 3 (N-1) pairwise hops; densify: an all-to-all and 2
    all-reduces.
    """
    n = world_size
    if n <= 1:
        return 0.0
    backend = latency_s if backend_latency_s is None else backend_latency_s
    pair = backend if pair_latency_s is None else pair_latency_s
    lws = host_layout(n, ranks_per_host)
    if method is SyncMethod.PARTITIONED and local_aggregation and lws > 1:
        return (latency_s + 4 * exchange_latency(lws, n, latency_s, pair)
                + 4 * exchange_latency(n // lws, n, latency_s, pair))
    if method is SyncMethod.TREE:
        steps = latency_steps("tree", n)
        return 2 * latency_s + (steps - 2) * pair
    if method is SyncMethod.TORCH:
        return latency_steps("torch", n) * pair
    if method is SyncMethod.DENSIFY:
        return latency_s + (COLLECTIVES_PER_METHOD[method] - 1) * backend
    return COLLECTIVES_PER_METHOD[method] * latency_s


def bottleneck_bytes(method: SyncMethod, world_size: int, num_rows: int, row_elems: int, elem_bytes: int,
                     index_bytes: int, rows_mean: float, union_rows_: float, ranks_per_host: int = 1,
                     union_node: Optional[float] = None, local_aggregation: bool = True) -> float:
    """Bytes ``method`` puts on the busiest link: a host's link when L ranks share it, else a rank's own.

    With one rank per host (L = 1) these are the per-rank formulas of
    :mod:`sparsecomm.cost_model`; with L > 1, ``host_link_bytes`` (the L
    ranks' bytes to other hosts, added up: they share the link), and the
    partitioned path is two-level when ``local_aggregation`` is on, as in the
    hook. ``union_node`` (rows in the union of a host's ranks) defaults to
    the power-law interpolation :func:`~sparsecomm.cost_model.union_rows`.
    """
    n, k, u = world_size, rows_mean, union_rows_
    lws = host_layout(n, ranks_per_host)
    row = row_elems * elem_bytes + index_bytes
    if method is SyncMethod.DENSIFY:  # the table plus a one-byte row mask, whatever the layout
        return dense_allreduce_bytes(n, num_rows, row_elems * elem_bytes + 1, 1)
    if lws == 1:
        return {SyncMethod.PARTITIONED: lambda: partitioned_floor_bytes(n, k, u, row),
                SyncMethod.ALLGATHER: lambda: allgather_bytes(n, k, row),
                SyncMethod.TORCH: lambda: allgather_bytes(n, k, row_elems * elem_bytes + 8),  # int64 ids
                SyncMethod.TREE: lambda: tree_bytes(n, k, u, row)}[method]()
    name = {SyncMethod.PARTITIONED: "two_level" if local_aggregation else "partitioned",
            SyncMethod.ALLGATHER: "allgather", SyncMethod.TORCH: "torch", SyncMethod.TREE: "tree"}[method]
    un = union_rows(lws, n, k, u) if union_node is None else union_node
    return host_link_bytes(name, n // lws, lws, k, u, un, num_rows, row_elems, elem_bytes, index_bytes)


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
                  local_aggregation: bool = True) -> Decision:
    """Pick the cheapest allowed method by its time on the bottleneck link, or by fitted seconds when a fit is given.

    Without a fit: seconds(m) = collectives(m, N) x latency + bytes on the
    busiest link(m) / that link's bytes per second. The busiest link is a
    host's when ``ranks_per_host`` L > 1 ranks share it (bytes of all L ranks
    to other hosts, :func:`bottleneck_bytes`), else a rank's own. ``link``
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
        allowed: the methods to choose from (default: all but ``torch``, which needs gloo).
        fitted: a fitted time model; None (default) reads ``$SPARSECOMM_COST_FIT``
            when set (every rank must see the same file), False never uses one.
        link: the measured latency and host-link bytes/s (default: price in bytes).
        ranks_per_host: L, ranks sharing a host's link (contiguous ranks); default ``link``'s, else 1.
        union_node: rows in the union of one host's ranks (default: interpolated from k and U).
        local_aggregation: the partitioned path aggregates within a host first (two-level) when L > 1.

    Returns:
        The :class:`Decision`.
    """
    if ranks_per_host is None:
        ranks_per_host = link.ranks_per_host if link is not None else 1
    lws = host_layout(world_size, ranks_per_host)
    # Bytes per rank (one rank per host), reported with the decision.
    est = {m.value: bottleneck_bytes(m, world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean,
                                     union_rows) for m in SyncMethod}
    allowed = [m for m in SyncMethod if m is not SyncMethod.TORCH] if allowed is None else list(allowed)
    if world_size <= 1:
        return Decision(SyncMethod.PARTITIONED, "world size 1: nothing to exchange", est)
    fit = _fit(fitted)
    priced = [m for m in allowed if fit is not None and _FITTED_NAME[m] in fit.coef]  # partitioned: see below
    density = union_rows / max(1, num_rows)
    shape = (f"(N={world_size}, L={lws}, k={rows_mean:.0f}, U={union_rows}, V={num_rows}, "
             f"union density {density:.2%})")
    if priced:
        # With several ranks per host the hook's partitioned path is two-level (local aggregation).
        two_level = (fit.ranks_per_host > 1 and world_size > fit.ranks_per_host
                     and world_size % fit.ranks_per_host == 0 and "two_level" in fit.coef)
        name = dict(_FITTED_NAME, **({SyncMethod.PARTITIONED: "two_level"} if two_level else {}))
        cost = {m: fit.seconds(name[m], world_size, rows_mean, union_rows, num_rows, row_elems,
                               elem_bytes, index_bytes) for m in priced}
        best = min(cost, key=lambda m: (cost[m], list(SyncMethod).index(m)))
        reason = "fitted s/call: " + ", ".join(f"{m.value} {c:.3g}" for m, c in cost.items()) + " " + shape
        return Decision(best, reason, est)
    cost = method_costs(world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean, union_rows,
                        allowed, latency_bytes, link, lws, union_node, local_aggregation)
    best = min(cost, key=lambda m: (cost[m], list(SyncMethod).index(m)))
    if link is not None:
        other = f"other collectives {link.other_latency_s * 1e3:.3g} ms, " if link.backend_latency_s is not None \
            else ""
        reason = (f"est. ms/call (all-to-all {link.latency_s * 1e3:.3g} ms, {other}"
                  f"pair {link.hop_latency_s * 1e3:.3g} ms, "
                  f"link {link.bytes_per_s / 1e6:.3g} MB/s): "
                  + ", ".join(f"{m.value} {c * 1e3:.3g}" for m, c in cost.items()) + " " + shape)
    else:
        reason = ("est. bytes on the busiest link incl. latency: "
                  + ", ".join(f"{m.value} {c:.3g}" for m, c in cost.items()) + " " + shape)
    return Decision(best, reason, est)


def method_costs(world_size: int, num_rows: int, row_elems: int, elem_bytes: int, index_bytes: int,
                 rows_mean: float, union_rows_: float, allowed: Sequence[SyncMethod], latency_bytes: float = 64 * 1024,
                 link: Optional[LinkProbe] = None, ranks_per_host: int = 1, union_node: Optional[float] = None,
                 local_aggregation: bool = True) -> Dict[SyncMethod, float]:
    """The default model's cost of each allowed method: seconds with ``link``, else bytes (latency as bytes)."""
    lws = host_layout(world_size, ranks_per_host)
    if link is not None:
        fixed = {m: latency_seconds(m, world_size, link.latency_s, link.hop_latency_s, lws, local_aggregation,
                                    link.other_latency_s)
                 for m in allowed}
        bps = link.bytes_per_s
    else:
        fixed = {m: collectives(m, world_size, lws, local_aggregation) * latency_bytes for m in allowed}
        bps = 1.0
    return {m: fixed[m] + bottleneck_bytes(m, world_size, num_rows, row_elems, elem_bytes, index_bytes, rows_mean, union_rows_,
                               lws, union_node, local_aggregation) / bps
            for m in allowed}


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
