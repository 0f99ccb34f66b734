"""``torch.distributed.checkpoint`` with sharded tables: every row saved, loaded exactly at any world size.

Ranks are spawned at world sizes 2, 3 and (slow) 2 again. Each spawn trains two models a few
steps: one built by hand (a hash-sharded ``ShardedEmbedding``, a
range-sharded ``ShardedEmbeddingBag``, a hash table with hot-row replicas, a
dense layer under DDP; ``ShardedAdam`` and ``ShardedAdagrad``) and one made
by ``sparsecomm.parallelize`` (hash and range tables, Adagrad). It saves DCP
checkpoints of both (``dcp.save`` of ``model.state_dict()`` with the
optimizers' ``state_dict()``, and of ``get_state_dict(model, optimizers)``)
and writes, independently of DCP, the full tables and optimizer rows it saved.
The next spawn loads the previous one's checkpoints (2 -> 3, 3 -> 2), also
with the schemes swapped: every table and optimizer row must equal what was
saved bitwise, and training on must equal one process training
``nn.Embedding(Bag)`` with torch's optimizers on every rank's batch. The
test process itself (no process group) loads ``get_model_state_dict(...,
full_state_dict=True)`` into the single-process model with ``strict=True``,
and the 3-rank DCP checkpoint into a sharded model of one process (3 -> 1).
Refusals (flattened optimizer state, a malformed entry, ranks whose state
differs) raise on every rank and change nothing.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
import sparsecomm.sharded as sh
from sparsecomm.collectives.sharded_exchange import allgather_table_rows

from distributed import expect_value_error, run_cases, run_ranks

V, D, L = 90, 4, 3
STEPS = 3                # before the save, and again after the load
SAMPLES = 6              # per step, split among the ranks (6 divides among 1, 2 and 3)
WORLDS = (2, 3, 2)       # spawn order: each loads the checkpoints of the one before
HOT = sh.HotRowConfig(budget_bytes=12 * (D * 8 * 2 + 16), window=2, min_count=1)
F64 = torch.float64


def table(seed: int) -> torch.Tensor:
    return torch.randn(V, D, generator=torch.Generator().manual_seed(seed), dtype=F64)


class Net(nn.Module):
    """Three tables (sharded or not) feeding a dense layer."""

    def __init__(self, emb: nn.Module, bag: nn.Module, hot: nn.Module) -> None:
        super().__init__()
        self.emb, self.bag, self.hot = emb, bag, hot
        self.fc = nn.Linear(D, 1, dtype=F64)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(1, D, generator=torch.Generator().manual_seed(3), dtype=F64))
            self.fc.bias.fill_(0.1)

    def forward(self, x):
        return self.fc(self.emb(x).sum(1) + self.bag(x) + self.hot(x).sum(1)).squeeze(-1)


def sharded_net(schemes=("hash", "range"), shift: float = 0.0) -> Net:
    """The sharded model; ``shift`` moves its initial rows away from the reference's (a load must replace them)."""
    return Net(sh.ShardedEmbedding(V, D, scheme=schemes[0], dtype=F64, _weight=table(1) + shift),
               sh.ShardedEmbeddingBag(V, D, mode="sum", scheme=schemes[1], dtype=F64, _weight=table(2) + shift),
               sh.ShardedEmbedding(V, D, scheme="hash", dtype=F64, hot_rows=HOT, _weight=table(3) + shift))


def plain_net() -> Net:
    return Net(nn.Embedding(V, D, sparse=True, _weight=table(1)),
               nn.EmbeddingBag(V, D, mode="sum", sparse=True, _weight=table(2)),
               nn.Embedding(V, D, sparse=True, _weight=table(3)))


def optimizers(model: Net, sharded: bool):
    # With momentum: torch's set_state_dict refuses a parameter without optimizer state (plain SGD keeps none).
    dense = torch.optim.SGD(model.fc.parameters(), lr=0.05, momentum=0.9)
    if sharded:
        return [dense, sh.ShardedAdam([model.emb, model.bag], lr=0.05), sh.ShardedAdagrad(model.hot, lr=0.3)]
    return [dense, torch.optim.SparseAdam(list(model.emb.parameters()) + list(model.bag.parameters()), lr=0.05),
            torch.optim.Adagrad(model.hot.parameters(), lr=0.3)]


def batch(step: int, rank: int = 0, world: int = 1):
    """This rank's share of the step's samples: skewed ids (hot rows) and targets, the same at any world size."""
    g = torch.Generator().manual_seed(100 + step)
    ids, y = (torch.rand(SAMPLES, L, generator=g) ** 3 * V).long(), torch.randn(SAMPLES, generator=g, dtype=F64)
    per = SAMPLES // world
    return ids[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def train(forward, opts, steps, rank=0, world=1) -> None:
    for step in steps:
        for o in opts:
            o.zero_grad()
        x, y = batch(step, rank, world)
        ((forward(x) - y) ** 2).mean().backward()
        for o in opts:
            o.step()


def reference(steps: int) -> Net:
    model = plain_net()
    train(model, optimizers(model, False), range(steps))
    return model


def full_rows(t: sh.ShardedTable, rows: torch.Tensor) -> torch.Tensor:
    """A row-aligned shard tensor of ``t`` as the whole table, gathered without DCP."""
    ids, got = allgather_table_rows(t.layout.owned_ids(), rows.detach(), V, t.group)
    out = got.new_empty((V,) + tuple(got.shape[1:]))
    out[ids] = got
    return out


def snapshot(model: Net, opts) -> dict:
    """Every table and optimizer row as full tensors, the optimizers' steps and lrs, the dense layer."""
    inner = getattr(model, "module", model)
    out = {f"{n}.weight": full_rows(t, t.local_weight) for n, t in sh.sharded_modules(inner)}
    for i, o in enumerate(opts):
        sharded = getattr(o, "sharded", o)
        if isinstance(sharded, sh.ShardedOptimizer):
            for t in sharded.tables():
                name = next(n for n, m in sh.sharded_modules(inner) if m is t)
                state = sharded.state[t.local_weight]
                out[f"{i}.{name}.step"] = torch.tensor(state["step"])
                out.update({f"{i}.{name}.{k}": full_rows(t, state[k]) for k in sharded.row_state_names})
        out[f"{i}.lr"] = torch.tensor([g["lr"] for g in o.param_groups], dtype=F64)
    out.update({k: v.detach().clone() for k, v in inner.named_parameters() if v.numel() and "fc" in k})
    return out


def assert_same_snapshot(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs by {float((got[k] - want[k]).abs().max())}"


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = float((a.detach() - b.detach()).abs().max())
    assert err < 1e-10, f"{what}: max abs diff {err}"


def assert_like_reference(model: Net, steps: int, what: str) -> None:
    inner = getattr(model, "module", model)
    ref = reference(steps)
    for name in ("emb", "bag", "hot"):
        t = getattr(inner, name)
        assert_close(t.full_weight(), getattr(ref, name).weight, f"{what}: {name}")
    assert_close(inner.fc.weight, ref.fc.weight, f"{what}: dense layer")


# ------------------------------------------------------------ hand-built model


def direct_optim_state(model: Net, opts) -> list:
    """The sharded optimizers' own state_dict(); the dense one's through torch's helper, which creates the
    momentum buffers before a load (a fresh SGD's state_dict() has none for DCP to fill)."""
    return [get_optimizer_state_dict(model, opts[0])] + [o.state_dict() for o in opts[1:]]


def save_paths(root: str, world: int):
    return {k: os.path.join(root, f"{k}-w{world}") for k in ("direct", "dsd", "stateful", "parallel")}


def case_save(rank, world, root):
    """Train STEPS (like the reference), save in each DCP form, and record what was saved."""
    model = sharded_net()
    opts = optimizers(model, True)
    ddp = DDP(model)
    train(ddp, opts, range(STEPS), rank, world)
    paths = save_paths(root, world)
    dcp.save({"model": model.state_dict(), "optim": direct_optim_state(model, opts)}, checkpoint_id=paths["direct"])
    msd, osd = get_state_dict(ddp, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=paths["dsd"])
    # DCP's Stateful protocol: it calls state_dict() to save and load_state_dict() after loading.
    dcp.save({"model": model, "adam": opts[1], "adagrad": opts[2]}, checkpoint_id=paths["stateful"])
    saved = snapshot(model, opts)
    if rank == 0:
        torch.save(saved, os.path.join(root, f"expected-w{world}.pt"))
    assert saved["0.lr"].item() == 0.05 and int(saved["2.hot.step"]) == STEPS, (saved["0.lr"], saved["2.hot.step"])
    assert model.hot.hot.size > 0, "the hot table replicates no rows: the test would not cover them"
    assert_like_reference(model, STEPS, "before the save")
    return True


def fresh(schemes):
    model = sharded_net(schemes, shift=5.0)
    opts = optimizers(model, True)
    with torch.no_grad():
        for o in opts[1:]:
            for t in o.tables():
                for k in o.row_state_names:
                    o.state[t.local_weight][k].fill_(3.0)  # anything a load must replace
            o.param_groups[0]["lr"] = 9.0
    return model, opts


def case_load_direct(rank, world, root, saved_at, schemes):
    """dcp.load into model.state_dict() and the optimizers' state_dict(), then load_state_dict: exact."""
    model, opts = fresh(schemes)
    sd = {"model": model.state_dict(), "optim": direct_optim_state(model, opts)}
    dcp.load(sd, checkpoint_id=save_paths(root, saved_at)["direct"])
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opts[0], sd["optim"][0])
    for o, s in zip(opts[1:], sd["optim"][1:]):
        o.load_state_dict(s)
    want = torch.load(os.path.join(root, f"expected-w{saved_at}.pt"))
    assert_same_snapshot(snapshot(model, opts), want, f"direct {saved_at} -> {world} {schemes}")
    train(DDP(model), opts, range(STEPS, 2 * STEPS), rank, world)
    assert_like_reference(model, 2 * STEPS, f"direct {saved_at} -> {world}, trained on")
    return True


def case_load_stateful(rank, world, root, saved_at):
    """dcp.load of the model and sharded optimizers as Stateful objects: they reload themselves, exactly."""
    model, opts = fresh(("hash", "range"))
    dcp.load({"model": model, "adam": opts[1], "adagrad": opts[2]},
             checkpoint_id=save_paths(root, saved_at)["stateful"])
    want = torch.load(os.path.join(root, f"expected-w{saved_at}.pt"))
    got = snapshot(model, opts)
    def tables(snap):  # the dense layer's optimizer was not saved
        return {k: v for k, v in snap.items() if not k.startswith("0.")}

    assert_same_snapshot(tables(got), tables(want), f"Stateful {saved_at} -> {world}")
    return True


def case_load_dsd(rank, world, root, saved_at):
    """get_state_dict -> dcp.load -> set_state_dict on the DDP-wrapped model: exact, and trains on."""
    model, opts = fresh(("hash", "range"))
    ddp = DDP(model)
    msd, osd = get_state_dict(ddp, opts)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=save_paths(root, saved_at)["dsd"])
    set_state_dict(ddp, opts, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    want = torch.load(os.path.join(root, f"expected-w{saved_at}.pt"))
    assert_same_snapshot(snapshot(model, opts), want, f"get/set_state_dict {saved_at} -> {world}")
    train(ddp, opts, range(STEPS, 2 * STEPS), rank, world)
    assert_like_reference(model, 2 * STEPS, f"get/set_state_dict {saved_at} -> {world}, trained on")
    return True


def case_refusals(rank, world, root, saved_at):
    """What cannot load refuses on every rank, before anything changes."""
    model, opts = fresh(("hash", "range"))
    before = snapshot(model, opts)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opts, options=flat)
    expect_value_error(lambda: set_state_dict(model, opts, model_state_dict=msd, optim_state_dict=osd, options=flat),
                       "flatten_optimizer_state_dict=True")
    sd = model.state_dict()
    wrong = dict(sd, **{"emb.weight": torch.zeros(V + 1, D, dtype=F64)})
    expect_value_error(lambda: model.load_state_dict(wrong), "expected the whole table (90, 4)")
    # Rank 0 passes the full table, the others their DTensor chunks: the forms differ, every rank refuses.
    full = model.emb.full_weight()  # collective: on every rank
    mixed = dict(sd, **{"emb.weight": full}) if rank == 0 else sd
    expect_value_error(lambda: model.load_state_dict(mixed), "the ranks' state differs")
    bad = opts[1].state_dict()
    del bad["param_groups"][0]["sharded_rows"][1]["exp_avg"]
    expect_value_error(lambda: opts[1].load_state_dict(bad), "table 1 has no 'exp_avg' rows")
    assert_same_snapshot(snapshot(model, opts), before, "after the refusals")
    return True


# ------------------------------------------------------------ parallelize


class Plain(nn.Module):
    """The single-process model handed to parallelize: two sparse tables and a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, sparse=True, _weight=table(1))
        self.bag = nn.EmbeddingBag(V, D, mode="sum", sparse=True, _weight=table(2))
        self.fc = nn.Linear(D, 1, dtype=F64)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(1, D, generator=torch.Generator().manual_seed(3), dtype=F64))
            self.fc.bias.fill_(0.1)

    def forward(self, x):
        return self.fc(self.emb(x).sum(1) + self.bag(x)).squeeze(-1)


def parallel(schemes=("hash", "range")):
    model = Plain()
    p = sparsecomm.plan(model, small_table_bytes=0)
    for name, scheme in zip(("emb", "bag"), schemes):
        p.override(name, "shard", scheme)
    return sparsecomm.parallelize(model, torch.optim.Adagrad, plan=p, lr=0.3)


def plain_reference(steps: int) -> Plain:
    model = Plain()
    train(model, [torch.optim.Adagrad(model.parameters(), lr=0.3)], range(steps))
    return model


def full_model_state(ddp) -> dict:
    return get_model_state_dict(ddp, options=StateDictOptions(full_state_dict=True))


def assert_plain_like(state: dict, ref: Plain, what: str) -> None:
    assert set(state) == set(ref.state_dict()), (what, sorted(state))
    for k, v in ref.state_dict().items():
        assert_close(state[k], v, f"{what}: {k}")


def case_parallel_save(rank, world, root):
    ddp, opt = parallel()
    train(ddp, [opt], range(STEPS), rank, world)
    msd, osd = get_state_dict(ddp, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=save_paths(root, world)["parallel"])
    full = full_model_state(ddp)
    assert_plain_like(full, plain_reference(STEPS), "full state dict")
    optim = get_optimizer_state_dict(ddp, opt, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(full, os.path.join(root, f"full-w{world}.pt"))
        torch.save(optim, os.path.join(root, f"full-optim-w{world}.pt"))
    return True


def assert_equal_trees(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (what, sorted(a), sorted(b))
        for k in a:
            assert_equal_trees(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_trees(x, y, f"{what}.{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    else:
        assert a == b, (what, a, b)


def case_parallel_load(rank, world, root, saved_at):
    """get_state_dict -> dcp.load -> set_state_dict into a fresh parallelized model (other scheme for emb)."""
    ddp, opt = parallel(("range", "hash"))
    with torch.no_grad():
        ddp.module.fc.weight.fill_(4.0)
    msd, osd = get_state_dict(ddp, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=save_paths(root, saved_at)["parallel"])
    set_state_dict(ddp, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full = full_model_state(ddp)
    saved = torch.load(os.path.join(root, f"full-w{saved_at}.pt"))
    for k in saved:
        assert torch.equal(full[k], saved[k]), f"parallel {saved_at} -> {world}: {k}"
    train(ddp, [opt], range(STEPS, 2 * STEPS), rank, world)
    assert_plain_like(full_model_state(ddp), plain_reference(2 * STEPS), f"parallel {saved_at} -> {world} trained on")
    return True


def case_full_into_parallel(rank, world, root, saved_at):
    """Full state dicts (the model's keys those of the single-process model) into a parallelized one."""
    ddp, opt = parallel()
    saved = torch.load(os.path.join(root, f"full-w{saved_at}.pt"))
    set_model_state_dict(ddp, dict(saved), options=StateDictOptions(full_state_dict=True))  # it renames keys in place
    full = full_model_state(ddp)
    for k in saved:
        assert torch.equal(full[k], saved[k]), f"full -> parallel at {world}: {k}"
    full_optim = StateDictOptions(full_state_dict=True)
    saved_optim = torch.load(os.path.join(root, f"full-optim-w{saved_at}.pt"))
    set_optimizer_state_dict(ddp, opt, torch.load(os.path.join(root, f"full-optim-w{saved_at}.pt")),
                             options=full_optim)
    assert_equal_trees(get_optimizer_state_dict(ddp, opt, options=full_optim), saved_optim, "full optimizer state")
    return True


# ------------------------------------------------------------ the spawns


def worker(rank, world, root, loads_from):
    cases = [("save", case_save, (root,)), ("parallel_save", case_parallel_save, (root,))]
    if loads_from is not None:
        cases += [("load_direct", case_load_direct, (root, loads_from, ("hash", "range"))),
                  ("load_direct_swapped", case_load_direct, (root, loads_from, ("range", "hash"))),
                  ("load_dsd", case_load_dsd, (root, loads_from)),
                  ("load_stateful", case_load_stateful, (root, loads_from)),
                  ("parallel_load", case_parallel_load, (root, loads_from)),
                  ("full_into_parallel", case_full_into_parallel, (root, loads_from)),
                  ("refusals", case_refusals, (root, loads_from))]
    return run_cases(rank, world, cases)


class Spawns:
    """The spawns of WORLDS, run on first use (each after the one before, whose checkpoints it loads)."""

    def __init__(self, root: str) -> None:
        self.root, self.results = root, {}

    def __call__(self, i: int) -> dict:
        if i not in self.results:
            if i:
                self(i - 1)
            self.results[i] = run_ranks(WORLDS[i], worker, self.root, WORLDS[i - 1] if i else None,
                                        join_timeout_s=300)
        return self.results[i]


@pytest.fixture(scope="module")
def spawns(tmp_path_factory):
    # One folder: a spawn's files are named by its world size, and each spawn loads only the one before's.
    return Spawns(str(tmp_path_factory.mktemp("dcp")))


@pytest.mark.parametrize("spawn", [0, 1, pytest.param(2, marks=pytest.mark.slow)])  # 2 -> 3 by default; 3 -> 2 slow
def test_every_case_passes_on_every_rank(spawns, spawn):
    for rank, got in spawns(spawn).items():
        assert all(v is True for v in got.values()), (rank, got)


def test_the_full_state_dict_loads_into_the_single_process_model_strictly(spawns):
    spawns(1)
    full = torch.load(os.path.join(spawns.root, f"full-w{WORLDS[1]}.pt"))
    model = Plain()
    model.load_state_dict(full, strict=True)
    ref = plain_reference(STEPS)
    for k, v in ref.state_dict().items():
        assert_close(model.state_dict()[k], v, k)


def test_a_checkpoint_of_3_ranks_loads_into_one_process(spawns):
    """No process group here: DCP reads every rank's chunks into the whole table."""
    spawns(1)
    model, opts = fresh(("range", "hash"))
    sd = {"model": model.state_dict(), "optim": direct_optim_state(model, opts)}
    dcp.load(sd, checkpoint_id=save_paths(spawns.root, WORLDS[1])["direct"])
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opts[0], sd["optim"][0])
    for o, s in zip(opts[1:], sd["optim"][1:]):
        o.load_state_dict(s)
    want = torch.load(os.path.join(spawns.root, f"expected-w{WORLDS[1]}.pt"))
    assert_same_snapshot(snapshot(model, opts), want, f"direct {WORLDS[1]} -> 1")
    train(model, opts, range(STEPS, 2 * STEPS))
    assert_like_reference(model, 2 * STEPS, f"direct {WORLDS[1]} -> 1, trained on")


def test_in_one_process_the_state_dict_is_the_whole_table():
    model = sharded_net()
    opts = optimizers(model, True)
    train(model, opts, range(STEPS))
    sd = model.state_dict()
    assert set(sd) == {"emb.weight", "bag.weight", "hot.weight", "fc.weight", "fc.bias"}
    assert type(sd["emb.weight"]) is torch.Tensor and torch.equal(sd["emb.weight"], model.emb.full_weight())
    single = plain_net()
    single.load_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), strict=True)
    assert_close(single.emb.weight, reference(STEPS).emb.weight, "single process")
    other, other_opts = fresh(("range", "hash"))
    other.load_state_dict(sd)
    for o, src in zip(other_opts, opts):
        o.load_state_dict(src.state_dict())
    assert_same_snapshot(snapshot(other, other_opts), snapshot(model, opts), "one process, schemes swapped")
