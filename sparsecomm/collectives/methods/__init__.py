"""The sync methods of ``sparse_allreduce``: one file each, one line each in ``PATHS``.

Each file builds one :class:`~sparsecomm.collectives.methods.base.SyncPath`
(its algorithm, exactness and trust in its docstring; how it runs; what it
costs). The call, the classifier, the fitted time model and the benchmarks
read this registry; none of them names a method. A new method: a file here,
its :class:`~sparsecomm.types.SyncMethod` member, one line in ``PATHS``
(and its tests and a line in docs/DESIGN.md).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from sparsecomm.collectives.methods import allgather, densify, partitioned, runs, torch_sparse, tree, two_level
from sparsecomm.collectives.methods.base import InputRuns, Latencies, SyncPath, Workload, exchange_latency
from sparsecomm.types import SyncMethod

__all__ = ["PATHS", "SyncPath", "Workload", "InputRuns", "Latencies", "exchange_latency", "path_for", "by_name",
           "flat_paths"]

# In SyncMethod's order (ties in a price go to the earlier one), hierarchical variants after.
PATHS = (
    partitioned.PATH,
    allgather.PATH,
    densify.PATH,
    torch_sparse.PATH,
    tree.PATH,
    runs.PATH,
    two_level.PATH,
)

_FLAT: Dict[SyncMethod, SyncPath] = {p.method: p for p in PATHS if not p.hierarchical}
_HIERARCHICAL: Dict[SyncMethod, SyncPath] = {p.method: p for p in PATHS if p.hierarchical}
_BY_NAME: Dict[str, SyncPath] = {p.name: p for p in PATHS}
_BY_NAME.update({p.fit_name: p for p in PATHS})


def path_for(method: SyncMethod, hierarchical: bool = False) -> SyncPath:
    """The path a tensor on ``method`` takes: its hierarchical variant when the call aggregates in nodes and one exists."""
    method = SyncMethod(method)
    if hierarchical and method in _HIERARCHICAL:
        return _HIERARCHICAL[method]
    return _FLAT[method]


def by_name(name: str) -> SyncPath:
    """The path with this name (or this fitted name).

    Raises:
        ValueError: no path has it (the message lists the names).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown sync path {name!r}; expected one of {[p.name for p in PATHS]}") from None


def flat_paths(methods: Sequence[SyncMethod]) -> List[SyncPath]:
    """The flat path of each method."""
    return [path_for(m) for m in methods]
