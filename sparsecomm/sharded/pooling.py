"""Who pools a bag lookup, the owners or the requester: the rule, its numbers, and the per-table choice.

A bag table's ``owner_pooling`` picks the path of each lookup: ``"always"``
and ``"never"`` fix it; ``"bytes"`` takes the path that moves fewer bytes;
``"auto"`` measures both and takes the faster. Both automatic rules decide
from every rank's two numbers in the last round's metadata
(:func:`choose_pooling`), so every rank makes the same choice;
:class:`PoolingChoice` keeps, per table of a set, that choice and this
rank's measured round times (the numbers it sends).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sparsecomm import ops
from sparsecomm.sharded.pending import Bags, Lookup
from sparsecomm.sharded.protocol import LookupTable

__all__ = ["REMEASURE_ROUNDS", "MEASURED_ROUNDS", "choose_pooling", "PoolingChoice", "rows_estimates",
           "pooled_estimates"]

# An "auto" table re-measures the path it is not taking every this many rounds.
REMEASURE_ROUNDS = 64
# An "auto" table's time for a path: the fastest of this many rounds of it (after one uncounted round).
MEASURED_ROUNDS = 3


def choose_pooling(choice: str, per_rank: Sequence[Tuple[int, int]], round: int) -> Optional[bool]:
    """Whether a table's next lookup is pooled at the owners; None: keep the current choice.

    Args:
        choice: the table's ``owner_pooling``.
        per_rank: every rank's ``(rows, pooled)`` numbers from the last round's
            metadata: bytes (``"bytes"``), or measured microseconds per round
            (``"auto"``; 0 where that rank has not measured the path yet).
        round: the round just requested (the same on every rank).

    Every rank passes the same numbers, so every rank gets the same answer.
    ``"auto"`` first measures rows, then pooled (each path's first round is a
    warm-up, not counted; a path's time is the fastest of its last
    ``MEASURED_ROUNDS`` rounds), then takes the faster summed over the ranks, and
    every ``REMEASURE_ROUNDS`` rounds takes the other path once so that a
    change in the workload or the machine is seen.
    """
    active = [(r, p) for r, p in per_rank if r or p]
    if choice == "bytes":
        rows, pooled = sum(r for r, _ in active), sum(p for _, p in active)
        return pooled < rows if active else None
    if choice != "auto" or not active:
        return None
    if any(r == 0 for r, _ in active):
        return False
    if any(p == 0 for _, p in active):
        return True
    faster = sum(p for _, p in active) < sum(r for r, _ in active)
    return (not faster) if round % REMEASURE_ROUNDS == REMEASURE_ROUNDS - 1 else faster



class PoolingChoice:
    """Per bag table of a set: whether its next lookup is pooled at the owners, and this rank's round times."""

    __slots__ = ("_pool_next", "_timing")

    def __init__(self) -> None:
        # Per bag table with owner_pooling "auto"/"bytes": whether its next lookup is pooled at the owners,
        # decided from every rank's numbers in the last round's metadata (so the same on every rank).
        self._pool_next: Dict[int, bool] = {}
        # Per table ("auto"): per path (rows, pooled), this rank's rounds and its last measured round times (us).
        self._timing: Dict[int, Tuple[List[Any], List[Any]]] = {}

    def pooled_lookup(self, t: LookupTable, lookups: Sequence[Lookup], ok: bool) -> Optional[Lookup]:
        """The lookup of ``t`` to pool at its owners this round, or None (rows path).

        Only a table looked up once in the round, with bags that owners may
        pool and no hot rows, can take the pooled path.
        """
        if not ok or len(lookups) != 1 or lookups[0].bags is None or t.hot is not None:
            return None
        choice = t.owner_pooling
        if choice == "always" or (choice in ("auto", "bytes") and self._pool_next.get(id(t), False)):
            return lookups[0]
        return None

    def measured(self, t: LookupTable) -> Tuple[int, int]:
        """This rank's measured round time (microseconds) by rows and pooled: the fastest of the last
        ``MEASURED_ROUNDS`` rounds of the path (other work on the machine only ever adds time), 0 until it
        has that many."""
        timing = self._timing.get(id(t))
        if timing is None:
            return 0, 0
        return tuple(int(min(us)) if len(us) >= MEASURED_ROUNDS else 0  # type: ignore[return-value]
                     for _, us in timing)

    def record(self, t: LookupTable, pooled: bool, seconds: float) -> None:
        """Add a finished lookup's time (the round, pull + push, and the requester's own work on the rows) to the
        path ``t`` took.

        The first round of each path is not counted (it pays for first-touch buffers and warm-up); a path's
        time is the fastest of its last ``MEASURED_ROUNDS`` rounds, so rounds slowed by other work on the
        machine do not decide.
        """
        path = self._timing.setdefault(id(t), ([0, []], [0, []]))[int(pooled)]
        path[0] += 1
        if path[0] >= 2:
            path[1] = (path[1] + [max(1.0, seconds * 1e6)])[-MEASURED_ROUNDS:]

    def update(self, tables: Sequence[LookupTable], estimates: Sequence[Sequence[Tuple[int, int]]],
               round: int) -> None:
        """Decide each table's next path from every rank's numbers (``Routes.estimates``) of the round just
        requested; every rank holds the same numbers, so every rank decides the same."""
        for t, per_rank in zip(tables, estimates):
            nxt = choose_pooling(t.owner_pooling, per_rank, round)
            if nxt is not None:
                self._pool_next[id(t)] = nxt


def rows_estimates(t: LookupTable, part: ops.Partition, unique: int, inverse: torch.Tensor, bags: Bags, me: int
                   ) -> Tuple[int, int]:
    """Wire bytes of this rank's rows-path lookup and (estimated: a bag per occurrence, at most) pooled.

    ``part``: the round's unique ids of ``t`` partitioned by owner; ``unique``
    their number; ``inverse`` each looked-up id's position among them.
    """
    counts = part.counts
    multiplicity = torch.bincount(inverse, minlength=unique)[part.perm]
    occurrences = torch.stack([x.sum() for x in torch.split(multiplicity, counts.tolist())]) if counts.numel() \
        else counts
    bag_counts = occurrences.clamp(max=bags.num_bags)
    weight_bytes = t.local_weight.element_size() if bags.weights is not None else 0
    return pooled_estimates(t, counts, occurrences, bag_counts, weight_bytes, me)


def pooled_estimates(t: LookupTable, counts: torch.Tensor, occurrences: torch.Tensor, bag_counts: torch.Tensor,
                     weight_bytes: int, me: int) -> Tuple[int, int]:
    """``(rows path, pooled path)`` bytes this rank sends and receives for one lookup (forward + backward)."""
    wire = t.wire_dtype   # compressed rows cost their wire width both ways
    row = t.embedding_dim * (wire.itemsize if wire is not None else t.local_weight.element_size())
    others = torch.ones_like(counts, dtype=torch.bool)
    if others.numel() > me:
        others[me] = False
    u, o, b = (int(x[others].sum()) for x in (counts, occurrences, bag_counts))
    return u * (8 + 2 * row), u * 8 + o * (4 + weight_bytes) + b * (4 + 2 * row)

