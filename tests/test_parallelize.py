"""sparsecomm.plan + parallelize: a single-process model trained on N ranks equals single-process training.

The model has every kind of table the planner meets: a large EmbeddingBag
(1-D ids with offsets, empty bags), a small Embedding, an EmbeddingBag with
per-sample weights, an Embedding with padding_idx looked up twice, and a
sparse=False table, plus an MLP. Each world size (1, 2, 3) trains it with
SGD (and an LR scheduler), Adagrad and Adam through ``parallelize`` and
compares every weight with one process training on the whole batch. The
world-3 run saves a checkpoint; the world-2 run loads it and continues like
the reference does. Errors are raised before anything is modified, on every rank.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

import sparsecomm
from sparsecomm import sharded
from sparsecomm.sharded.lookup import PendingLookup

from distributed import expect_value_error, run_cases, run_ranks, weight_diffs

GLOBAL_BATCH = 12          # divisible by 1, 2 and 3: every rank gets the same number of samples
STEPS = 4
TOL = 1e-5
SHARD = {"large": "hash", "weighted": "range", "padded": "hash"}
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.5)), "adagrad": (torch.optim.Adagrad, dict(lr=0.3)),
              "adam": (torch.optim.Adam, dict(lr=0.05))}


class Net(nn.Module):
    def __init__(self, seed: int, large_rows: int = 2000) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.large = nn.EmbeddingBag(large_rows, 6, mode="mean", sparse=True)
        self.small = nn.Embedding(50, 6, sparse=True)
        self.weighted = nn.EmbeddingBag(300, 6, mode="sum", sparse=True)
        self.padded = nn.Embedding(400, 6, padding_idx=0, sparse=True)
        self.dense_table = nn.Embedding(60, 6)
        self.mlp = nn.Sequential(nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 1))
        self.double()

    def forward(self, b):
        # Lookups first, then their use: sharded tables' lookups then share one round.
        large, small = self.large(b["bag_ids"], b["bag_offsets"]), self.small(b["small"])
        weighted = self.weighted(b["w_ids"], per_sample_weights=b["w_psw"])
        p1, p2 = self.padded(b["p1"]), self.padded(b["p2"])
        parts = [large, small, weighted, p1.sum(1), p2.mean(1), self.dense_table(b["d"])]
        return self.mlp(torch.cat(parts, 1)).squeeze(1)


def global_batch(step: int):
    """The step's whole batch, as per-sample pieces (so any split into ranks is easy)."""
    g = torch.Generator().manual_seed(1000 + step)
    zipf = lambda n, hi: (torch.rand(n, generator=g) ** 3 * hi).long().clamp_(0, hi - 1)  # skewed ids
    bags = [zipf(int(torch.randint(0, 5, (1,), generator=g)), 2000) for _ in range(GLOBAL_BATCH)]  # empty bags too
    return {"bags": bags, "small": zipf(GLOBAL_BATCH, 50), "w_ids": zipf(GLOBAL_BATCH * 3, 300).view(-1, 3),
            "w_psw": torch.rand(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64),
            "p1": zipf(GLOBAL_BATCH * 2, 400).view(-1, 2), "p2": zipf(GLOBAL_BATCH * 3, 400).view(-1, 3),
            "d": torch.randint(0, 60, (GLOBAL_BATCH,), generator=g),
            "y": torch.randn(GLOBAL_BATCH, generator=g, dtype=torch.float64)}


def split(batch, rank: int, world: int):
    per = GLOBAL_BATCH // world
    sl = slice(rank * per, (rank + 1) * per)
    bags = batch["bags"][sl]
    lengths = torch.tensor([len(b) for b in bags])
    out = {k: v[sl] for k, v in batch.items() if k != "bags"}
    out["bag_ids"] = torch.cat(bags) if bags else torch.empty(0, dtype=torch.int64)
    out["bag_offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return out


def loss_of(model, b):
    return ((model(b) - b["y"]) ** 2).mean()


def reference_optimizer(model: Net, name: str):
    cls, kw = OPTIMIZERS[name]
    if name == "adam":  # parallelize's rule: Adam for dense gradients, lazy (SparseAdam) for sparse tables
        sparse = [m.weight for m in (model.large, model.small, model.weighted, model.padded)]
        ids = {id(p) for p in sparse}
        return [torch.optim.Adam([p for p in model.parameters() if id(p) not in ids], **kw),
                torch.optim.SparseAdam(sparse, **kw)]
    return [cls(model.parameters(), **kw)]


def train_reference(name: str, steps, model=None, opts=None):
    model = model or Net(seed=7)
    opts = opts or reference_optimizer(model, name)
    sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5) if name == "sgd" else None
    for step in steps:
        for o in opts:
            o.zero_grad()
        loss_of(model, split(global_batch(step), 0, 1)).backward()
        for o in opts:
            o.step()
        if sched:
            sched.step()
    return model, opts


def make_plan(model, world_size):
    p = sparsecomm.plan(model, small_table_bytes=0)
    for name, placement in (("small", "replicate"), ("dense_table", "replicate")):
        p.override(name, placement)
    for name, scheme in SHARD.items():
        p.override(name, "shard", scheme)
    return p


def assert_same(model, reference, what):
    diffs = weight_diffs(model, reference)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < TOL, f"{what}: {worst} differs by {diffs[worst]}"


def train_parallel(rank, world, name, steps, model, opt):
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if name == "sgd" else None
    for step in steps:
        opt.zero_grad()
        loss_of(model, split(global_batch(step), rank, world)).backward()
        opt.step()
        if sched:
            sched.step()


def case_training(rank, world):
    plans = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        model = Net(seed=7 if rank == 0 else 100 + rank)  # rank 0's weights win, as with DDP
        p = make_plan(model, world)
        ddp, opt = sparsecomm.parallelize(model, cls, plan=p, **kw)
        assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, sparsecomm.ParallelOptimizer)
        inner = getattr(ddp, "module", ddp)
        assert isinstance(inner.large, sharded.ShardedEmbeddingBag) and isinstance(inner.padded, sharded.ShardedEmbedding)
        assert type(inner.small) is nn.Embedding and type(inner.dense_table) is nn.Embedding
        assert inner.weighted.layout.scheme == "range" and inner.sparsecomm_plan is p
        train_parallel(rank, world, name, range(STEPS), ddp, opt)
        reference, _ = train_reference(name, range(STEPS))
        assert_same(ddp, reference, f"{name} at world {world}")
        # One lookup round per step for all three sharded tables: 4 all-to-alls (1 table set, STEPS rounds).
        assert inner.large._set is inner.padded._set and inner.large._set.rounds == STEPS
        plans[name] = str(p)
    return plans


def case_pending_results(rank, world):
    """Placeholders: metadata without a round, a round on first use, real tensors out of the model's forward."""
    model = Net(seed=7)
    ddp, _ = sparsecomm.parallelize(model, torch.optim.SGD, plan=make_plan(model, world), lr=0.1)
    inner = getattr(ddp, "module", ddp)
    b = split(global_batch(0), rank, world)
    a = inner.large(b["bag_ids"], b["bag_offsets"])
    c = inner.padded(b["p1"])
    assert isinstance(a, PendingLookup) and a.shape == (GLOBAL_BATCH // world, 6) and a.dtype == torch.float64
    assert inner.large._set.rounds == 0
    total = a.sum() + c.sum()          # the first use runs the one round of both
    assert inner.large._set.rounds == 1 and type(total) is torch.Tensor
    out = ddp(b)                        # the forward hook hands back a real tensor
    assert type(out) is torch.Tensor and inner.large._set.rounds == 2
    return True


def case_errors(rank, world):
    model = Net(seed=7)
    before = [type(m) for m in model.children()]
    p = make_plan(model, world)
    # Sharding a table with an option only a replica honours is refused at once, by name.
    bad = nn.Module()
    bad.t = nn.Embedding(100, 4, max_norm=1.0, sparse=True)
    expect_value_error(lambda: sparsecomm.plan(bad).override("t", "shard"), "max_norm")
    # An optimizer with no owner-side twin, or an option the twin lacks: named, on every rank, nothing modified.
    expect_value_error(lambda: sparsecomm.parallelize(model, torch.optim.RMSprop, plan=p, lr=0.1), "RMSprop")
    expect_value_error(lambda: sparsecomm.parallelize(model, torch.optim.SGD, plan=p, lr=0.1, momentum=0.9),
                       "momentum")
    # Adam on a sparse=False table: the planner keeps it replicated; forcing a shard is refused.
    adam_plan = sparsecomm.plan(model, optimizer=torch.optim.Adam, small_table_bytes=0)
    assert adam_plan["dense_table"].placement == "replicate" and "sparse=False" in adam_plan["dense_table"].reason
    expect_value_error(lambda: adam_plan.override("dense_table", "shard"), "sparse=False")
    # A plan of another model.
    other = Net(seed=7, large_rows=999)
    expect_value_error(lambda: sparsecomm.parallelize(other, torch.optim.SGD, plan=p, lr=0.1), "'large' is 999")
    # One rank's plan differs: every rank refuses.
    q = make_plan(model, world)
    if rank == world - 1:
        q.override("padded", "replicate")
    if world > 1:
        expect_value_error(lambda: sparsecomm.parallelize(model, torch.optim.SGD, plan=q, lr=0.1),
                           "pass the same plan on every rank")
    # No placement fits the budget.
    expect_value_error(lambda: sparsecomm.plan(model, memory_budget=1000), "no placement fits the memory budget")
    assert [type(m) for m in model.children()] == before  # nothing was modified by any refusal
    # Ranks with different models: every rank refuses.
    if world > 1:
        mine = Net(seed=7, large_rows=2000 if rank == 0 else 2001)
        expect_value_error(lambda: sparsecomm.plan(mine), "every rank must pass the same model")
    return True


def case_auto_plan(rank, world):
    """Measured from a sample batch: the same numbers and placements on every rank; large tables sharded."""
    model = Net(seed=7)
    sample = split(global_batch(0), rank, world)
    p = sparsecomm.plan(model, sample, small_table_bytes=20_000, memory_budget=10 << 20)
    t = p["large"]
    assert t.distinct is not None and len(t.distinct) == world and t.union >= max(t.distinct)
    assert p["small"].placement == "replicate" and ("small" if world > 1 else "one rank") in p["small"].reason
    if world > 1:
        assert t.bytes_sharded is not None and t.bytes_replicated is not None
    restored = sparsecomm.Plan.from_dict(p.to_dict())
    assert str(restored) == str(p)
    return p.to_dict()


def case_save(rank, world, directory):
    """Adagrad (state in both parts), STEPS steps at world 3, then a checkpoint (with the plan)."""
    model = Net(seed=7)
    ddp, opt = sparsecomm.parallelize(model, torch.optim.Adagrad, plan=make_plan(model, world), lr=0.3)
    train_parallel(rank, world, "adagrad", range(STEPS), ddp, opt)
    manifest = sharded.save(directory, ddp, opt)
    assert manifest["plan"]["tables"]["large"]["placement"] == "shard"
    assert manifest["replicated_optimizers"] == {"dense": "Adagrad"}
    return True


def case_load(rank, world, directory):
    """Load the world-3 checkpoint at world 2 into a fresh model and train on: equal to the reference."""
    model = Net(seed=55)  # other weights: the checkpoint must replace all of them
    p = sparsecomm.Plan.from_checkpoint(directory)
    ddp, opt = sparsecomm.parallelize(model, torch.optim.Adagrad, plan=p, lr=0.3)
    sharded.load(directory, ddp, opt)
    train_parallel(rank, world, "adagrad", range(STEPS, 2 * STEPS), ddp, opt)
    reference, _ = train_reference("adagrad", range(2 * STEPS))
    assert_same(ddp, reference, "after save at world 3, load at world 2")
    return True


def case_replicated_only(rank, world, directory):
    """A plan that shards nothing still saves and loads through sparsecomm.sharded (its replicated parts)."""
    model = Net(seed=7)
    p = sparsecomm.plan(model)
    for name in p.tables:
        p.override(name, "replicate")
    ddp, opt = sparsecomm.parallelize(model, torch.optim.Adagrad, plan=p, lr=0.3)
    train_parallel(rank, world, "adagrad", range(2), ddp, opt)
    path = directory + "-replicated"
    sharded.save(path, ddp, opt)
    fresh = Net(seed=99)
    ddp2, opt2 = sparsecomm.parallelize(fresh, torch.optim.Adagrad, plan=sparsecomm.Plan.from_checkpoint(path), lr=0.3)
    sharded.load(path, ddp2, opt2)
    train_parallel(rank, world, "adagrad", range(2, 4), ddp, opt)
    train_parallel(rank, world, "adagrad", range(2, 4), ddp2, opt2)
    for a, b in zip(ddp.module.parameters(), ddp2.module.parameters()):
        assert torch.equal(a, b)
    return True


def worker(rank, world, directory, names):
    cases = {"training": case_training, "pending": case_pending_results, "errors": case_errors,
             "auto": case_auto_plan, "save": case_save, "load": case_load, "replicated": case_replicated_only}
    with_dir = ("save", "load", "replicated")
    return run_cases(rank, world, [(n, cases[n], (directory,) if n in with_dir else ()) for n in names])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("parallelize") / "ckpt")
    return {3: run_ranks(3, worker, directory, ["training", "auto", "save"], join_timeout_s=300),
            2: run_ranks(2, worker, directory, ["training", "pending", "errors", "auto", "load", "replicated"],
                         join_timeout_s=300),
            1: run_ranks(1, worker, directory, ["training", "errors", "auto"], join_timeout_s=300)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parallelize_trains_like_one_process_on_the_whole_batch(runs, world):
    assert set(runs[world][0]["training"]) == set(OPTIMIZERS)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_holds_the_same_plan(runs, world):
    for name in OPTIMIZERS:
        assert len({runs[world][r]["training"][name] for r in range(world)}) == 1
    assert all(runs[world][r]["auto"] == runs[world][0]["auto"] for r in range(world))


def test_lookups_wait_for_their_first_use(runs):
    assert all(runs[2][r]["pending"] for r in range(2))


@pytest.mark.parametrize("world", [1, 2])
def test_errors_come_before_any_change_on_every_rank(runs, world):
    assert all(runs[world][r]["errors"] for r in range(world))


def test_checkpoint_at_world_3_continues_at_world_2(runs):
    assert all(runs[3][r]["save"] for r in range(3)) and all(runs[2][r]["load"] for r in range(2))


def test_a_plan_that_shards_nothing_still_checkpoints(runs):
    assert all(runs[2][r]["replicated"] for r in range(2))


def test_without_torch_distributed_it_is_a_world_of_one():
    model = Net(seed=7)
    ddp, opt = sparsecomm.parallelize(model, torch.optim.SGD, plan=make_plan(model, 1), lr=0.5)
    assert ddp is model and isinstance(model.large, sharded.ShardedEmbeddingBag)
    train_parallel(0, 1, "sgd", range(STEPS), ddp, opt)
    reference, _ = train_reference("sgd", range(STEPS))
    assert_same(ddp, reference, "no process group")


def test_replicated_sparse_tables_move_to_huge_page_memory_with_their_values(monkeypatch):
    """parallelize copies a replicated sparse table (>= 4 MiB) and its Adagrad sums into ops.empty_rows memory,
    keeping the Parameter; a small table, and one sharing its storage, stay where they are."""
    torch.manual_seed(0)
    big, small = nn.EmbeddingBag(40_000, 32, mode="sum", sparse=True), nn.EmbeddingBag(100, 32, sparse=True)
    shared = torch.randn(80_000, 32)
    viewed = nn.EmbeddingBag.from_pretrained(shared[:40_000], freeze=False, sparse=True)
    model = nn.ModuleDict({"big": big, "small": small, "viewed": viewed})
    before = {k: (m.weight, m.weight.data_ptr(), m.weight.detach().clone()) for k, m in model.items()}
    plan = sparsecomm.plan(model)
    for name in model:
        plan.override(name, "replicate")
    copied, copy = [], sparsecomm.ops.huge_page_copy
    monkeypatch.setattr(sparsecomm.ops, "huge_page_copy", lambda t: copied.append(tuple(t.shape)) or copy(t))
    _, opt = sparsecomm.parallelize(model, torch.optim.Adagrad, plan=plan, trial=False, lr=0.1,
                                    initial_accumulator_value=0.5)
    for k, m in model.items():
        p, ptr, values = before[k]
        assert m.weight is p and torch.equal(p, values)
        assert (p.data_ptr() != ptr) == (k == "big"), k
    assert copied == [(40_000, 32), (40_000, 32)]   # the big weight, then its sums
    state = opt.parts["dense"].state[big.weight]["sum"]
    assert torch.equal(state, torch.full_like(state, 0.5)) and state.is_contiguous()
    opt.zero_grad()
    big(torch.tensor([[1, 2]])).sum().backward()
    opt.step()   # the optimizer updates the moved weight and state
    assert not torch.equal(big.weight[1], before["big"][2][1]) and state[1, 0] > 0.5


def test_sparse_adam_makes_its_moments_in_huge_page_memory_with_its_own_values(monkeypatch):
    """SparseAdam's first step of a replicated table finds its state made (step 0, zero moments) in
    ops.empty_rows memory, and trains exactly as torch's SparseAdam."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"t": nn.EmbeddingBag(40_000, 32, mode="sum", sparse=True)})
    ref = nn.EmbeddingBag(40_000, 32, mode="sum", sparse=True)
    ref.load_state_dict(model["t"].state_dict())
    plan = sparsecomm.plan(model)
    plan.override("t", "replicate")
    made, empty = [], sparsecomm.ops.empty_rows
    monkeypatch.setattr(sparsecomm.ops, "empty_rows", lambda *a: made.append(tuple(a[0])) or empty(*a))
    _, opt = sparsecomm.parallelize(model, torch.optim.SparseAdam, plan=plan, trial=False, lr=0.1)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for step in range(2):
        for m, o in ((model["t"], opt), (ref, ref_opt)):
            o.zero_grad()
            m(torch.tensor([[1, 2], [2, 3 + step]])).sum().backward()
            o.step()
    assert made == [(40_000, 32)] * 2   # its two moments, at the first step (the weight: the test above)
    assert torch.equal(model["t"].weight, ref.weight)
    assert not opt.parts["sparse"]._optimizer_step_pre_hooks   # done once the weight has its state
    state = opt.parts["sparse"].state[model["t"].weight]
    assert state["step"] == 2 and torch.equal(state["exp_avg"], ref_opt.state[ref.weight]["exp_avg"])
