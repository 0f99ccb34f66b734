"""The placement trial of ``parallelize`` (``sparsecomm.trial``) on real gloo ranks, against one process.

Every trial step is a training step: the model must equal single-process
training on the whole batch after every step, through every move; every
rank keeps the same placement; the model object stays the one returned.
"""

from __future__ import annotations

import gc
import time
import warnings

import pytest
import torch
import torch.nn as nn

import sparsecomm
from sparsecomm.hooks.state import SparseCommState
from sparsecomm.sharded.pooling import MEASURED_ROUNDS
from sparsecomm.sharded.table import ShardedTable
from sparsecomm.trial import Candidate, TrialConfig, candidates

from distributed import expect_value_error, spawned_fixture, weight_diffs

GLOBAL_BATCH = 6
TOL = 1e-6
# No drift re-check: a step slowed by a busy machine must not start one in the cases that check the first decision.
def quick(**options):
    """A short trial for tests: the candidates measured right after their moves, the pooling's measuring rounds
    counted (``settle_pooling=False``; ``case_settle_pooling`` checks the default)."""
    return TrialConfig(settle_pooling=False, **options)


FAST = quick(warmup=1, settle=1, measure=2, drift=0)
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.02)),      # small enough that training converges: a diverging
              "adagrad": (torch.optim.Adagrad, dict(lr=0.05, initial_accumulator_value=0.1)),  # run amplifies roundoff
              "adam": (torch.optim.Adam, dict(lr=0.01))}


class Model(nn.Module):
    """Three bag tables of 4 MiB or more (the planner shards them, table-wise at 2-3 ranks) and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.EmbeddingBag(300_000, 4, mode="sum", sparse=True)
        self.b = nn.EmbeddingBag(200_000, 4, mode="sum", sparse=True)
        self.c = nn.EmbeddingBag(150_000, 4, mode="mean", sparse=True)
        self.mlp = nn.Linear(12, 1)
        self.double()

    def forward(self, x):
        return self.mlp(torch.cat([self.a(x), self.b(x % 200), self.c(x % 100)], 1)).squeeze(1)


def batch(step, rank=0, world=1):
    g = torch.Generator().manual_seed(70 + step)
    x, y = torch.randint(0, 300, (GLOBAL_BATCH, 3), generator=g), torch.randn(GLOBAL_BATCH, generator=g,
                                                                               dtype=torch.float64)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


class Reference:
    def __init__(self, name):
        cls, kw = OPTIMIZERS[name]
        self.model = Model()
        m = self.model
        if name == "adam":   # lazy on the sparse tables, as a sharded or replicated sparse table under Adam
            self.opts = [torch.optim.Adam(m.mlp.parameters(), **kw),
                         torch.optim.SparseAdam([m.a.weight, m.b.weight, m.c.weight], **kw)]
        else:
            self.opts = [cls(m.parameters(), **kw)]

    def step(self, step):
        for o in self.opts:
            o.zero_grad()
        x, y = batch(step)
        ((self.model(x) - y) ** 2).mean().backward()
        for o in self.opts:
            o.step()


def placement(model):
    inner = getattr(model, "module", model)
    return {n: ((m.scheme, m.owner) if isinstance(m, ShardedTable) else "replicate")
            for n, m in inner.named_children() if n in "abc"}


def step_of(model, opt, step, rank, world):
    x, y = batch(step, rank, world)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def train_until_decided(model, opt, ref, rank, world, limit):
    """Train, and the single-process reference alongside, until the trial decides (at most ``limit`` steps)."""
    step = 0
    while not opt.trial.done and step < limit:
        step_of(model, opt, step, rank, world)
        ref.step(step)
        step += 1


def hook_mode(model, trial):
    """(measuring?, the replicas' hook eager_sparse): the trial holds the hook fused while it times placements."""
    state = getattr(model.module, "sparsecomm_state", None)
    return trial.measuring is not None, state.eager_sparse if state is not None else None


def assert_same(model, reference, what):
    diffs = weight_diffs(model, reference)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < TOL, f"{what}: {worst} differs by {diffs[worst]}"


def case_trial(rank, world, name, config=FAST):
    """The default call: replicated first, then the planner's pick, then row-sharded (then the plan for the first
    step's ids, when it differs); the fastest kept, the runner-up measured again with it when close.

    With stale replicas (the default), moves after the first send only changed rows: far fewer than the tables'.
    """
    cls, kw = OPTIMIZERS[name]
    model, opt = sparsecomm.parallelize(Model(), cls, trial=config, **kw)
    first, trial, ref = model, opt.trial, Reference(name)
    assert [c.name for c in trial.candidates] == ["replicated", "planned", "row-sharded"]
    assert set(placement(model).values()) == {"replicate"}
    seen, modes = [], []
    for step in range(24):
        step_of(model, opt, step, rank, world)
        ref.step(step)
        assert_same(model, ref.model, f"{name}, world {world}, step {step}")
        seen.append(tuple(sorted(placement(model).items())))
        modes.append(hook_mode(model, trial))
    assert set(modes) == {(True, False), (False, "auto")} and modes[-1] == (False, "auto"), modes
    assert model is first and trial.done and trial.moves >= 2, trial.report()
    # the first step's ids, seen by the trial, planned as a sample batch of them would be (union and bags)
    alone = sparsecomm.plan(Model(), batch(0, rank, world)[0], optimizer=cls)
    for n, t in trial.sampled_plan.tables.items():
        assert (t.distinct, t.union, t.bags) == (alone[n].distinct, alone[n].union, alone[n].bags), n
    names = [c.name for c in trial.candidates]
    assert names[:3] == ["replicated", "planned", "row-sharded"] and names[3:] in ([], ["sampled"])
    assert (names[3:] == []) == any("the plan for step 1's ids is the" in e for e in trial.log)
    kept = trial.candidates[trial.kept]
    want = {n: ((t.scheme, t.owner) if t.placement == "shard" else "replicate") for n, t in kept.plan.tables.items()}
    assert placement(model) == want, (placement(model), want, trial.report())
    assert all(c.ms is not None and c.ms > 0 for c in trial.candidates)
    assert len(set(seen)) >= 3   # every candidate held the tables for some steps
    text = trial.report()
    assert "kept " + kept.name in text and "median ms/step of the slowest rank" in text
    assert "measured:" in model.module.sparsecomm_plan.tables["a"].reason
    if config.stale_replicas:
        assert 0 < trial.stale.rows_sent < trial.stale.rows_total / 100, text
        assert "moves sent" in text
    else:
        assert trial.stale is None
    return kept.name, [c.ms for c in trial.candidates]


def case_pending(rank, world):
    """A move due while a lookup awaits its backward is made one step later; training stays exact."""
    cls, kw = OPTIMIZERS["adagrad"]
    model, opt = sparsecomm.parallelize(Model(), cls, trial=quick(warmup=0, settle=0, measure=1), **kw)
    trial, ref = opt.trial, Reference("adagrad")
    step_of(model, opt, 0, rank, world)   # replicated measured: to the planned placement
    ref.step(0)
    assert trial.current == 1 and any(p != "replicate" for p in placement(model).values())
    x, y = batch(1, rank, world)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    table = next(m for m in model.module.children() if isinstance(m, ShardedTable))
    pending = table(x)                    # a lookup whose round has not run
    opt.step()                            # the move to row-sharded is due: refused, retried next step
    ref.step(1)
    assert trial.current == 1 and trial._want == 2
    del pending
    gc.collect()
    step_of(model, opt, 2, rank, world)
    ref.step(2)
    assert trial.current == 2, trial.report()
    assert_same(model, ref.model, f"after the retried move, world {world}")
    return True


def case_recheck(rank, world):
    """Re-checks every K steps, and when one rank's steps drift slower; every rank re-checks alike, exactly."""
    cls, kw = OPTIMIZERS["sgd"]
    model, opt = sparsecomm.parallelize(Model(), cls, trial=quick(warmup=1, settle=1, measure=2,
                                                                        recheck_every=10, drift=0.5, drift_gap=0),
                                        **kw)
    trial, ref = opt.trial, Reference("sgd")
    slow = []

    def stall(module, args):
        if slow:
            time.sleep(slow[0])

    model.module.register_forward_pre_hook(stall)
    decided = 0
    for step in range(100):   # the hook times its sync modes for ~16 steps after a move to a new placement
        # One rank becomes slow right after a periodic re-check has decided (so no measuring pass absorbs the
        # slowdown into its figures, and a drift window fills before the next periodic check): its drift must
        # move every rank. Not while the hook times its sync modes, which holds the checks back. The log is the
        # same on every rank.
        now = sum(": re-check:" in e for e in trial.log)
        just_decided, decided = now > decided, now
        hook = model.module.sparsecomm_state
        if just_decided and not slow and trial.measuring is None and not hook.sync_mode_measuring \
                and rank == world - 1:
            slow.append(0.2)
        step_of(model, opt, step, rank, world)
        ref.step(step)
        measuring, mode = hook_mode(model, trial)
        assert mode == (False if measuring else "auto"), (step, measuring, mode)
        checks = [e for e in trial.log if ": re-check:" in e]
        drift = [e for e in trial.log if "on some rank: re-check" in e]
        if len(checks) >= 2 and drift and trial.log.index(drift[0]) < trial.log.index(checks[-1]):   # decided
            break
    assert_same(model, ref.model, f"after re-checks, world {world}")
    assert len(checks) >= 2 and drift, trial.report()
    return [e.split(":")[0] for e in trial.log]   # which steps decided: the same on every rank


def case_drift_gap(rank, world):
    """A drift re-check waits drift_gap re-checks' length after the decision (twice that after a drift re-check
    that kept the placement); the log says from which step, the same on every rank; exact throughout."""
    cls, kw = OPTIMIZERS["sgd"]
    config = quick(warmup=1, settle=1, measure=2, drift=0.5, drift_gap=5, sample=False)
    gap = 5 * 2 * (config.settle + config.measure)   # 30 steps: longer than the hook's timing of its sync modes
    model, opt = sparsecomm.parallelize(Model(), cls, trial=config, **kw)
    trial, ref = opt.trial, Reference("sgd")
    slow = []
    model.module.register_forward_pre_hook(lambda module, args: time.sleep(slow[0]) if slow else None)
    for step in range(120):
        hook = model.module.sparsecomm_state
        if trial.done and trial.measuring is None and not hook.sync_mode_measuring and not slow \
                and rank == world - 1:
            slow.append(0.1)   # from the first step the kept placement runs alone, one rank's steps drift
        step_of(model, opt, step, rank, world)
        ref.step(step)
        if any(": re-check:" in e for e in trial.log):
            break
    assert_same(model, ref.model, f"after a drift re-check, world {world}")
    decided = [e for e in trial.log if (": trial:" in e or ": re-check:" in e) and "; kept " in e]
    drift = [e for e in trial.log if "on some rank: re-check" in e]
    assert len(decided) == 2 and len(drift) == 1, trial.report()
    step_at = lambda entry: int(entry.split(":")[0].split()[1])   # noqa: E731
    first, again = step_at(decided[0]), step_at(decided[1])
    assert decided[0].endswith(f"a drift is looked for from step {first + gap}"), decided[0]
    # Without the wait the drift would show a window after the hook's timing (~15 steps after the decision).
    assert step_at(drift[0]) >= first + gap, trial.report()
    kept = [e.split("; kept ")[1].split(" (")[0] for e in decided]
    assert decided[1].endswith(f"from step {again + (2 * gap if kept[0] == kept[1] else gap)}"), trial.report()
    return [step_at(e) for e in trial.log if e.startswith("step")]


def case_confirm(rank, world):
    """The runner-up within ``confirm`` of the fastest: both measured again back to back, and those steps decide; exact
    throughout.

    Steps are made slow by a sleep per placement (replicated and row-sharded alike, the planned one far slower)."""
    cls, kw = OPTIMIZERS["sgd"]
    model, opt = sparsecomm.parallelize(Model(), cls, trial=quick(warmup=1, settle=1, measure=2,
                                                                        sample=False), **kw)
    trial, ref = opt.trial, Reference("sgd")
    sleeps = {"replicated": 0.15, "planned": 0.6, "row-sharded": 0.15}

    def stall(module, args):
        if not trial.done:
            time.sleep(sleeps[trial.candidates[trial.current].name])

    model.module.register_forward_pre_hook(stall)
    train_until_decided(model, opt, ref, rank, world, 30)
    assert_same(model, ref.model, f"after a confirmed trial, world {world}")
    again = [e for e in trial.log if "measured again, back to back" in e]
    close = ("replicated and row-sharded within 10%", "row-sharded and replicated within 10%")   # faster first
    assert trial.done and len(again) == 1 and any(c in again[0] for c in close), trial.report()
    assert trial.candidates[trial.kept].name in ("replicated", "row-sharded")
    assert trial.sampled_plan is None and len(trial.candidates) == 3
    # confirm=0: the first pass decides
    model, opt = sparsecomm.parallelize(Model(), cls, trial=quick(warmup=1, settle=1, measure=2, confirm=0),
                                        **kw)
    for step in range(20):
        step_of(model, opt, step, rank, world)
    assert opt.trial.done and not any("measured again" in e for e in opt.trial.log), opt.trial.report()
    # All three alike: the two fastest of the first pass are measured again, not the third.
    model, opt = sparsecomm.parallelize(Model(), cls, trial=quick(warmup=1, settle=1, measure=2, confirm=0.5,
                                                                        sample=False), **kw)
    third = opt.trial
    model.module.register_forward_pre_hook(lambda module, args: None if third.done else time.sleep(0.1))
    for step in range(30):
        if third.done:
            break
        step_of(model, opt, step, rank, world)
    again = [e for e in third.log if "measured again, back to back" in e]
    first = {c.name: float(again[0].split(f"{c.name} ")[1].split(",")[0].split(";")[0]) for c in third.candidates}
    named = [c.name for c in third.candidates if c.name in again[0].split("; ")[-1]]
    left = [n for n in first if n not in named]
    # the two named are the first pass's fastest (ties at two decimals either way), the third is not named
    assert third.done and len(again) == 1 and len(named) == 2 and len(left) == 1 and \
        first[left[0]] >= max(first[n] for n in named), third.report()
    return [e.split(":")[0] for e in trial.log]


def case_off(rank, world):
    """A plan given, or trial=False: no trial; a bad trial argument is refused."""
    net = Model()
    model, opt = sparsecomm.parallelize(net, torch.optim.SGD, plan=sparsecomm.plan(net), lr=0.1)
    assert opt.trial is None
    model, opt = sparsecomm.parallelize(Model(), torch.optim.SGD, trial=False, lr=0.1)
    assert opt.trial is None
    with pytest.raises(TypeError, match="trial must be"):
        sparsecomm.parallelize(Model(), torch.optim.SGD, trial="yes", lr=0.1)
    return True


def case_hook_trial(rank, world):
    """Once a placement is kept, the replicas' hook times its sync modes (eager_sparse='auto'); its eager steps,
    made 0.15 s slower here, are neither a drift of the kept placement nor kept themselves; training stays exact."""
    cls, kw = OPTIMIZERS["sgd"]
    # drift=5: a window of eager steps (~30x) is far past it, this machine's noise (~3x at worst) is not.
    model, opt = sparsecomm.parallelize(Model(), cls, trial=quick(warmup=1, settle=1, measure=2, drift=5.0,
                                                                        sample=False), **kw)
    trial, ref = opt.trial, Reference("sgd")
    real = SparseCommState.begin_step

    def slow_eager(state):
        eager = real(state)
        if eager:
            time.sleep(0.15)
        return eager

    SparseCommState.begin_step = slow_eager
    try:
        step = 0
        while step < 80 and not (trial.done and model.module.sparsecomm_state.eager_trial is not None
                                 and model.module.sparsecomm_state.eager_trial.eager is not None):
            step_of(model, opt, step, rank, world)
            ref.step(step)
            step += 1
        for extra in range(step, step + 10):   # a drift window after the hook's trial
            step_of(model, opt, extra, rank, world)
            ref.step(extra)
    finally:
        SparseCommState.begin_step = real
    state = model.module.sparsecomm_state
    assert_same(model, ref.model, f"after the hook's trial, world {world}")
    assert trial.done and state.eager_trial.eager is False, (trial.report(), state.eager_trial.reason)
    assert not any("re-check" in e for e in trial.log), trial.report()
    return True


def case_settle_pooling(rank, world):
    """By default a candidate is timed only once its tables' ``owner_pooling="auto"`` has timed both paths (8
    rounds after the move, one a step here): each move to a placement with such tables delays the decision by
    those steps less ``settle``; training stays exact."""
    cls, kw = OPTIMIZERS["sgd"]
    decided_at = {}
    for settle_pooling in (True, False):
        model, opt = sparsecomm.parallelize(Model(), cls, trial=TrialConfig(
            warmup=1, settle=1, measure=2, sample=False, confirm=0, drift=0, settle_pooling=settle_pooling), **kw)
        trial, ref = opt.trial, Reference("sgd")
        train_until_decided(model, opt, ref, rank, world, 60)
        assert_same(model, ref.model, f"settle_pooling={settle_pooling}, world {world}")
        assert trial.done and trial.moves >= 2, trial.report()   # replicated, then planned and row-sharded
        decided_at[settle_pooling] = int(next(e for e in trial.log if ": trial:" in e).split(":")[0].split()[1])
    assert decided_at[True] - decided_at[False] == 2 * (2 * (MEASURED_ROUNDS + 1) - 1), decided_at
    return decided_at


WHOLE = quick(warmup=1, settle=1, measure=2, drift=0, stale_replicas=False)   # moves send whole tables
CASES = [(f"trial-{n}", case_trial, (n,)) for n in OPTIMIZERS] + [
    ("trial-whole-adam", case_trial, ("adam", WHOLE)), ("pending", case_pending, ()), ("recheck", case_recheck, ()),
    ("drift-gap", case_drift_gap, ()), ("confirm", case_confirm, ()), ("off", case_off, ()),
    ("hook-trial", case_hook_trial, ()), ("settle-pooling", case_settle_pooling, ())]


spawned = spawned_fixture(CASES)   # worlds 2 and 3, every case in one spawn each


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_on_ranks(spawned, case):
    world, out = spawned
    results = [out[r][case] for r in range(world)]
    assert all(results), f"world {world}, {case}"
    if case in ("recheck", "confirm", "drift-gap"):
        assert len({tuple(r) for r in results}) == 1, f"ranks decided at different steps: {results}"
    if case.startswith("trial-"):
        assert len({r[0] for r in results}) == 1, f"ranks kept different placements: {results}"
        assert len({tuple(r[1]) for r in results}) == 1, "ranks decided from different figures"


def test_one_rank_has_no_trial_and_says_why_when_asked():
    model, opt = sparsecomm.parallelize(Model(), torch.optim.SGD, lr=0.1)
    assert opt.trial is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sparsecomm.parallelize(Model(), torch.optim.SGD, trial=True, lr=0.1)
    assert any("no placement trial: the model is not under DDP" in str(w.message) for w in caught)


def test_the_candidates_and_the_schedule_are_checked():
    p = sparsecomm.plan(Model())
    p.world_size = 2
    p.override("a", "shard", "table", owner=1)
    tried = candidates(p)
    assert [c.name for c in tried] == ["replicated", "planned", "row-sharded", "table-wise"]
    # Table-wise: "a" keeps its owner, the others spread by bytes served (then memory): b (larger) and c on 0.
    whole = {n: (t.placement, t.scheme, t.owner) for n, t in tried[3].plan.tables.items()}
    assert whole == {"a": ("shard", "table", 1), "b": ("shard", "table", 0), "c": ("shard", "table", 0)}, whole
    same = candidates(tried[2].plan)   # already row-sharded: the planned and row-sharded are one
    assert [c.name for c in same] == ["replicated", "planned", "table-wise"]
    assert [c.name for c in candidates(tried[3].plan)] == ["replicated", "planned", "row-sharded"]   # one
    p.memory_budget = 1
    assert "replicated" not in [c.name for c in candidates(p)]
    assert isinstance(candidates(p)[0], Candidate)
    for bad, match in ((dict(measure=0), "measure"), (dict(warmup=-1), "warmup"), (dict(margin=1.0), "margin"),
                       (dict(drift=-0.1), "drift"), (dict(confirm=-1), "confirm"),
                       (dict(drift_gap=-1), "drift_gap")):
        expect_value_error(lambda: TrialConfig(**bad), match)
