"""Which path should a sparse gradient take? A byte-based cost model, or a fitted time model (docs/DESIGN.md).

Pure arithmetic over numbers every rank agrees on (the world size, the table,
the global row counts of the last exchange), so every rank reaches the same
decision without talking.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Union

from sparsecomm.cost_model import (FittedCost, allgather_bytes, dense_allreduce_bytes, latency_steps,
                                   load_fitted_cost, partitioned_floor_bytes, tree_bytes)
from sparsecomm.types import SyncMethod

__all__ = ["Decision", "choose_method", "COLLECTIVES_PER_METHOD", "collectives"]

# Round trips each method makes; each is charged `latency_bytes` (latency x bandwidth).
# Flat partitioned: metadata (+ push counts), push, pull counts, pull.
# Allgather: metadata + one all-to-all. Torch (gloo's sparse all_reduce): an
# all-gather of sizes, of ids and of values, each several times the latency of an all-to-all.
# Tree: metadata, a count and a row message per stage, the verdict: 2 + 2 log2 N (see `collectives`).
COLLECTIVES_PER_METHOD = {SyncMethod.PARTITIONED: 4, SyncMethod.ALLGATHER: 2, SyncMethod.DENSIFY: 3,
                          SyncMethod.TORCH: 3, SyncMethod.TREE: 6}

# Which fitted cluster method prices each sync method (densify is a dense allreduce plus a 1-byte mask).
_FITTED_NAME = {SyncMethod.PARTITIONED: "partitioned", SyncMethod.ALLGATHER: "allgather",
                SyncMethod.DENSIFY: "dense", SyncMethod.TORCH: "torch", SyncMethod.TREE: "tree"}


def collectives(method: SyncMethod, world_size: int) -> float:
    """Round trips of ``method`` at ``world_size`` ranks (the tree's grow with log2 N)."""
    if method is SyncMethod.TREE:
        return latency_steps("tree", world_size)
    return COLLECTIVES_PER_METHOD[method]


@dataclass(frozen=True)
class Decision:
    """A path for one parameter, and why."""

    method: SyncMethod
    reason: str
    estimated_bytes: Dict[str, float]


def choose_method(world_size: int, num_rows: int, row_elems: int, elem_bytes: int, index_bytes: int,
                  rows_mean: float, union_rows: int, latency_bytes: float = 64 * 1024,
                  allowed: Optional[Sequence[SyncMethod]] = None,
                  fitted: Union[FittedCost, None, bool] = None) -> Decision:
    """Pick the cheapest allowed method by estimated bytes per rank, or by fitted seconds when a fit is given.

    Without a fit: cost(m) = bytes(m) + collectives(m, N) x latency_bytes.
    With one (:class:`~sparsecomm.cost_model.FittedCost`, from
    ``python -m sparsecomm.bench project --save``): its per-method latency,
    per-byte and per-row terms, over the methods it fitted.

    Args:
        world_size: N.
        num_rows: V, rows of the table.
        row_elems, elem_bytes: values per row and bytes per value.
        index_bytes: bytes per id on the wire.
        rows_mean: k, mean rows per rank after local coalescing.
        union_rows: U, rows in the union over ranks.
        latency_bytes: cost of one collective round trip, in bytes (the hook measures it).
        allowed: the methods to choose from (default: all but ``torch``, which needs gloo).
        fitted: a fitted time model; None (default) reads ``$SPARSECOMM_COST_FIT``
            when set (every rank must see the same file), False never uses one.

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
        SyncMethod.TREE.value: tree_bytes(world_size, rows_mean, union_rows, row),
    }
    allowed = [m for m in SyncMethod if m is not SyncMethod.TORCH] if allowed is None else list(allowed)
    if world_size <= 1:
        return Decision(SyncMethod.PARTITIONED, "world size 1: nothing to exchange", est)
    fit = _fit(fitted)
    priced = [m for m in allowed if fit is not None and _FITTED_NAME[m] in fit.coef]  # partitioned: see below
    density = union_rows / max(1, num_rows)
    shape = (f"(N={world_size}, k={rows_mean:.0f}, U={union_rows}, V={num_rows}, "
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
    cost = {m: est[m.value] + collectives(m, world_size) * latency_bytes for m in allowed}
    best = min(cost, key=lambda m: (cost[m], list(SyncMethod).index(m)))
    reason = (f"est. bytes/rank: partitioned {est['partitioned']:.3g}, allgather {est['allgather']:.3g}, "
              f"tree {est['tree']:.3g}, densify {est['densify']:.3g} " + shape)
    return Decision(best, reason, est)


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
