"""Table-wise placement (scheme ``"table"``: a whole table on one owner) against single-process training.

The owner map itself (kernels, ``ops``, the layout), the planner's choice and
its printing are checked in this process; training, migrations (``replan``
between replicated, row-sharded and table-wise, with optimizer state),
checkpoints and refusals run on real gloo ranks at worlds 2 and 3 (world 1
in this process) against the references of ``test_sharded`` and ``test_replan``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
import sparsecomm.sharded as sh
from sparsecomm import ops, ownership, planner, table_wise
from sparsecomm.sharded.layout import RowLayout
from sparsecomm.sharded.table import ShardedTable

import test_replan as rp
import test_sharded as ts
import test_trial as tt
from distributed import expect_value_error, spawned_fixture

T = "table"


# ----------------------------------------------------------- in this process


def test_every_row_of_a_table_wise_map_goes_to_its_owner_in_every_kernel():
    ids = torch.tensor([7, 0, 3, 7, 19, 2])
    for owner in range(3):
        assert ops.row_owners(ids, 3, T, 20, owner=owner).tolist() == [owner] * 6
        part = ops.partition_rows(ids, torch.arange(6.).view(6, 1), 3, T, 20, owner=owner)
        assert part.counts.tolist() == [6 if o == owner else 0 for o in range(3)]
        assert torch.equal(part.ids, ids) and torch.equal(part.perm, torch.arange(6))   # stable: the order kept
        fused = ops.coalesce_partition_rows(ids, torch.ones(6, 2), 3, T, 20, owner=owner)
        assert fused.counts.tolist() == [5 if o == owner else 0 for o in range(3)]
        assert fused.ids.tolist() == [0, 2, 3, 7, 19] and fused.values[3].tolist() == [2.0, 2.0]
        pooled = ops.pooled_request(ids, torch.tensor([0, 0, 1, 1, 2, 2]), 3, T, 20, num_bags=3, owner=owner)
        assert pooled.unique_counts.tolist() == [5 if o == owner else 0 for o in range(3)]
        assert pooled.bag_counts.tolist() == [3 if o == owner else 0 for o in range(3)]


@pytest.mark.parametrize("owner,match", [(None, "needs owner"), (3, "in [0, 3)"), (-1, "in [0, 3)"),
                                         (True, "needs owner")])
def test_a_table_wise_map_needs_an_owner_among_the_ranks(owner, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ops.row_owners(torch.tensor([1]), 3, T, 10, owner=owner)
    assert ownership.OwnerMap.of(3, T, 10, owner=2) == (3, 2, 2, 1)
    with pytest.raises(ValueError, match="owner must be >= 0"):
        ownership.OwnerMap(3, 2, -1, 1).check()


def test_a_sparse_allreduce_refuses_the_table_scheme():
    g = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (5, 2), check_invariants=True)
    with pytest.raises(ValueError, match="scheme='table' places a sharded table"):
        sparsecomm.sparse_allreduce(g, scheme=T)


def test_the_layout_of_a_table_wise_table():
    ids = torch.tensor([0, 5, 9])
    owner = RowLayout(10, 3, 1, T, owner=1)
    other = RowLayout(10, 3, 2, T, owner=1)
    assert (owner.num_local, other.num_local) == (10, 0)
    assert owner.owns(ids).all() and not other.owns(ids).any()
    assert not owner.owns(torch.tensor([-1, 10])).any()
    assert torch.equal(owner.slots(ids), ids) and torch.equal(owner.owned_ids(), torch.arange(10))
    assert other.owned_ids().numel() == 0 and owner.nbytes == 0
    assert owner.describe()["owner"] == 1 and owner.range_size == 4   # the checkpoints' chunks stay ceil(V / N)
    with pytest.raises(ValueError, match="takes owner=None"):
        RowLayout(10, 3, 1, "hash", owner=1)
    with pytest.raises(ValueError, match="needs owner"):
        RowLayout(10, 3, 1, T)


class Bags(nn.Module):
    """Four sum bags of one width (the end-to-end benchmark's shape) and a plain Embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(1_000_000, 32, mode="sum", sparse=True)
        self.b = nn.EmbeddingBag(300_000, 32, mode="sum", sparse=True)
        self.c = nn.EmbeddingBag(50_000, 32, mode="sum", sparse=True)
        self.d = nn.EmbeddingBag(10_000, 32, mode="sum", sparse=True)
        self.e = nn.Embedding(100_000, 16, sparse=True)


def _placed(world, tables=("a", "b", "c", "e"), memory_budget=None, modules=None, reason="x"):
    """The default plan's choice at ``world`` ranks for the given tables sharded (row-sharded first)."""
    m = modules or Bags()
    p = planner.plan(m)
    p.world_size, p.memory_budget = world, memory_budget
    for name, x in planner.embedding_modules(m):
        t = p.tables[name]
        t.memory_sharded = planner._describe(name, x, world, "SGD").memory_sharded   # the plan was made at world 1
        t.placement, t.scheme, t.owner, t.reason = ("shard" if t.name in tables else "replicate"), "hash", None, reason
    planner.place_tables(p, {n: planner.pools_at_owner(x) for n, x in planner.embedding_modules(m)})
    return p


def test_bag_tables_spread_table_wise_where_that_unloads_the_busiest_rank():
    two = _placed(2)
    assert [(two[t].scheme, two[t].owner) for t in "abce"] == [(T, 0), (T, 1), (T, 0), ("hash", None)]
    four = _placed(4)
    assert sorted(four[t].owner for t in "abc") == [0, 1, 2] and four["e"].scheme == "hash"
    assert "whole on rank" in two["a"].reason and "B of pooled rows per bag" in two["a"].reason
    # A table placed whole no longer claims the row-sharded spread the planner gave as its reason.
    said = _placed(2, reason="large (1 MiB replicated): 1/2 of the rows and optimizer work per rank")
    assert said["a"].reason.startswith("large (1 MiB replicated): sharded; whole on rank 0")
    assert said["e"].reason.endswith("1/2 of the rows and optimizer work per rank")   # still row-sharded
    # One bag table at two ranks: the same bytes either way, so its work stays spread (row-sharded).
    one = _placed(2, tables=("a",))
    assert one["a"].scheme == "hash" and one["a"].owner is None
    # The owner holds the whole table: a memory budget below it keeps the table row-sharded.
    tight = _placed(2, memory_budget=100 << 20)
    assert tight["a"].scheme == "hash" and tight.memory_per_rank() <= 100 << 20
    assert tight.memory_per_rank() == max(tight.memory_on(r) for r in range(2))


def test_every_bag_table_whole_balances_the_bytes_owners_serve_not_the_widths():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            # Largest first: 1.0 MB, 576 kB, 192 kB; a pooled row of 256, 288 and 192 bytes.
            self.big = nn.EmbeddingBag(4000, 128, mode="sum", sparse=True, dtype=torch.float16)
            self.mid = nn.EmbeddingBag(2000, 72, mode="sum", sparse=True)
            self.small = nn.EmbeddingBag(1000, 48, mode="sum", sparse=True)

    p = sparsecomm.plan(Mixed())
    p.world_size = 2
    assert table_wise.every_bag_table_whole(p) == ["big", "mid", "small"]
    # big on 0 (256 B a bag), mid on 1 (288 B), small on 0, the rank serving fewer bytes: 448 B against 288.
    # By width (128 on 0, 72 on 1) small would have joined mid: 480 B through rank 1.
    assert [(p[t].scheme, p[t].owner) for t in ("big", "mid", "small")] == [(T, 0), (T, 1), (T, 0)]


def test_the_plan_prints_and_overrides_a_table_wise_table():
    p = _placed(2)
    text = str(p)
    assert "shard (table: rank 1)" in text and max(len(line) for line in text.splitlines()) <= 120
    assert p.memory_on(0) == sum(p[t].memory_replicated for t in "acd") + p["e"].memory_sharded
    again = planner.Plan.from_dict(p.to_dict())
    assert (again["b"].scheme, again["b"].owner) == (T, 1)
    p.override("e", "shard", T, owner=1)
    assert (p["e"].scheme, p["e"].owner, p["e"].where) == (T, 1, "shard (table: rank 1)")
    p.override("e", "shard", "range")
    assert p["e"].owner is None
    for args, match in (((T,), "needs owner"), ((T, 2), "needs owner"), (("hash", 0), "owner is for scheme")):
        with pytest.raises(ValueError, match=match):
            p.override("e", "shard", *args[:1], owner=args[1] if len(args) > 1 else None)
    with pytest.raises(ValueError, match="owner is for scheme"):
        p.override("e", "replicate", owner=0)


def test_a_sample_batch_gives_the_planner_each_tables_bags():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.EmbeddingBag(100, 4, mode="sum")
            self.b = nn.EmbeddingBag(100, 4, mode="mean", include_last_offset=True)

        def forward(self, x):
            return self.a(x).sum() + self.b(x.view(-1), torch.tensor([0, 3, 6, 12])).sum()

    p = planner.plan(Two(), torch.randint(0, 100, (4, 3)), small_table_bytes=0)
    assert (p["a"].bags, p["a"].bag_length) == (4, 3) and (p["b"].bags, p["b"].bag_length) == (3, 4)


# ------------------------------------------------------------------ on ranks


TRAIN = [(kind, opt) for kind in ("emb", "bag-sum", "bag-mean") for opt in ("sgd", "adagrad", "adam")]


def case_train(rank, world, kind, opt):
    """One table whole on the last rank, trained under DDP, against one process on the whole batch."""
    seed = 40 + TRAIN.index((kind, opt))
    table = ts.make_table(kind, True, "hash", torch.float64, False)
    owner = world - 1
    table = (sh.ShardedEmbedding(ts.V, ts.D, scheme=T, owner=owner, dtype=torch.float64, _weight=ts.full_table(
        torch.float64)) if kind == "emb" else sh.ShardedEmbeddingBag(
        ts.V, ts.D, mode=kind.split("-")[1], scheme=T, owner=owner, dtype=torch.float64,
        _weight=ts.full_table(torch.float64)))
    model = ts.Net(table, torch.float64)
    fwd = DDP(model) if world > 1 else model
    opts = ts.make_optimizers(model, opt, True)
    variant = {"emb": "2d", "bag-sum": "psw", "bag-mean": "offsets"}[kind]
    batches = [ts.make_batch(seed, s, rank, variant, torch.float64) for s in range(8)]
    ts.train_steps(model, fwd, opts, batches)
    ref = ts.reference(kind, opt, torch.float64, variant, world, seed, 8)
    ts.assert_close(model.emb.full_weight(), ref.emb.weight, torch.float64, f"{kind}/{opt}: table")
    ts.assert_close(model.fc.weight, ref.fc.weight, torch.float64, f"{kind}/{opt}: dense layer")
    assert model.emb.local_weight.shape[0] == (ts.V if rank == owner else 0)
    return True


def case_state(rank, world):
    """The state dicts of a table-wise table load into a row-sharded one and back (rows and optimizer state)."""
    def table(scheme, owner=None, seed=5):
        return ts.Net(sh.ShardedEmbeddingBag(ts.V, ts.D, mode="sum", scheme=scheme, owner=owner, seed=seed,
                                             dtype=torch.float64), torch.float64)

    whole = table(T, world - 1)
    opt = sh.ShardedAdagrad(whole, lr=0.1)
    whole(ts.make_batch(1, 0, rank, "2d", torch.float64)["x"]).sum().backward()
    opt.step()
    sd, osd = whole.state_dict(), opt.state_dict()
    for scheme, owner in (("hash", None), ("range", None), (T, 0)):
        other = table(scheme, owner, seed=9)
        other_opt = sh.ShardedAdagrad(other, lr=0.3)
        other.load_state_dict(sd)
        other_opt.load_state_dict(osd)
        assert torch.equal(other.emb.full_weight(), whole.emb.full_weight())
        back = table(T, world - 1, seed=11)
        back_opt = sh.ShardedAdagrad(back, lr=0.3)
        back.load_state_dict(other.state_dict())
        back_opt.load_state_dict(other_opt.state_dict())
        assert torch.equal(back.emb.local_weight, whole.emb.local_weight)
        assert torch.equal(back_opt.state[back.emb.local_weight]["sum"], opt.state[whole.emb.local_weight]["sum"])
    return True


def case_refused(rank, world):
    """A bad or differing owner on one rank is refused on every rank; the next table builds."""
    last = world - 1
    bad = world if rank == last else 0
    msg = expect_value_error(lambda: sh.ShardedEmbedding(10, 2, scheme=T, owner=bad), "needs owner")
    assert rank == last or world == 1 or f"rank {last}" in msg
    if world > 1:
        differ = 1 if rank == last else 0
        expect_value_error(lambda: sh.ShardedEmbedding(10, 2, scheme=T, owner=differ), "every rank must build")
    # A plan from a larger world (a checkpoint's) names an owner this group lacks: refused before any change.
    net = tt.Model()
    p = sparsecomm.plan(net)
    p.override("a", "shard", T, owner=last)
    p.tables["a"].owner = world
    expect_value_error(lambda: sparsecomm.parallelize(net, torch.optim.SGD, plan=p, lr=0.1),
                       f"'a' is planned whole on one rank: scheme='table' needs owner, the rank holding the "
                       f"table, in [0, {world}); got {world}")
    assert isinstance(net.a, nn.EmbeddingBag)
    ok = sh.ShardedEmbedding(10, 2, scheme=T, owner=last, seed=1)
    assert torch.equal(ok(torch.tensor([[1, 2]])), ok.full_weight()[torch.tensor([[1, 2]])])
    return True


def _plan(p, placements, index):
    """``test_replan``'s plan_for with table-wise placements written ("table", owner)."""
    for table, where in placements.items():
        w = where[index]
        if isinstance(w, tuple):
            p.override(table, "shard", T, owner=w[1])
        elif w == rp.R:
            p.override(table, rp.R)
        else:
            p.override(table, "shard", w)
    return p


def _placed_now(model):
    return {n: ((T, m.owner) if m.scheme == T else m.scheme) if isinstance(m, ShardedTable) else rp.R
            for n, m in rp.inner_of(model).named_children() if n in rp.CHAIN}


def case_migrate(rank, world, name):
    """Table-wise to and from every other placement (and another owner), one step between plans."""
    last = (T, world - 1)
    first = (T, 0)
    placements = {"a": [first, rp.R, last, rp.H, first, rp.G, last, last],
                  "b": [rp.H, first, rp.G, last, rp.R, last, first, rp.H],
                  "c": [rp.R, rp.R, first, rp.R, last, rp.R, rp.R, rp.R]}
    if name in rp.LAZY:
        placements["c"] = [rp.R] * len(placements["a"])
    cls, kw = rp.OPTIMIZERS[name]
    net = rp.Net(seed=3 if rank == 0 else 40 + rank)
    model, opt = sparsecomm.parallelize(net, cls, plan=_plan(sparsecomm.plan(net, small_table_bytes=0),
                                                             placements, 0), **kw)
    sched, ref = rp.scheduler(name, opt), rp.Reference(name)
    for i in range(len(placements["a"])):
        if i:
            opt.zero_grad()
            model, opt = sparsecomm.replan(model, opt, _plan(copy.deepcopy(rp.inner_of(model).sparsecomm_plan),
                                                             placements, i))
        assert _placed_now(model) == {t: p[i] for t, p in placements.items()}
        rp.train_step(model, opt, sched, i, rank, world)
        ref.step(i)
        rp.assert_same(model, ref.model, f"{name}, world {world}, after plan {i}")
    if world > 1:
        far = _plan(copy.deepcopy(rp.inner_of(model).sparsecomm_plan), {"a": [last]}, 0)
        far.tables["a"].owner = world
        expect_value_error(lambda: sparsecomm.replan(model, opt, far), f"in [0, {world}); got {world}")
    return True


def case_parallelize(rank, world):
    """The default call on bag tables of one width: table-wise over the ranks, one round, like one process."""
    ref = tt.Model()   # three bag tables of 4 MiB or more and an MLP
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.05)
    net = tt.Model()
    model, opt = sparsecomm.parallelize(net, torch.optim.Adagrad, plan=sparsecomm.plan(net), lr=0.05)
    inner = rp.inner_of(model)
    owners = [getattr(getattr(inner, t), "owner", None) for t in "abc"]
    if world > 1:
        assert all(getattr(inner, t).scheme == T for t in "abc") and len(set(owners)) == min(world, 3), owners
        assert len({id(getattr(inner, t).table_set) for t in "abc"}) == 1   # one lookup round for all three
    for step in range(4):
        x, y = tt.batch(step, rank, world)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        gx, gy = tt.batch(step)
        ((ref(gx) - gy) ** 2).mean().backward()
        ref_opt.step()
    rp.assert_same(model, ref, f"parallelize, world {world}")
    return owners or True


CASES = ([(f"train-{k}-{o}", case_train, (k, o)) for k, o in TRAIN]
         + [("state", case_state, ()), ("refused", case_refused, ()), ("parallelize", case_parallelize, ())]
         + [(f"migrate-{n}", case_migrate, (n,)) for n in ("sgd", "adagrad", "adam")])


spawned = spawned_fixture(CASES)   # worlds 2 and 3, every case in one spawn each


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_on_ranks(spawned, case):
    world, out = spawned
    assert all(out[r][case] for r in range(world)), f"world {world}, {case}"


def test_a_world_of_one_in_this_process():
    for name, fn, args in CASES:
        assert fn(0, 1, *args), name
