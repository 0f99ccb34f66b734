"""A measured choice of sync method: try each candidate for a few syncs, agree on the timings, keep the fastest.

The cost model (:mod:`sparsecomm.hooks.classifier`) can be wrong on a given
cluster (TCP incast on an all-to-all, a shared CPU, a switch); timing the
candidates cannot. :class:`MethodTuner` is the schedule and the rule, with
no communication of its own, so every rank that feeds it the same call
numbers and the same agreed times makes the same choice:

- an exploration phase gives each candidate ``warmup + samples`` consecutive
  syncs; the first ``warmup`` of each are not counted;
- at the phase's last sync the caller agrees on the times (one all-reduce MAX
  of :meth:`MethodTuner.local_times` across the ranks: the slowest rank's
  median per candidate) and passes them to :meth:`MethodTuner.settle`;
- the fastest candidate is kept for ``every`` syncs, then a new phase
  re-measures it, the runner-up and every candidate within ``keep`` x of it
  (a candidate far slower is not paid for again).

The same rule as the sharded table's ``owner_pooling='auto'`` (measure each
path, the first round a warm-up, keep the faster, re-measure periodically).
"""

from __future__ import annotations

import statistics
from typing import Dict, Generic, List, Optional, Sequence, TypeVar

__all__ = ["MethodTuner", "candidates_near"]

M = TypeVar("M")


def candidates_near(costs: Dict[M, float], factor: float, order: Sequence[M]) -> List[M]:
    """The methods whose modelled cost is within ``factor`` x of the cheapest, in ``order`` (at least one)."""
    if not costs:
        return []
    best = min(costs.values())
    near = [m for m in order if m in costs and costs[m] <= factor * best]
    return near or [min(costs, key=costs.get)]


class MethodTuner(Generic[M]):
    """Explore-then-keep schedule for one parameter's sync method (deterministic in the call number).

    Args:
        candidates: methods to try, in order (ties go to the earlier one).
        start: the first call of the first exploration phase (calls count from 1).
        warmup: syncs per candidate not counted (first use: caches, allocations, connections).
        samples: timed syncs per candidate (their median counts).
        every: syncs between phases (0: explore once).
        keep: a re-measuring phase tries the candidates that were within this
            factor of the best (and the runner-up, whatever its time).
    """

    def __init__(self, candidates: Sequence[M], start: int = 1, warmup: int = 1, samples: int = 2,
                 every: int = 500, keep: float = 2.0) -> None:
        if not candidates:
            raise ValueError("MethodTuner needs at least one candidate")
        if warmup < 0 or samples < 1 or every < 0 or keep < 1:
            raise ValueError("need warmup >= 0, samples >= 1, every >= 0, keep >= 1")
        self.all = list(candidates)
        self.trying = list(candidates)
        self.warmup, self.samples, self.every, self.keep = warmup, samples, every, keep
        self.phase_start = start
        self.best: Optional[M] = None
        self.agreed: Dict[M, float] = {}
        self.phases = 0
        self._times: Dict[M, List[float]] = {}

    @property
    def per_candidate(self) -> int:
        return self.warmup + self.samples

    @property
    def phase_end(self) -> int:
        """The last call of the current (or next) exploration phase."""
        return self.phase_start + self.per_candidate * len(self.trying) - 1

    def exploring(self, call: int) -> bool:
        return self.phase_start <= call <= self.phase_end

    def method(self, call: int) -> Optional[M]:
        """The method for sync ``call``: the candidate under test, else the best (None before the first phase)."""
        if self.exploring(call):
            return self.trying[(call - self.phase_start) // self.per_candidate]
        return self.best

    def record(self, call: int, seconds: float) -> bool:
        """Note sync ``call``'s time; True when it ended a phase: agree on :meth:`local_times`, then :meth:`settle`."""
        if not self.exploring(call):
            return False
        j, pos = divmod(call - self.phase_start, self.per_candidate)
        if pos >= self.warmup:
            self._times.setdefault(self.trying[j], []).append(float(seconds))
        return call == self.phase_end

    def local_times(self) -> List[float]:
        """This rank's median time per candidate of the phase (``inf`` where it has none), in ``trying`` order."""
        return [statistics.median(self._times[m]) if self._times.get(m) else float("inf") for m in self.trying]

    def restart(self, start: int) -> None:
        """Run the current exploration phase again from call ``start``, its samples so far dropped, where it has
        begun (its calls were not all seen: a pause); a phase still ahead stays where it is."""
        if self.phase_start < start:
            self.phase_start = start
            self._times = {}

    def settle(self, times: Sequence[float]) -> M:
        """Keep the fastest of the agreed ``times`` (the same list on every rank) and schedule the next phase."""
        if len(times) != len(self.trying):
            raise ValueError(f"settle: {len(times)} times for {len(self.trying)} candidates")
        self.agreed = dict(zip(self.trying, (float(t) for t in times)))
        self.best = min(self.trying, key=lambda m: (self.agreed[m], self.trying.index(m)))
        end = self.phase_end
        self.phases += 1
        self._times = {}
        fastest = self.agreed[self.best]
        ranked = sorted(self.agreed, key=lambda m: (self.agreed[m], self.all.index(m)))
        near = {m for m in ranked if self.agreed[m] <= self.keep * fastest} | set(ranked[:2])
        # The next phase re-measures the best and what came close (at least the runner-up), in candidate order.
        self.trying = [m for m in self.all if m in near]
        self.phase_start = end + 1 + self.every if self.every else 1 << 62
        return self.best
