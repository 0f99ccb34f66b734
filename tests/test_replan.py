"""sparsecomm.replan: tables moved between placements mid-training train on exactly like single-process training.

A model with an EmbeddingBag, an Embedding with padding_idx (both sparse)
and a sparse=False Embedding goes through a chain of plans that moves every
table through every pair of placements (replicate, hash, range), one
training step between two plans, with SGD (and an LR scheduler made before
the first replan), Adagrad (also row-wise), Adam and SparseAdam. After
every step, every weight equals one process training on the whole batch
with torch's optimizers. Refusals
(pending gradients, a prefetched round, a plan of other tables, ranks'
plans that differ) raise on every rank and change nothing.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import sparsecomm
from sparsecomm import sharded
from sparsecomm.sharded.table import ShardedTable
from sparsecomm.stale import StaleReplicas

from distributed import expect_value_error, run_cases, run_ranks, weight_diffs

GLOBAL_BATCH = 6           # divisible by 1, 2 and 3
TOL = 1e-6
R, H, G = "replicate", "hash", "range"
# Each table's placement per plan: every pair of placements occurs for "a" and "b"; plan 7 shards nothing
# (the sharded part goes), plan 8 shards again (a sharded part is made).
CHAIN = {"a": [R, H, G, R, G, H, R, R, H],
         "b": [H, G, R, G, H, R, H, R, R],
         "c": [R, R, H, H, R, G, G, R, R]}   # sparse=False: replicated under Adam (a sharded Adam is lazy)
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.3)),
              "adagrad": (torch.optim.Adagrad, dict(lr=0.2, lr_decay=0.01, initial_accumulator_value=0.1)),
              "adam": (torch.optim.Adam, dict(lr=0.05)), "sparseadam": (torch.optim.SparseAdam, dict(lr=0.05))}
LAZY = ("adam", "sparseadam")   # SparseAdam's rule for the sparse tables, Adam's for the rest


class Net(nn.Module):
    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.EmbeddingBag(90, 4, mode="sum", sparse=True)
        self.b = nn.Embedding(70, 4, padding_idx=0, sparse=True)
        self.c = nn.Embedding(40, 4)
        self.mlp = nn.Linear(12, 1)
        self.double()

    def forward(self, batch):
        a, b, c = self.a(batch["a"]), self.b(batch["b"]), self.c(batch["c"])   # lookups first: one round
        return self.mlp(torch.cat([a, b.sum(1), c], 1)).squeeze(1)


def batch_of(step: int, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(500 + step)
    whole = {"a": torch.randint(0, 90, (GLOBAL_BATCH, 3), generator=g),
             "b": torch.randint(0, 70, (GLOBAL_BATCH, 2), generator=g),   # id 0 is the padding row
             "c": torch.randint(0, 40, (GLOBAL_BATCH,), generator=g),
             "y": torch.randn(GLOBAL_BATCH, generator=g, dtype=torch.float64)}
    per = GLOBAL_BATCH // world
    return {k: v[rank * per:(rank + 1) * per] for k, v in whole.items()}


def loss_of(model, b):
    return ((model(b) - b["y"]) ** 2).mean()


def chain(name: str):
    return {t: ([R] * len(p) if name in LAZY and t == "c" else p) for t, p in CHAIN.items()}


def inner_of(model):
    return getattr(model, "module", model)


def plan_for(p, placements, index):
    """``p`` with each table placed as ``placements`` says at ``index``."""
    for table, where in placements.items():
        if where[index] == R:
            p.override(table, R)
        else:
            p.override(table, "shard", where[index])
    return p


def scheduler(name, opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if name == "sgd" else None


class Reference:
    """One process, the whole batch, torch's optimizers (Adam: SparseAdam for the sparse tables)."""

    def __init__(self, name: str) -> None:
        cls, kw = OPTIMIZERS[name]
        self.model = Net()
        m = self.model
        if name in LAZY:
            self.opts = [torch.optim.Adam(list(m.c.parameters()) + list(m.mlp.parameters()), **kw),
                         torch.optim.SparseAdam([m.a.weight, m.b.weight], **kw)]
        else:
            self.opts = [cls(m.parameters(), **kw)]
        self.sched = scheduler(name, self.opts[0])

    def step(self, step: int) -> None:
        for o in self.opts:
            o.zero_grad()
        loss_of(self.model, batch_of(step)).backward()
        for o in self.opts:
            o.step()
        if self.sched:
            self.sched.step()


def assert_same(model, reference, what):
    diffs = weight_diffs(model, reference)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < TOL, f"{what}: {worst} differs by {diffs[worst]}"


def train_step(model, opt, sched, step, rank, world):
    opt.zero_grad()
    loss_of(model, batch_of(step, rank, world)).backward()
    opt.step()
    if sched:
        sched.step()


def placed(model) -> dict:
    inner = inner_of(model)
    return {n: (m.scheme if isinstance(m, ShardedTable) else R) for n, m in inner.named_children()
            if n in CHAIN}


def case_chain(rank, world, name, check_every_step=True):
    """Every migration pair, one step between plans, against the reference after each step."""
    cls, kw = OPTIMIZERS[name]
    placements = chain(name)
    net = Net(seed=3 if rank == 0 else 40 + rank)     # rank 0's weights win
    p0 = plan_for(sparsecomm.plan(net, small_table_bytes=0), placements, 0)
    model, opt = sparsecomm.parallelize(net, cls, plan=p0, **kw)
    sched, ref, first = scheduler(name, opt), Reference(name), opt
    steps = len(placements["a"])
    for i in range(steps):
        if i:
            new_plan = plan_for(copy.deepcopy(inner_of(model).sparsecomm_plan), placements, i)
            opt.zero_grad()
            model, opt = sparsecomm.replan(model, opt, new_plan)
        assert opt is first and placed(model) == {t: p[i] for t, p in placements.items()}
        train_step(model, opt, sched, i, rank, world)
        ref.step(i)
        if check_every_step or i == steps - 1:
            assert_same(model, ref.model, f"{name}, world {world}, after plan {i}")
    assert opt.param_groups[0]["lr"] == ref.opts[0].param_groups[0]["lr"]
    return [len(g["params"]) for g in opt.param_groups]


def case_checkpoint(rank, world, directory, stale=False):
    """After replans, a checkpoint (sharded.save, or DCP of the state dicts) loads into a model parallelized with
    the new plan (the optimizer has the same layout), and training goes on alike in all three.

    With stale replicas, table c's hash shard is spread over its kept replica: its checkpoints load into dense
    shards, and theirs back into it (over rows and state overwritten first)."""
    cls, kw = OPTIMIZERS["adagrad"]
    placements = chain("adagrad")
    net = Net()
    model, opt = sparsecomm.parallelize(net, cls, plan=plan_for(sparsecomm.plan(net, small_table_bytes=0),
                                                                placements, 0), **kw)
    ref, replicas = Reference("adagrad"), StaleReplicas() if stale else None
    for i in range(3):
        if i:
            opt.zero_grad()
            model, opt = sparsecomm.replan(model, opt, plan_for(copy.deepcopy(inner_of(model).sparsecomm_plan),
                                                                placements, i), stale=replicas)
        train_step(model, opt, None, i, rank, world)
        ref.step(i)
    assert inner_of(model).c.layout.spread == (stale and world > 1)
    sharded.save(directory, model, opt)
    fresh = Net(seed=77)
    model2, opt2 = sparsecomm.parallelize(fresh, cls, plan=sparsecomm.Plan.from_checkpoint(directory), **kw)
    assert placed(model2) == placed(model)
    sharded.load(directory, model2, opt2)
    # torch.distributed.checkpoint, of the model's and the optimizer's state dicts.
    dcp.save({"model": inner_of(model).state_dict(), "optim": opt.state_dict()}, checkpoint_id=directory + "-dcp")
    model3, opt3 = sparsecomm.parallelize(Net(seed=78), cls, plan=copy.deepcopy(inner_of(model).sparsecomm_plan),
                                          **kw)
    sd = {"model": inner_of(model3).state_dict(), "optim": opt3.state_dict()}
    dcp.load(sd, checkpoint_id=directory + "-dcp")
    inner_of(model3).load_state_dict(sd["model"])
    opt3.load_state_dict(sd["optim"])
    for step in (3, 4):
        for m, o in ((model, opt), (model2, opt2), (model3, opt3)):
            train_step(m, o, None, step, rank, world)
        ref.step(step)
    for m, what in ((model, "replanned"), (model2, "loaded from sharded.save"), (model3, "loaded through DCP")):
        assert_same(m, ref.model, f"{what}, world {world}")
    if stale:
        _load_back(directory, (model, opt), (model2, opt2), (model3, opt3), ref, rank, world)
    return True


def _overwrite(opt):
    """Every row and row state of ``opt``'s sharded tables set to junk (what a load must replace)."""
    with torch.no_grad():
        for t in opt.sharded.tables():
            t.local_weight.fill_(7.0)
            for v in opt.sharded.state[t.local_weight].values():
                if isinstance(v, torch.Tensor) and v.dim():
                    v.fill_(3.0)


def _load_back(directory, spread, dense, dense_dcp, ref, rank, world):
    """The dense models' checkpoints (sharded.save, then DCP) load into the spread model; training goes on alike."""
    (model, opt), (model2, opt2), (model3, opt3) = spread, dense, dense_dcp
    sharded.save(directory + "-back", model2, opt2)
    _overwrite(opt)
    sharded.load(directory + "-back", model, opt)
    train_step(model, opt, None, 5, rank, world)
    train_step(model2, opt2, None, 5, rank, world)
    dcp.save({"model": inner_of(model2).state_dict(), "optim": opt2.state_dict()},
             checkpoint_id=directory + "-back-dcp")
    _overwrite(opt)
    sd = {"model": inner_of(model).state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=directory + "-back-dcp")
    inner_of(model).load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    ref.step(5)
    for step in (6,):
        for m, o in ((model, opt), (model2, opt2)):
            train_step(m, o, None, step, rank, world)
        ref.step(step)
    assert inner_of(model).c.layout.spread == (world > 1)
    assert_same(model, ref.model, f"spread, loaded back, world {world}")
    assert_same(model2, ref.model, f"dense, world {world}")


def _types(model):
    return {n: (type(m).__name__, getattr(m, "scheme", None)) for n, m in inner_of(model).named_children()}


def case_refusals(rank, world):
    """Every refusal on every rank, before anything changes; then the same replan succeeds."""
    cls, kw = OPTIMIZERS["adagrad"]
    net = Net()
    p = plan_for(sparsecomm.plan(net, small_table_bytes=0), {"a": [R], "b": [H], "c": [R]}, 0)
    model, opt = sparsecomm.parallelize(net, cls, plan=p, **kw)
    before, ref = _types(model), Reference("adagrad")
    target = plan_for(copy.deepcopy(p), {"a": [G], "b": [R], "c": [H]}, 0)
    # Gradients pending (between backward and step, as in gradient accumulation).
    loss_of(model, batch_of(0, rank, world)).backward()
    expect_value_error(lambda: sparsecomm.replan(model, opt, target), "gradients are pending")
    opt.step()
    ref.step(0)
    expect_value_error(lambda: sparsecomm.replan(model, opt, target), "zero_grad")   # stepped, not cleared yet
    opt.zero_grad()
    # One rank alone with a gradient: every rank refuses, naming it.
    if world > 1:
        if rank == 1:
            inner_of(model).mlp.bias.grad = torch.ones_like(inner_of(model).mlp.bias)
        msg = expect_value_error(lambda: sparsecomm.replan(model, opt, target), "gradients are pending")
        assert rank == 1 or "rank 1" in msg
        opt.zero_grad()
    # A prefetched round pending.
    table = inner_of(model).b
    handle = table.prefetch(batch_of(1, rank, world)["b"])
    expect_value_error(lambda: sparsecomm.replan(model, opt, target), "prefetched round")
    with torch.no_grad():
        table(handle)
        table.table_set.flush()
    # A forward whose backward has not run.
    out = loss_of(model, batch_of(1, rank, world))
    expect_value_error(lambda: sparsecomm.replan(model, opt, target), "awaits its backward")
    del out
    gc.collect()   # the graph holds reference cycles: freed by the collector, and its round with it
    # Plans of other tables; ranks whose plans differ; an optimizer option a shard cannot follow.
    extra = copy.deepcopy(target)
    extra.tables["zzz"] = copy.deepcopy(extra.tables["a"])
    expect_value_error(lambda: sparsecomm.replan(model, opt, extra), "tables not in the model ['zzz']")
    fewer = copy.deepcopy(target)
    del fewer.tables["c"]
    expect_value_error(lambda: sparsecomm.replan(model, opt, fewer), "missing from the plan ['c']")
    if world > 1:
        odd = plan_for(copy.deepcopy(target), {"a": [H]}, 0) if rank == world - 1 else target
        expect_value_error(lambda: sparsecomm.replan(model, opt, odd), "pass the same plan on every rank")
    expect_value_error(lambda: sparsecomm.replan(model, torch.optim.SGD(net.mlp.parameters(), lr=0.1), target),
                       "ParallelOptimizer")
    assert _types(model) == before and inner_of(model).sparsecomm_plan is p
    # Nothing changed: the replan now goes through and training equals the reference.
    model, opt = sparsecomm.replan(model, opt, target)
    assert _types(model) == {"a": ("ShardedEmbeddingBag", G), "b": ("Embedding", None),
                             "c": ("ShardedEmbedding", H), "mlp": ("Linear", None)}
    train_step(model, opt, None, 1, rank, world)
    ref.step(1)
    assert_same(model, ref.model, f"after the refusals, world {world}")
    return True


def case_options(rank, world):
    """Options a shard cannot follow are refused (SGD momentum); a replica of a frozen table cannot be sharded."""
    net = Net()
    net.c.weight.requires_grad_(False)
    p = sparsecomm.plan(net, small_table_bytes=0)
    for t in ("a", "b", "c"):
        p.override(t, R)
    model, opt = sparsecomm.parallelize(net, torch.optim.SGD, plan=p, lr=0.1, momentum=0.9)
    expect_value_error(lambda: sparsecomm.replan(model, opt, plan_for(copy.deepcopy(p), {"a": [H]}, 0)), "momentum")
    frozen = copy.deepcopy(p)
    frozen.tables["c"].placement = "shard"
    expect_value_error(lambda: sparsecomm.replan(model, opt, frozen), "frozen")
    assert all(type(m) in (nn.Embedding, nn.EmbeddingBag, nn.Linear) for m in inner_of(model).children())
    # A table keeps its learning rate: joining a group with another one is refused.
    net = Net()
    p = plan_for(sparsecomm.plan(net, small_table_bytes=0), {"a": [H], "b": [R], "c": [R]}, 0)
    model, opt = sparsecomm.parallelize(net, torch.optim.SGD, plan=p, lr=0.1)
    opt.sharded.param_groups[0]["lr"] = 0.05
    expect_value_error(lambda: sparsecomm.replan(model, opt, plan_for(copy.deepcopy(p), {"a": [R]}, 0)),
                       "would change its hyperparameters {'lr': (0.05, 0.1)}")
    assert isinstance(inner_of(model).a, sharded.ShardedEmbeddingBag)
    return True


class RowwiseReference(Reference):
    """Row-wise Adagrad by hand for tables a and b (one sum per row: the mean of g^2), torch's Adagrad for the rest."""

    def __init__(self, kw) -> None:
        self.model, self.kw, self.steps = Net(), kw, 0
        m = self.model
        self.opts = [torch.optim.Adagrad(list(m.c.parameters()) + list(m.mlp.parameters()), **kw)]
        self.sched = None
        self.sums = {t: torch.full((getattr(m, t).num_embeddings,), kw["initial_accumulator_value"],
                                   dtype=torch.float64) for t in ("a", "b")}

    def step(self, step: int) -> None:
        for t in ("a", "b"):
            getattr(self.model, t).weight.grad = None
        super().step(step)
        self.steps += 1
        clr = self.kw["lr"] / (1 + (self.steps - 1) * self.kw["lr_decay"])
        with torch.no_grad():
            for t, acc in self.sums.items():
                w = getattr(self.model, t).weight
                g = w.grad.coalesce()
                rows, values = g.indices()[0], g.values()
                acc[rows] += values.pow(2).mean(1)
                w[rows] -= clr * values / (acc[rows].sqrt() + 1e-10).unsqueeze(1)


def case_rowwise(rank, world):
    """Row-wise Adagrad's sums move with their rows between hash and range; to a replica they are refused."""
    cls, kw = OPTIMIZERS["adagrad"]
    placements = {"a": [H, G, H, G], "b": [G, H, H, G], "c": [R] * 4}
    net = Net()
    model, opt = sparsecomm.parallelize(net, cls, plan=plan_for(sparsecomm.plan(net, small_table_bytes=0),
                                                                placements, 0), **kw)
    tables = opt.sharded.tables()
    opt.set_parts({**opt.parts, "sharded": sharded.ShardedAdagrad(tables, rowwise=True, lr=kw["lr"],
                                                                   lr_decay=kw["lr_decay"],
                                                                   initial_accumulator_value=0.1)})
    ref = RowwiseReference(kw)
    for i in range(4):
        if i:
            model, opt = sparsecomm.replan(model, opt, plan_for(copy.deepcopy(inner_of(model).sparsecomm_plan),
                                                                placements, i))
            assert opt.sharded.rowwise and placed(model) == {t: p[i] for t, p in placements.items()}
        train_step(model, opt, None, i, rank, world)
        opt.zero_grad()
        ref.step(i)
        assert_same(model, ref.model, f"row-wise Adagrad, world {world}, after plan {i}")
    to_replica = plan_for(copy.deepcopy(inner_of(model).sparsecomm_plan), {"a": [R]}, 0)
    expect_value_error(lambda: sparsecomm.replan(model, opt, to_replica), "row-wise")
    return True


CASES = {"chain": case_chain, "rowwise": case_rowwise, "checkpoint": case_checkpoint, "refusals": case_refusals, "options": case_options}


def worker(rank, world, cases):
    return run_cases(rank, world, [(name, CASES[name.split(":")[0]], args) for name, args in cases])


def _chains(names, every_step=True):
    return [(f"chain:{n}", (n, every_step)) for n in names]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("replan") / "ckpt")
    every = _chains(OPTIMIZERS) + [("rowwise", ()), ("refusals", ()), ("options", ()),
                                   ("checkpoint", (directory + "-2",)), ("checkpoint:stale", (directory + "-2s", True))]
    return {2: run_ranks(2, worker, every, join_timeout_s=300),
            3: run_ranks(3, worker, _chains(["adam"]) + [("rowwise", ()), ("refusals", ())], join_timeout_s=300)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_migration_pair_trains_like_one_process_at_world_2(runs, name):
    assert all(runs[2][r][f"chain:{name}"] for r in range(2))


def test_migrations_at_world_3(runs):
    assert all(runs[3][r]["chain:adam"] for r in range(3))


@pytest.mark.parametrize("world", [2, 3])
def test_refusals_change_nothing_on_every_rank(runs, world):
    assert all(runs[world][r]["refusals"] for r in range(world))


@pytest.mark.parametrize("world", [2, 3])
def test_rowwise_adagrad_moves_between_schemes(runs, world):
    assert all(runs[world][r]["rowwise"] for r in range(world))


def test_options_a_shard_cannot_follow_are_refused(runs):
    assert all(runs[2][r]["options"] for r in range(2))


@pytest.mark.parametrize("case", ["checkpoint", "checkpoint:stale"])
def test_a_checkpoint_after_replans_loads_into_the_new_plan(runs, case):
    assert all(runs[2][r][case] for r in range(2))


def test_without_torch_distributed_it_is_a_world_of_one():
    case_chain(0, 1, "sgd")
    assert case_refusals(0, 1) and case_options(0, 1) and case_rowwise(0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_every_pair_every_optimizer_at_worlds_1_and_3(world, tmp_path):
    cases = _chains(OPTIMIZERS) + [("rowwise", ()), ("refusals", ()), ("options", ()),
                                   ("checkpoint", (str(tmp_path / "c"),))]
    out = run_ranks(world, worker, cases, join_timeout_s=600)
    assert all(all(out[r].values()) for r in range(world))
