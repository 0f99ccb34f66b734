"""eager_sparse='auto': the hook times whole steps in each mode and every rank keeps the same, faster one."""

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.hooks import eager_trial, hook
from sparsecomm.hooks.eager_trial import SAMPLES, START, WARMUP, EagerTrial

from distributed import run_ranks
from test_ddp_hook import Net, batch, make_optimizers, max_diff, train_step

PHASE = WARMUP + SAMPLES   # steps per mode in a trial
SETTLED = START + 2 * PHASE   # the step at whose end the first trial is settled


class Clock:
    """A stand-in for time.perf_counter that the test advances by each step's made-up cost."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def _run_trial(monkeypatch, cost, steps, every=0):
    """Drive an EagerTrial on one process; ``cost(step, eager)``: that step's seconds. The modes per step."""
    clock = Clock()
    monkeypatch.setattr(eager_trial, "time", clock)
    monkeypatch.setattr(eager_trial, "max_over_ranks", lambda values, group, device: list(values))
    trial, modes = EagerTrial(every), []
    for step in range(1, steps + 1):
        eager = trial.begin(step)
        modes.append(eager)
        clock.now += cost(step, eager)
        trial.end(None, torch.device("cpu"))
    return trial, modes


@pytest.mark.parametrize("eager_cost,kept", [(0.005, True), (0.020, False), (0.010, False), (0.0097, False)],
                         ids=["eager-faster", "fused-faster", "tie-keeps-fused", "within-margin-keeps-fused"])
def test_the_trial_tries_each_mode_then_keeps_the_faster(monkeypatch, eager_cost, kept):
    trial, modes = _run_trial(monkeypatch, lambda step, eager: eager_cost if eager else 0.010, SETTLED + 5)
    # Fused before the trial, eager in its first half (the job's first steps, warm-up included, fall on the mode
    # that must win by a margin), fused in its second half, then the kept mode.
    assert modes[:START - 1] == [False] * (START - 1)
    assert modes[START - 1:START - 1 + PHASE] == [True] * PHASE
    assert modes[START - 1 + PHASE:START - 1 + 2 * PHASE] == [False] * PHASE
    # The last trial step is timed when the next one opens and settled when that one ends: one step late.
    assert modes[SETTLED - 1] is False and modes[SETTLED:] == [kept] * 5
    assert trial.eager is kept and "fused 10" in trial.reason and f"eager {1e3 * eager_cost:.3g}" in trial.reason


def test_warmup_steps_are_not_counted_and_the_trial_repeats(monkeypatch):
    # The first step of each mode is slow (a switch); only the steps after it count.
    def cost(step, eager):
        first = step in (START, START + PHASE, 40, 40 + PHASE)
        return 1.0 if first else (0.005 if eager else 0.010) if step < 30 else (0.020 if eager else 0.010)

    every = 40 - SETTLED   # the next trial starts at step 40
    trial, modes = _run_trial(monkeypatch, cost, 40 + 2 * PHASE + 3, every=every)
    assert modes[SETTLED] is True   # the first trial: eager, its slow first step not counted
    assert modes[39:39 + PHASE] == [True] * PHASE and modes[39 + PHASE:39 + 2 * PHASE] == [False] * PHASE
    assert trial.eager is False and modes[-1] is False   # measured again from step 40: now fused is faster


def _agreement_worker(rank, world):
    """Rank 0 finds eager steps faster, rank 1 slower: both keep what the slowest rank measured (fused),
    and train like plain DDP through the switches; eager steps sync each sparse bucket on its own."""
    clock = Clock()
    eager_trial.time = clock
    syncs = []
    real = hook.sparse_allreduce_coalesced
    hook.sparse_allreduce_coalesced = lambda tensors, *a, **k: syncs.append(len(tensors)) or real(tensors, *a, **k)
    torch.manual_seed(0)
    base = Net()
    ours = DDP(copy.deepcopy(base))
    state = sparsecomm.register(ours)
    ref = DDP(Net(sparse=False))
    ref.module.load_state_dict(base.state_dict())
    o1, o2 = make_optimizers(ours.module, "sgd"), make_optimizers(ref.module, "sgd")
    per_step, worst = [], 0.0
    for step in range(SETTLED + 3):
        before = len(syncs)
        train_step(ours, o1, batch(rank, step))
        train_step(ref, o2, batch(rank, step))
        worst = max(worst, max_diff(ours.module, ref.module))
        per_step.append((state.step.eager, syncs[before:]))
        clock.now += (0.005 if rank == 0 else 0.020) if state.step.eager else 0.010
    return dict(per_step=per_step, worst=worst, eager=state.eager_trial.eager, reason=state.eager_trial.reason,
                summary=state.summary())


def test_every_rank_keeps_the_mode_of_the_slowest_rank_and_trains_like_ddp():
    res = run_ranks(2, _agreement_worker)
    for rank, r in res.items():
        assert r["worst"] <= 2e-5, (rank, r["worst"])
        assert r["eager"] is False and "eager 20" in r["reason"] and "fused 10" in r["reason"], r["reason"]
        assert "sparse syncs: fused per step" in r["summary"]
        eager_steps = [syncs for eager, syncs in r["per_step"] if eager]
        fused_steps = [syncs for eager, syncs in r["per_step"] if not eager]
        assert len(eager_steps) == PHASE and r["per_step"][-1][0] is False
        # Three sparse tables and the small dense bucket that rides with them: eager steps sync each alone,
        # fused steps all four together.
        assert all(syncs == [1, 1, 1, 1] for syncs in eager_steps), eager_steps
        assert all(syncs == [4] for syncs in fused_steps), fused_steps
    assert res[0]["per_step"] == res[1]["per_step"]   # the same mode and syncs on every rank, every step
