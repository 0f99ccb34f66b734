"""Measured placement: try the candidate placements on real training steps and keep the fastest.

``parallelize`` called without a plan picks placements from the model alone
(:mod:`sparsecomm.planner`): a cost model whose terms (link, optimizer and
pooling prices) are guesses until the job runs. A :class:`PlacementTrial`
then measures instead. It is a post-step hook of the job's
:class:`~sparsecomm.sharded.combined.ParallelOptimizer`: after
``warmup`` steps it times ``measure`` steps of each candidate placement,
moving the tables between candidates with :func:`sparsecomm.replan` (rows
and optimizer state move exactly, so every trial step is a real training
step of the same run: nothing is repeated or skipped), and finally keeps the
candidate whose slowest rank had the lowest median step time.

The candidates, in the order they are tried:

1. ``replicated``: every table under DDP and the sparsecomm hook (skipped
   when the replicas do not fit the plan's memory budget);
2. ``planned``: the planner's pick (e.g. bag tables table-wise);
3. ``row-sharded``: the tables the planner shards (or, when it shards none,
   those of ``small_table_bytes`` or more) row-sharded by hash;
4. ``table-wise``: every bag table that can be sharded whole on one rank,
   their pooled traffic spread over the ranks (TorchRec's CPU placement;
   :func:`~sparsecomm.table_wise.every_bag_table_whole`), at 2 ranks or more;
5. ``sampled``: the planner's pick for the ids the job's first step looked
   up, with the link and optimizer measured (what ``parallelize`` plans from
   a sample batch); made after that step, one collective.

Identical candidates are tried once. When the first pass's runner-up is
within ``confirm`` of its fastest, both are measured
again, back to back, and those steps decide: a candidate's steps measured a
pass apart differ by more than that (the first candidate's steps are the
job's first, its buffers and pages still new). The job starts replicated: moving a
replica to any sharded placement communicates nothing, and the replica is
kept as a stale copy on every rank (:mod:`sparsecomm.stale`), so every later
move (to another sharded placement, or back) sends only the rows that
changed since, with their optimizer state, not the whole tables.
A step's time runs from its first forward with gradients (a forward
pre-hook on the model) to the end of its ``step()``: data loading, which is the same whatever the
placement, stays out of it; the ``settle`` steps after a move are not counted (the first step after a move
builds buffers, probes the link), nor the 8 rounds in which ``owner_pooling="auto"`` times each pooling path
(:mod:`sparsecomm.sharded.pooling`): each candidate is timed in its steady state.

Agreement: every rank counts the same ``step()`` calls, so every rank moves at
the same step; the decision is made from the medians of every rank (one
all-gather of objects), so every rank keeps the same placement.
:attr:`PlacementTrial.log` holds every decision with its figures, and the
chosen candidate's reason is added to the model's ``sparsecomm_plan``.

Re-checks: ``recheck_every`` steps after a decision (when > 0), or as soon
as the median of the last ``2 * measure`` steps drifts ``drift`` above the
kept placement's measured median (when > 0), the kept placement and the
runner-up are measured again; the runner-up replaces the kept one only when
faster by more than ``margin`` (hysteresis: the noise of one measurement
does not move tables back and forth). A drift re-check waits ``drift_gap``
re-checks' length (``2 * (settle + measure)`` steps) after the last decision,
twice as long after each drift re-check that kept the placement (up to 16
times): a machine whose speed comes and goes (another job, other models
trained in turn) would otherwise send the job to the runner-up over and
over; the drift re-checks' share of the steps stays under about
``1 / drift_gap`` and shrinks while the placement holds.

A move rebuilds DDP in place and swaps table modules: a model compiled with
``torch.compile`` around it recompiles after each move (or pass
``trial=False`` with a plan).

After a move, gradients are cleared (``set_to_none``): the hook runs after
``step()``, where a training loop's next ``zero_grad()`` would clear them.
A move that cannot happen yet (lookups open, a round prefetched or awaiting
its backward: :class:`~sparsecomm.replan.ReplanBusy`) is retried at the next
step; a candidate ``replan`` refuses is dropped, with the reason in the log.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.collectives.objects import all_gather_objects, world
from sparsecomm.placement import planned_placement
from sparsecomm.planner import Plan, embedding_modules
from sparsecomm.planner import plan as make_plan
from sparsecomm.replan import ReplanBusy, replan
from sparsecomm.sample_batch import IdCapture
from sparsecomm.sharded.model import sharded_modules
from sparsecomm.sharded.pooling import MEASURED_ROUNDS
from sparsecomm.stale import StaleReplicas
from sparsecomm.table_wise import every_bag_table_whole

__all__ = ["TrialConfig", "Candidate", "PlacementTrial", "candidates"]


@dataclasses.dataclass(frozen=True)
class TrialConfig:
    """How a placement trial runs (steps are ``step()`` calls of the optimizer).

    Attributes:
        warmup: steps before anything is measured (the first steps build buffers and probe the link).
        settle: steps after each move that are not measured.
        measure: measured steps per candidate (their median counts).
        recheck_every: steps between re-checks after the decision (0: none).
        drift: re-check when the kept placement's recent median step is this fraction above its measured one
            (0: never).
        drift_gap: a drift re-check comes no sooner than this many re-checks' length (``2 * (settle + measure)``
            steps) after the last decision; the wait doubles (up to 16 times) after each drift re-check that
            keeps the placement and starts again from this after any other decision (0: as soon as a window of
            steps shows the drift).
        margin: how much faster (as a fraction) another candidate must be to replace the kept one at a re-check.
        confirm: measure the runner-up again with the fastest, back to back, when within this fraction of it
            after the first pass, and decide on those steps (0: never). Steps measured far apart differ by more
            than candidates this close do (the first candidate's steps are the job's first).
        sample: also try the planner's pick for the ids the job's first step looked up (the plan
            ``parallelize`` makes from a sample batch), made after that step.
        stale_replicas: keep each sharded table's last replica (:mod:`sparsecomm.stale`) while a move may still come
            (through the re-checks), so moves send only changed rows; costs the replicated placement's memory,
            which the trial's first candidate used anyway. False: every move sends whole tables.
        settle_pooling: also leave out, after a move, the rounds in which tables with ``owner_pooling="auto"`` time
            each pooling path (8), so that every candidate is timed in its steady state.
    """

    warmup: int = 3
    settle: int = 2
    measure: int = 8
    recheck_every: int = 0
    drift: float = 0.15
    drift_gap: int = 10
    margin: float = 0.1
    confirm: float = 0.1
    sample: bool = True
    stale_replicas: bool = True
    settle_pooling: bool = True   # last: the fields before it keep their positions

    def __post_init__(self) -> None:
        for name in ("warmup", "settle", "measure", "recheck_every", "drift_gap"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name == "measure" else 0):
                raise ValueError(f"TrialConfig.{name} must be an int >= {1 if name == 'measure' else 0}, "
                                 f"got {value!r}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"TrialConfig.margin must be in [0, 1), got {self.margin!r}")
        for name in ("drift", "confirm"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"TrialConfig.{name} must be a fraction >= 0, got {value!r}")


@dataclasses.dataclass
class Candidate:
    """One placement to try: its name, its plan, and the slowest rank's median step (ms) once measured."""

    name: str
    plan: Plan
    ms: Optional[float] = None

    def key(self) -> tuple:
        return tuple((n, planned_placement(t)) for n, t in self.plan.tables.items())


def candidates(planned: Plan, small_table_bytes: int = 4 << 20) -> List[Candidate]:
    """The placements a trial tries for ``planned`` (module docstring), identical ones once, in trial order."""
    replicated = copy.deepcopy(planned)
    for name in replicated.tables:
        replicated.override(name, "replicate")
    rows = copy.deepcopy(planned)
    shard = [n for n, t in planned.tables.items() if t.placement == "shard"] or \
        [n for n, t in planned.tables.items() if not t.blocker and t.memory_replicated >= small_table_bytes]
    for name in shard:
        rows.override(name, "shard", "hash")
    whole = copy.deepcopy(planned)
    tried = [Candidate("replicated", replicated), Candidate("planned", planned), Candidate("row-sharded", rows)]
    if planned.world_size > 1 and every_bag_table_whole(whole):
        tried.append(Candidate("table-wise", whole))
    out: List[Candidate] = []
    budget = planned.memory_budget
    for c in tried:
        if c.name == "replicated" and budget is not None and c.plan.memory_per_rank() > budget:
            continue
        if all(c.key() != o.key() for o in out):
            out.append(c)
    return out


class PlacementTrial:
    """Times the candidates on the job's steps and keeps the fastest (module docstring); the optimizer's post-step hook.

    Args:
        model: the DDP model ``parallelize`` returned (moved in place by each replan).
        tried: the candidates, in trial order; the model must hold the first one's placement.
        config: the schedule.
        process_group: the group the model trains on.
    """

    def __init__(self, model: DDP, tried: List[Candidate], config: TrialConfig,
                 process_group: Optional[dist.ProcessGroup]) -> None:
        self._model = weakref.ref(model)
        # On the inner module: a DDP built again in place by a move loses its own module hooks.
        self._started: Optional[float] = None
        self._hook = model.module.register_forward_pre_hook(self._forward_starts)
        self.candidates = tried
        self.config = config
        self.process_group = process_group
        self.group = (process_group or dist.group.WORLD) if world(process_group)[1] > 1 else None
        self.log: List[str] = []
        self.steps = 0
        self.current = 0                  # the candidate the model holds
        self.measuring: Optional[int] = 0  # the candidate being measured (None: decided)
        self.kept: Optional[int] = None
        self.moves = 0
        self.move_seconds = 0.0
        self._samples: Dict[int, List[float]] = {}
        self._skip = config.warmup
        self._want: Optional[int] = None   # a move to make as soon as it can happen
        self._next_check: Optional[int] = None
        self._pass: Optional[List[int]] = None   # the candidates of a confirming or re-checking pass
        self._confirmed = False
        self._capture = IdCapture(embedding_modules(model.module)) if config.sample else None
        self.sampled_plan: Optional[Plan] = None   # the plan for the first step's ids (config.sample)
        self._recent: List[float] = []     # the kept placement's latest steps (drift)
        self._since = 0                    # steps of the kept placement since the last decision (drift windows)
        self._gap = self._base_gap()       # steps after a decision before drift may start a re-check
        self._decided_at = 0               # the step of the last decision
        self._drift_check = False          # whether the re-check under way was started by a drift
        self.stale = StaleReplicas() if config.stale_replicas else None
        # The hook's own eager/fused trial would change the replicas' steps while placements are timed: the hook
        # stays fused while this trial measures, and measures its modes once a placement is kept.
        self._hook_auto = self._hook_mode() in ("auto", None)
        self._hook_trials: Dict[int, Any] = {}   # per candidate: its hook's sync-mode trial, kept across moves
        self._set_hook_mode(False)

    def _base_gap(self) -> int:
        return self.config.drift_gap * 2 * (self.config.settle + self.config.measure)

    def _next_gap(self, kept_again: bool) -> int:
        """The wait after a decision: doubled (up to 16 times the base) after a drift re-check that kept the
        placement, the base after anything else (the first decision, a periodic re-check, a move)."""
        if kept_again and self._drift_check:
            return min(2 * self._gap, 16 * self._base_gap())
        return self._base_gap()

    @property
    def done(self) -> bool:
        """Whether the trial has decided (re-checks may still run)."""
        return self.kept is not None

    def _hook_state(self) -> Any:
        """The replicas' DDP hook state of the placement held now (a move builds a new one), or None."""
        return getattr(self._model_now().module, "sparsecomm_state", None)

    def _hook_mode(self) -> Any:
        state = self._hook_state()
        return state.eager_sparse if state is not None else None

    def _set_hook_mode(self, mode: Any) -> None:
        """``eager_sparse`` of the replicas' hook, where this trial manages it."""
        state = self._hook_state()
        if self._hook_auto and state is not None:
            state.eager_sparse = mode

    def _model_now(self) -> DDP:
        model = self._model()
        if model is None:
            raise RuntimeError("sparsecomm: the model of this placement trial no longer exists")
        return model

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        if self._started is None and torch.is_grad_enabled():   # an evaluation under no_grad is not a step
            self._started = time.perf_counter()

    def after_step(self, optimizer: Any, args: Any = (), kwargs: Any = None) -> None:
        """The post-step hook: count, time, and move or decide when the schedule says so."""
        now = time.perf_counter()
        interval = None if self._started is None else now - self._started
        self._started = None
        self.steps += 1
        if self._capture is not None:
            self._add_sampled()
        if self._want is not None:
            self._move(optimizer, self._want)
            return
        if self.measuring is None:
            state = self._hook_state()
            if state is not None and state.sync_mode_measuring:   # the same on every rank: its steps' schedule
                self._recent, self._since = [], 0   # its trial's steps are not the kept placement drifting
                if self._next_check is not None:    # nor steps of the kept placement to re-check after
                    self._next_check += 1
                return
            drifted = self._drifted(interval)
            if drifted or (self._next_check is not None and self.steps >= self._next_check):
                self._drift_check = drifted
                self._recheck(optimizer)
            return
        if self._skip:
            self._skip -= 1
            return
        if interval is not None:
            self._samples.setdefault(self.measuring, []).append(interval)
        if len(self._samples.get(self.measuring, [])) < self.config.measure:
            return
        self._next(optimizer)

    def _next(self, optimizer: Any) -> None:
        """The measured candidate has its steps: measure the next one that can be placed, or decide."""
        order = self._order()
        for index in order[order.index(self.measuring) + 1:]:
            self.measuring = index
            if self._move(optimizer, index):
                return
        self._decide(optimizer)

    def _order(self) -> List[int]:
        return list(range(len(self.candidates))) if self._pass is None else self._pass

    def _add_sampled(self) -> None:
        """After the first step: the planner's pick for the ids it looked up becomes a candidate (collective)."""
        sample, base = self._capture.sample(), self.candidates[0].plan
        self._capture.close()
        self._capture = None
        try:
            sampled = make_plan(self._model_now().module, process_group=self.process_group,
                                memory_budget=base.memory_budget, optimizer=base.optimizer, sample=sample)
        except ValueError as exc:   # the same on every rank: the plan is made from every rank's sample
            self.log.append(f"step {self.steps}: no sample-batch candidate: {exc}")
            return
        self.sampled_plan = sampled
        c = Candidate("sampled", sampled)
        same = [o.name for o in self.candidates if o.key() == c.key()]
        if same:
            self.log.append(f"step {self.steps}: the plan for step 1's ids is the {same[0]} candidate's")
        else:
            self.candidates.append(c)

    def _confirm(self, optimizer: Any, measured: List[int], figures: str) -> bool:
        """After the first pass: when the runner-up is within ``confirm`` of the fastest, measure both again (True).

        Candidates measured a pass apart differ by the machine's drift, which
        can exceed their difference. Only the two fastest: each candidate
        measured again costs a move and ``settle + measure`` steps, and a
        third within the band is at most ``confirm`` slower than the kept one."""
        ranked = sorted(measured, key=lambda i: self.candidates[i].ms)
        bound = (1 + self.config.confirm) * self.candidates[ranked[0]].ms if ranked else 0.0
        close = [i for i in ranked if self.candidates[i].ms <= bound][:2]
        if self._confirmed or not self.config.confirm or len(close) < 2:
            return False
        self._confirmed = True
        self._pass = sorted(close, key=lambda i: i != self.current)   # the one the model holds first
        names = [self.candidates[i].name for i in close]
        self.log.append(f"step {self.steps}: trial: median ms/step of the slowest rank: {figures}; "
                        f"{', '.join(names[:-1])} and {names[-1]} within {self.config.confirm:.0%}: measured "
                        f"again, back to back")
        self.measuring, self._samples = self._pass[0], {}
        self._move(optimizer, self._pass[0])
        return True

    def _decide(self, optimizer: Any) -> None:
        medians = {i: statistics.median(v) for i, v in self._samples.items()}
        everyone = all_gather_objects(medians, self.group)
        for i in medians:
            self.candidates[i].ms = 1e3 * max(m[i] for m in everyone)   # the slowest rank's median
        measured = [i for i in self._order() if self.candidates[i].ms is not None]
        best = min(measured, key=lambda i: self.candidates[i].ms)
        if self.kept is not None and best != self.kept:
            kept_ms = self.candidates[self.kept].ms
            if self.candidates[best].ms > (1 - self.config.margin) * kept_ms:
                best = self.kept   # not faster by the margin: stay
        figures = ", ".join(f"{self.candidates[i].name} {self.candidates[i].ms:.2f}" for i in measured)
        if self.kept is None and self._confirm(optimizer, measured, figures):
            return
        what = "re-check" if self.kept is not None else "trial"
        self._gap = self._next_gap(self.kept is not None and best == self.kept)
        self._decided_at, self._drift_check = self.steps, False
        wait = f"; a drift is looked for from step {self.steps + self._gap}" if self.config.drift else ""
        self.log.append(f"step {self.steps}: {what}: median ms/step of the slowest rank: {figures}; kept "
                        f"{self.candidates[best].name} ({self.moves} moves so far, {self.move_seconds:.2f} s){wait}")
        self.kept, self.measuring, self._pass = best, None, None
        self._samples, self._recent, self._since = {}, [], 0
        every = self.config.recheck_every
        self._next_check = self.steps + every if every else None
        if self.stale is not None and not (every or self.config.drift):
            self.stale.drop()   # no move can come any more
        note = f"measured: {self.candidates[best].name} placement kept ({figures} ms/step)"
        plans = [self.candidates[best].plan]
        if self.current == best:   # the model holds a copy of it
            plans.append(getattr(self._model_now().module, "sparsecomm_plan", None))
        for t in (t for p in plans if p is not None for t in p.tables.values()):
            t.reason = t.reason.split("; measured:")[0] + "; " + note
        if self.current != best:
            self._move(optimizer, best)
        self._set_hook_mode("auto")

    def _drifted(self, interval: Optional[float]) -> bool:
        """Whether the kept placement's recent steps are ``drift`` slower than measured on some rank.

        Asked of every rank at the end of every window of ``2 * measure`` steps
        after the decision (one all-gather then): the same steps on every rank.
        """
        if not self.config.drift:
            return False
        window = 2 * self.config.measure
        if interval is not None:
            self._recent = (self._recent + [interval])[-window:]
        self._since += 1
        if self._since % window or self.steps - self._decided_at < self._gap:   # the same on every rank
            return False
        slow = len(self._recent) == window and \
            1e3 * statistics.median(self._recent) > (1 + self.config.drift) * self.candidates[self.kept].ms
        drifted = any(all_gather_objects(slow, self.group))
        if drifted:
            self.log.append(f"step {self.steps}: the kept {self.candidates[self.kept].name} placement's recent "
                            f"median step is over {1 + self.config.drift:.2f} x its measured "
                            f"{self.candidates[self.kept].ms:.2f} ms on some rank: re-check")
        return drifted

    def _recheck(self, optimizer: Any) -> None:
        """Measure the runner-up against the kept placement (the kept one again, for the same conditions)."""
        ranked = sorted((i for i, c in enumerate(self.candidates) if c.ms is not None and i != self.kept),
                        key=lambda i: self.candidates[i].ms)
        if not ranked:
            self._next_check = None
            return
        self._pass = [self.kept, ranked[0]]
        self.measuring = self.kept
        self._skip = self.config.settle
        self._set_hook_mode(False)

    def _move(self, optimizer: Any, index: int) -> bool:
        """Replan the model to candidate ``index``; False when the candidate cannot be placed (dropped, logged).

        A move refused because a round is pending is retried at the next step.
        Every refusal is agreed by ``replan`` (the same on every rank), so every
        rank retries or drops alike.
        """
        self._skip = self.config.settle
        if index == self.current:
            self._want = None
            return True
        model = self._model_now()
        optimizer.zero_grad(set_to_none=True)
        before = self._hook_state()
        if before is not None and before.eager_trial is not None:   # the sync mode measured at this placement
            self._hook_trials[self.current] = before.eager_trial
        start = time.perf_counter()
        try:
            moved, _ = replan(model, optimizer, copy.deepcopy(self.candidates[index].plan),
                              process_group=self.process_group, stale=self.stale)
        except ReplanBusy:
            self._want = index   # agreed on every rank: every rank retries at the next step
            return True
        except ValueError as exc:
            self._want = None
            self.log.append(f"step {self.steps}: {self.candidates[index].name} cannot be placed: {exc}")
            self._samples.pop(index, None)
            return False
        if moved is not model:
            raise RuntimeError("sparsecomm: a placement trial's replan replaced the model object")
        if self.config.settle_pooling and any(t.owner_pooling == "auto" for _, t in sharded_modules(model.module)):
            self._skip = max(self._skip, 2 * (MEASURED_ROUNDS + 1))   # each path: one round uncounted, then timed
        self.moves += 1
        self.move_seconds += time.perf_counter() - start
        self.current, self._want = index, None
        after = self._hook_state()
        if after is not None and index in self._hook_trials:   # back at a placement: its hook's measured mode too
            after.eager_trial = self._hook_trials[index]
            after.eager_trial.pause()
        self._set_hook_mode(False if self.measuring is not None else "auto")
        return True

    def report(self) -> str:
        """The candidates with their measured figures and every decision, in words."""
        lines = [f"sparsecomm placement trial: {len(self.candidates)} candidates, step {self.steps}, "
                 f"{'kept ' + self.candidates[self.kept].name if self.done else 'measuring'}"]
        for i, c in enumerate(self.candidates):
            ms = "not measured yet" if c.ms is None else f"{c.ms:.2f} ms/step (slowest rank's median)"
            mark = " <- kept" if i == self.kept else (" <- now" if i == self.current and not self.done else "")
            lines.append(f"  {c.name}: {ms}{mark}")
        if self.stale is not None and self.stale.rows_total:
            lines.append(f"  moves sent {self.stale.rows_sent} of {self.stale.rows_total} rows from this rank "
                         f"(stale replicas hold {self.stale.nbytes / 2**20:.1f} MiB)")
        return "\n".join(lines + ["  " + entry for entry in self.log])


def can_try(model: nn.Module, inner: nn.Module) -> Optional[str]:
    """Why a trial cannot run on this model (None: it can): it moves the tables of a DDP model that has dense
    parameters (so that DDP stays, rebuilt in place, whatever the placement)."""
    if not isinstance(model, DDP):
        return "the model is not under DDP (one rank, FSDP, or nothing replicated)"
    tables = {id(m.weight) for _, m in inner.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    if not any(p.requires_grad and id(p) not in tables and p.numel() for p in inner.parameters()):
        return "the model has no dense parameters to keep its DDP wrapper between placements"
    return None
