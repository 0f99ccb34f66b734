"""``sparsecomm.pipeline``: the next batch's ids prefetched while the current batch trains, training unchanged.

A DLRM-like model with three bag tables (one table-wise, one row-sharded by
hash, one replicated) and an MLP, uneven batches per rank with empty bags,
trained with SGD, Adagrad and Adam: the pipelined loop against the plain loop
(the same rounds, only the ids moved early) and against one process on
every rank's batch. Also: a model whose forward computes its ids
(nothing to prefetch: the reason is given, training is unchanged), a replan
in the middle of the loop, and the placement trial moving tables under it.
"""

import copy

import pytest
import torch
import torch.nn as nn

import sparsecomm

from distributed import full_weights, run_cases, run_ranks, weight_diffs

ROWS, D, STEPS = (200, 150, 40), 4, 6
TOL = 1e-9
BIG = (300_000, 200_000, 150_000)   # tables of 4 MiB or more: the placement trial tries them sharded
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.3)), "adagrad": (torch.optim.Adagrad, dict(lr=0.2)),
              "adam": (torch.optim.Adam, dict(lr=0.05))}


class Net(nn.Module):
    def __init__(self, computed_ids: bool = False, rows=ROWS) -> None:
        super().__init__()
        torch.manual_seed(3)
        for i, r in enumerate(rows):   # direct children: tests/distributed.full_weights reads them
            setattr(self, f"t{i}", nn.EmbeddingBag(r, D, mode="sum", sparse=True))
        self.bottom = nn.Linear(2, D)
        self.top = nn.Sequential(nn.Linear(D * (len(ROWS) + 1), 6), nn.Tanh(), nn.Linear(6, 1))
        self.computed_ids = computed_ids
        self.double()

    def tables(self):
        return [getattr(self, f"t{i}") for i in range(len(ROWS))]

    def forward(self, b):
        ids = [x % r for x, r in zip(b["ids"], ROWS)] if self.computed_ids else b["ids"]
        pooled = [t(i, o) for t, i, o in zip(self.tables(), ids, b["offsets"])]
        return self.top(torch.cat([self.bottom(b["dense"])] + pooled, 1)).squeeze(1)


def rank_batch(rank: int, step: int, empty: bool = False):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 2 + 2 * rank   # uneven batches
    ids, offsets = [], []
    for r in ROWS:
        lengths = torch.randint(0, 4, (n,), generator=g) * (not empty)   # empty bags among them
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]))
        ids.append((torch.rand(int(lengths.sum()), generator=g) ** 2 * r).long())   # skewed ids
    return {"ids": ids, "offsets": offsets, "dense": torch.randn(n, 2, generator=g, dtype=torch.float64),
            "y": torch.randn(n, generator=g, dtype=torch.float64)}


def whole_batch(world: int, step: int):
    parts = [rank_batch(r, step) for r in range(world)]
    ids, offsets = [], []
    for t in range(len(ROWS)):
        ids.append(torch.cat([p["ids"][t] for p in parts]))
        lengths = torch.cat([torch.diff(p["offsets"][t], append=torch.tensor([p["ids"][t].numel()])) for p in parts])
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]))
    return {"ids": ids, "offsets": offsets, "dense": torch.cat([p["dense"] for p in parts]),
            "y": torch.cat([p["y"] for p in parts])}


def plan_for(model, world, base=None, **overrides):
    plan = copy.deepcopy(base) if base is not None else sparsecomm.plan(model, small_table_bytes=0)
    for name, how in {"t0": ("shard", "table", world - 1), "t1": ("shard", "hash", None),
                      "t2": ("replicate", None, None), **overrides}.items():
        plan.override(name, how[0], how[1], owner=how[2])
    return plan


def train(model, opt, batches, ranks=1):
    """Steps on ``batches``; the loss is a sum over the samples / (4 x ranks): DDP's mean over ranks of each
    rank's loss is then the loss of one process on the whole batch (``ranks``: world), however uneven."""
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = ((model(b) - b["y"]) ** 2).sum() / (4 * ranks)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def parallel(world, name, computed_ids=False, **kwargs):
    model = Net(computed_ids)
    cls, kw = OPTIMIZERS[name]
    return sparsecomm.parallelize(model, cls, **{"plan": plan_for(model, world), **kwargs}, **kw)


def reference(world, name, steps=STEPS, rows=ROWS):
    model = Net(rows=rows)
    cls, kw = OPTIMIZERS[name]
    if cls is torch.optim.Adam:   # lazy Adam on the tables, as parallelize's sharded and replicated tables get
        tables = [t.weight for t in model.tables()]
        opt = sparsecomm.sharded.combined.build_optimizer(cls, kw, [p for p in model.parameters() if all(
            p is not t for t in tables)], tables, [])
    else:
        opt = cls(model.parameters(), **kw)
    train(model, opt, [whole_batch(world, s) for s in range(steps)], ranks=world)
    return model


def last_reason(world):
    """Why the last batch prefetches nothing: no next batch, as every rank agreed (alone: no agreement made)."""
    return "no next batch" if world == 1 else "some rank has no next batch, or one of another structure"


def case_equal(rank, world, name):
    """Pipelined = plain; both = one process on the whole batch; every next batch prefetched."""
    batches = [rank_batch(rank, s) for s in range(STEPS)]
    plain, plain_opt = parallel(world, name)
    plain_losses = train(plain, plain_opt, batches)
    ours, opt = parallel(world, name)
    pipe = sparsecomm.pipeline(batches, ours)
    losses = train(ours, opt, pipe)
    # The same rounds, only the ids moved early; the replicated table's hook measures its sync mode and paths
    # in each job, which may sum in another order: equal to float64 roundoff, not always bit for bit.
    assert len(losses) == STEPS and all(abs(float(a - b)) < 1e-12 for a, b in zip(losses, plain_losses)), \
        (losses, plain_losses)
    got, want = full_weights(ours), full_weights(plain)
    assert set(got) == set(want) and all(torch.allclose(got[k], want[k], rtol=0, atol=1e-12) for k in want), name
    worst = max(weight_diffs(ours, reference(world, name)).values())
    assert worst < TOL, (name, worst)
    # Two sharded tables (t0 table-wise, t1 by hash; a world of one holds them whole): each next batch's
    # lookups were prefetched and taken.
    assert (pipe.prefetched, pipe.used, pipe.reason) == (STEPS - 1, 2 * (STEPS - 1), last_reason(world)), \
        (pipe.prefetched, pipe.used, pipe.reason)
    return worst


def case_computed_ids(rank, world):
    """A forward that computes its ids: nothing prefetched, the reason given, training unchanged."""
    ours, opt = parallel(world, "adagrad", computed_ids=True)
    pipe = sparsecomm.pipeline((rank_batch(rank, s) for s in range(STEPS)), ours)
    train(ours, opt, pipe)
    assert pipe.prefetched == 0 and pipe.used == 0
    assert "not one of the batch's" in pipe.reason, pipe.reason
    assert max(weight_diffs(ours, reference(world, "adagrad")).values()) < TOL
    return True


def case_computed_ids_one_rank_empty(rank, world):
    """Computed ids, and rank 0's ids all empty (empty tensors share one address): no rank prefetches (a rank
    that did would wait forever in an all-to-all the others never start); training is unchanged."""
    ours, opt = parallel(world, "sgd", computed_ids=True)
    batches = [rank_batch(rank, s, empty=rank == 0) for s in range(STEPS)]
    pipe = sparsecomm.pipeline(batches, ours)
    train(ours, opt, pipe)
    assert pipe.prefetched == 0 and "not one of the batch's" in pipe.reason, (pipe.prefetched, pipe.reason)
    return True


def case_ranks_disagree_on_the_next_batch(rank, world):
    """The last rank's batch 2 has another structure (an extra feature): at batches 1 and 2 every rank agrees
    not to prefetch (one would otherwise start a collective the others do not), then they go on prefetching."""
    ours, opt = parallel(world, "adagrad")
    batches = [rank_batch(rank, s) for s in range(STEPS)]
    if rank == world - 1:
        batches[2] = {**batches[2], "unused": torch.zeros(1)}
    pipe = sparsecomm.pipeline(batches, ours)
    reasons = []
    for b in pipe:
        train(ours, opt, [b])
        reasons.append(pipe.reason)
    other = "some rank has no next batch, or one of another structure" if world > 1 else \
        "the next batch has another structure than this one"
    assert reasons == ["", other, other, "", "", last_reason(world)], reasons   # batch 2's next differs from it too
    assert pipe.prefetched == STEPS - 3, (pipe.prefetched, reasons)
    assert max(weight_diffs(ours, reference(world, "adagrad")).values()) < TOL
    return True


def case_eval_forward_between(rank, world):
    """A forward without gradient on the same batch after each step (an evaluation): the next batch's prefetched
    round waits for its own lookups (the evaluation runs a round of its own), none is wasted."""
    ours, opt = parallel(world, "sgd")
    pipe = sparsecomm.pipeline([rank_batch(rank, s) for s in range(STEPS)], ours)
    for b in pipe:
        train(ours, opt, [b])
        with torch.no_grad():
            ours(b)
    assert (pipe.prefetched, pipe.used) == (STEPS - 1, 2 * (STEPS - 1)), (pipe.prefetched, pipe.used, pipe.reason)
    assert max(weight_diffs(ours, reference(world, "sgd")).values()) < TOL
    return True


def case_replan_between(rank, world):
    """A replan after step 3 (table-wise -> hash, hash -> replicated) drops the prefetched round; the pipeline
    prefetches the moved tables from the next forward on, and training matches the reference."""
    ours, opt = parallel(world, "adagrad")
    pipe = sparsecomm.pipeline([rank_batch(rank, s) for s in range(STEPS)], ours)
    for step, b in enumerate(pipe):
        train(ours, opt, [b])
        if step == 2:   # the next batch's round is prefetched now: replan ends it instead of refusing
            opt.zero_grad()
            ours, opt = sparsecomm.replan(ours, opt, plan_for(None, world, ours.module.sparsecomm_plan, **{
                "t0": ("shard", "hash", None), "t1": ("replicate", None, None)}))
            used = pipe.used
    assert max(weight_diffs(ours, reference(world, "adagrad")).values()) < TOL
    assert pipe.used == used + (STEPS - 4), (pipe.used, used)   # one sharded table from step 5 on
    return True


def case_trial(rank, world):
    """parallelize's placement trial moves the tables while the pipeline runs: it decides, training is exact."""
    model = Net(rows=BIG)
    steps = 24
    ours, opt = sparsecomm.parallelize(model, torch.optim.SGD, lr=0.3,
                                       trial=sparsecomm.TrialConfig(warmup=1, settle=1, measure=2, sample=False,
                                                                    settle_pooling=False))
    pipe = sparsecomm.pipeline([rank_batch(rank, s) for s in range(steps)], ours)
    for b in pipe:
        train(ours, opt, [b])
    assert opt.trial.done, opt.trial.report()
    assert opt.trial.moves >= 1, opt.trial.report()
    assert pipe.used > 0, pipe.reason   # the sharded candidates' steps took prefetched rounds
    assert max(weight_diffs(ours, reference(world, "sgd", steps, BIG)).values()) < TOL
    return True


def _worker(rank, world):
    cases = [(f"equal_{name}", case_equal, (name,)) for name in OPTIMIZERS]
    cases += [("computed", case_computed_ids, ()), ("empty", case_computed_ids_one_rank_empty, ()),
              ("disagree", case_ranks_disagree_on_the_next_batch, ()), ("eval", case_eval_forward_between, ()),
              ("replan", case_replan_between, ()), ("trial", case_trial, ())]
    return run_cases(rank, world, cases if world > 1 else cases[:7])


_RUNS = {}


def runs(world):
    if world not in _RUNS:
        _RUNS[world] = run_ranks(world, _worker, join_timeout_s=300)
    return _RUNS[world]


WORLDS = [1, 2, pytest.param(3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_pipelined_training_equals_the_plain_loop_and_one_process(world, name):
    assert all(runs(world)[r][f"equal_{name}"] < TOL for r in range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_ids_computed_in_the_forward_are_not_prefetched_and_training_is_unchanged(world):
    assert all(runs(world)[r]["computed"] for r in range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_decides_alike_whether_to_prefetch(world):
    assert all(runs(world)[r]["empty"] and runs(world)[r]["disagree"] for r in range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_an_evaluation_forward_between_steps_wastes_no_prefetched_round(world):
    assert all(runs(world)[r]["eval"] for r in range(world))


@pytest.mark.parametrize("world", WORLDS[1:])
def test_a_replan_in_the_loop_drops_the_prefetched_round_and_training_goes_on_exactly(world):
    assert all(runs(world)[r]["replan"] for r in range(world))


@pytest.mark.parametrize("world", WORLDS[1:])
def test_the_placement_trial_moves_tables_under_the_pipeline(world):
    assert all(runs(world)[r]["trial"] for r in range(world))
