"""Table-wise placement: which sharded bag tables go whole on one rank, and on which.

An owner that holds a whole bag table pools whole bags, so a rank gets one
row per bag from one owner instead of a partial bag from each of the N
owners of a row-sharded table: with several tables spread over the ranks
the busiest rank moves up to N times fewer bytes (TorchRec's table-wise
sharding on CPU). :func:`place_tables` takes the planner's row-sharded bag
tables and moves those for which that pays (docs/PARALLELIZE.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = ["ROWS_SPREAD", "place_tables", "pools_at_owner", "every_bag_table_whole"]

# The planner's reason for sharding a large table by rows; a table placed whole on one rank says so instead.
ROWS_SPREAD = "1/{n} of the rows and optimizer work per rank"


def pools_at_owner(m: nn.Module) -> bool:
    """Whether an owner can pool this table's lookups (a sum or mean bag): what makes table-wise pay."""
    return isinstance(m, nn.EmbeddingBag) and m.mode in ("sum", "mean")


@dataclasses.dataclass
class _BagLoad:
    """A sharded bag table's traffic, per rank and direction per step, in bytes of pooled rows."""

    name: str
    pooled: float     # one row per bag a rank looks up: what a table-wise owner sends each other rank
    spread: float     # the chance that a bag has an id on a given owner when row-sharded over N ranks


def _pooled_bytes(t: Any) -> float:
    """A rank's pooled rows of table ``t`` a step, in bytes: its bags (the sample's, else one) x a row's bytes."""
    row = t.embedding_dim * torch.empty(0, dtype=getattr(torch, t.dtype)).element_size()
    return (t.bags if t.bags is not None else 1.0) * row


def _bag_loads(p: Any, pooled_ok: Dict[str, bool]) -> List[_BagLoad]:
    """The sharded tables that could go table-wise, largest traffic first.

    With a sample batch, its bags per rank and ids per bag; without one, one
    bag per table a step (one per sample, the usual recommendation model) of
    many ids (every owner gets a part of every bag when row-sharded).
    """
    n = p.world_size
    out = []
    for t in p.tables.values():
        if t.placement != "shard" or t.overridden or t.blocker or not pooled_ok.get(t.name):
            continue
        length = t.bag_length if t.bag_length is not None else math.inf
        spread = 1.0 if math.isinf(length) else 1.0 - (1.0 - 1.0 / n) ** max(1.0, length)
        out.append(_BagLoad(t.name, _pooled_bytes(t), spread))
    return sorted(out, key=lambda b: -b.pooled)


def _busiest(n: int, owned: Sequence[float], rowwise: float) -> float:
    """Bytes through the busiest rank and direction: what each rank sends as owner, or receives."""
    total = sum(owned)
    return max(max((n - 1) * (mine + rowwise), total - mine + (n - 1) * rowwise) for mine in owned)


def place_tables(p: Any, pooled_ok: Dict[str, bool]) -> None:
    """Put sharded bag tables whole on one rank each (scheme ``"table"``) where that unloads the busiest rank.

    Row-sharded, a bag table costs every rank ``(N - 1) q b`` bytes a step
    each way (``b``: a rank's bags in pooled rows, ``q``: the chance a bag
    has an id on a given owner); table-wise, its owner sends ``(N - 1) b``
    and every other rank receives ``b``. Tables are taken largest first and
    each goes to the rank that leaves the busiest rank least loaded and has
    the memory (``memory_budget``: the owner holds the whole table); a move
    that leaves the busiest rank as loaded is taken too, so that the next
    table can unload it. The assignment is kept only if the busiest rank
    ends up moving fewer bytes than with every table row-sharded. What this
    leaves out: the owner's optimizer and pooling work on every rank's
    lookups of its tables.

    Args:
        p: the :class:`~sparsecomm.planner.Plan`, changed in place (its tables' scheme, owner, reason).
        pooled_ok: per table, whether an owner can pool its lookups (:func:`pools_at_owner`).
    """
    n = p.world_size
    if n < 2:
        return
    loads = _bag_loads(p, pooled_ok)
    owned = [0.0] * n
    rowwise = sum(b.spread * b.pooled for b in loads)
    start = _busiest(n, owned, rowwise)
    chosen: Dict[str, Tuple[int, float]] = {}
    for b in loads:
        t = p.tables[b.name]
        keep = _busiest(n, owned, rowwise)
        best = None
        for r in sorted(range(n), key=lambda r: (owned[r], p.memory_on(r), r)):
            extra = sum(p.tables[c].memory_replicated - p.tables[c].memory_sharded
                        for c, (o, _) in chosen.items() if o == r)
            if p.memory_budget is not None and \
                    p.memory_on(r) + extra - t.memory_sharded + t.memory_replicated > p.memory_budget:
                continue   # its owner would hold the whole table instead of its share
            trial = list(owned)
            trial[r] += b.pooled
            cost = _busiest(n, trial, rowwise - b.spread * b.pooled)
            if best is None or cost < best[0]:
                best = (cost, r)
        # A move that keeps the busiest rank as loaded is taken too: the next table may then unload it.
        if best is None or best[0] > keep:
            continue
        owned[best[1]] += b.pooled
        rowwise -= b.spread * b.pooled
        chosen[b.name] = (best[1], best[0])
    end = _busiest(n, owned, rowwise)
    if end >= start:
        return   # no gain in bytes: row-sharded tables also share the owners' optimizer and pooling work
    for name, (r, _) in chosen.items():
        t = p.tables[name]
        t.scheme, t.owner = "table", r
        unit = (f"{end / 1e6:.3g} MB/step of pooled rows instead of {start / 1e6:.3g} MB" if t.bags is not None else
                f"{end:.3g} B of pooled rows per bag of each table instead of {start:.3g} B")
        t.reason = t.reason.replace(ROWS_SPREAD.format(n=n), "sharded") + \
            f"; whole on rank {r} (table-wise, {len(chosen)} tables over the ranks): the busiest rank moves " \
            f"{unit} row-sharded"


def every_bag_table_whole(p: Any) -> List[str]:
    """Put every bag table that can be sharded whole on one rank, traffic spread over the ranks; those it moved.

    The placement TorchRec's CPU planner picks for such models, whatever the
    bytes (:func:`place_tables` keeps only assignments that move fewer bytes):
    the placement trial measures it. Tables already whole keep their owner;
    the others go largest first to the rank serving the fewest pooled bytes
    a step so far (bags x a row's bytes: a float16 row counts half a float32
    row of its width), then the least memory, among those with the memory
    for the whole table (``memory_budget``); a table no rank has room for
    stays as it was.
    """
    n = max(1, p.world_size)
    served = [0.0] * n
    already = [name for name, t in p.tables.items() if t.placement == "shard" and t.scheme == "table"]
    for name in already:
        served[p.tables[name].owner] += _pooled_bytes(p.tables[name])
    whole = []
    for name, t in sorted(p.tables.items(), key=lambda kv: (-kv[1].memory_replicated, kv[0])):
        if t.kind != "EmbeddingBag" or t.blocker or name in already:
            continue
        room = [r for r in range(n) if p.memory_budget is None or
                p.memory_on(r) - t.memory_on(r) + t.memory_replicated <= p.memory_budget]
        if not room:
            continue
        r = min(room, key=lambda r: (served[r], p.memory_on(r) - t.memory_on(r), r))
        p.override(name, "shard", "table", owner=r)
        served[r] += _pooled_bytes(t)
        whole.append(name)
    return whole
