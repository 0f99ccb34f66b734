"""The hook's measured choice between one fused sparse sync per step and one sync per sparse bucket.

``HookConfig.eager_sparse='auto'`` (the default). Which is faster depends on
the link, not on anything the hook can count: on a slow link (few hosts at
1 Gbit/s) syncing each table as DDP hands it over lets its transfer overlap
the rest of backward; on a fast link or shared memory, one fused exchange per
step saves round trips (measured: benchmarks/RESULTS.md). So the hook times
whole steps in each mode and keeps the faster one, the same on every rank:

- a step's time is the wall time from its first bucket to the next step's
  first bucket (forward, backward, optimizer: what a user waits for);
- from the hook's step :data:`START` (counted from when ``'auto'`` took
  effect), each mode runs :data:`WARMUP` + :data:`SAMPLES`
  consecutive steps, eager first: the job's first steps (capacities still
  learned, caches cold) then slow the mode that must win by :data:`MARGIN`,
  not fused, the default; the first :data:`WARMUP` not counted
  (:class:`~sparsecomm.hooks.tuner.MethodTuner`'s schedule, in step numbers,
  which are the same on every rank);
- when the last of them has been timed, at the end of the next step, the
  ranks agree on the slowest rank's median per mode (one small all-reduce on
  the hook's group, under its timeout) and keep the faster mode; eager must
  be :data:`MARGIN` faster (on a 2-core machine two runs of one mode differ
  by about that), else fused stays. Both are measured again every
  ``HookConfig.tune_every`` steps.

A mode set by someone else for a while (``parallelize``'s placement trial
holds the hook fused while it times placements) pauses the trial: a phase
cut by the pause runs again from the step after it.

Both modes give the same bits (see ``HookConfig.eager_sparse``), so trying
them costs time, never exactness.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from sparsecomm.collectives.dense import max_over_ranks
from sparsecomm.hooks.tuner import MethodTuner

__all__ = ["EagerTrial", "START", "WARMUP", "SAMPLES", "MARGIN"]

logger = logging.getLogger("sparsecomm")

START = 2     # step 1 decides each table's path; the modes are tried from the next
WARMUP = 1    # steps of a mode not counted: its first step pays the switch (the worker thread, new buffers)
SAMPLES = 6   # timed steps per mode (their median counts)
MARGIN = 0.05  # eager is kept only when its median step is this much faster: within noise, fused (fewer collectives)


class EagerTrial:
    """Per-step choice of ``eager_sparse`` when it is ``'auto'``: what to run, what was measured, why.

    Args:
        every: steps between two measurements of both modes (0: measure once).
        first_step: the hook's step at which ``'auto'`` takes effect (1 for a new hook).

    Attributes:
        eager: the mode kept (None until the first trial has ended).
        reason: the agreed figures behind it, for a person.
    """

    def __init__(self, every: int, first_step: int = 1) -> None:
        self._tuner: MethodTuner[bool] = MethodTuner([True, False], start=first_step + START - 1, warmup=WARMUP,
                                                     samples=SAMPLES, every=every, keep=float("inf"))
        self._last_open: Optional[float] = None
        self._settle_due = False
        self._paused = False
        self.reason = "not measured yet (fused until then)"

    @property
    def eager(self) -> Optional[bool]:
        return self._tuner.best

    def begin(self, step: int) -> bool:
        """At step ``step``'s first bucket (1-based, the same number on every rank): time the step before it;
        True when this step syncs each sparse bucket as it arrives."""
        now = time.perf_counter()
        if self._paused:   # the steps in between ran in a mode set from outside: not this trial's
            self._paused = False
            self._tuner.restart(step + 1)
        elif self._last_open is not None and self._tuner.record(step - 1, now - self._last_open):
            self._settle_due = True
        self._last_open = now
        return bool(self._tuner.method(step))

    def end(self, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        """At a step's end, on every rank: where a trial's last step has been timed, agree on the times and
        keep the faster mode (collective, under ``group``'s timeout)."""
        if not self._settle_due:
            return
        self._settle_due = False
        tried = list(self._tuner.trying)
        try:
            agreed = max_over_ranks(self._tuner.local_times(), group, device)
        except BaseException:
            self.pause()   # not settled: the phase runs again after the next step
            raise
        eager = self._tuner.settle(agreed)
        times = dict(zip(tried, agreed))
        if eager and False in times and times[True] > (1 - MARGIN) * times[False]:
            eager = self._tuner.best = False   # not faster by the margin
        figures = ", ".join(f"{'eager' if m else 'fused'} {1e3 * t:.3g}" for m, t in zip(tried, agreed))
        self.reason = f"measured ms/step (slowest rank, median of {SAMPLES}): {figures}"
        logger.info("sparsecomm: sparse syncs %s: %s", "per bucket (eager)" if eager else "fused per step",
                    self.reason)

    def measuring(self, step: int) -> bool:
        """Whether steps around ``step`` run in a mode under test (not yet decided, a phase, or its settling)."""
        t = self._tuner
        return t.best is None or self._settle_due or t.exploring(step) or t.exploring(step - 1)

    def pause(self) -> None:
        """The next steps are not this trial's to time (a mode set from outside, another process's clock after
        unpickling, a move to another placement): the phase they cut runs again."""
        self._paused = True
        self._last_open = None
        self._settle_due = False
