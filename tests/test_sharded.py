"""Sharded embeddings on real gloo ranks against single-process training of a replicated table.

Reference: the same model with ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)``
and torch's own optimizers (SGD, Adagrad, SparseAdam), trained in one process
on the concatenation of every rank's batch. The sharded model runs under DDP
(its dense layer is DDP's; the table is not) with each rank on its own batch.

Ranks are spawned once per world size, in the order 1, 3, 2; each spawn runs
every case, saves a checkpoint, and loads the checkpoints of the earlier
spawns (1 -> 3, 1 -> 2, 3 -> 2), continuing training and comparing with an
uninterrupted reference. The test process itself (a world of one, no process
group) then loads the 3- and 2-rank checkpoints (3 -> 1, 2 -> 1) and checks
torn and mismatched checkpoints offline.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
import sparsecomm.sharded as sh
from sparsecomm.collectives.sharded_exchange import allgather_table_rows
from sparsecomm.sharded import checkpoint as ckpt

from distributed import expect_value_error, run_ranks

V, D, B, L = 120, 6, 5, 4
STEPS = 15              # StepLR(step_size=7): the last step trains at the twice-decayed rate
CKPT_STEPS = 5          # train this many, save, then this many again
WORLDS = (1, 3, 2)      # spawn order: each loads the checkpoints of the earlier ones
LR = {"sgd": 0.5, "adagrad": 0.3, "adam": 0.05}

# (name, table kind, optimizer, scheme, dtype, input variant)
TRAIN_CASES = [
    (f"{kind}-{opt}-{scheme}", kind, opt, scheme, torch.float64, variant)
    for kind, variant in (("emb", "2d"), ("bag-sum", "psw"), ("bag-mean", "offsets"))
    for opt in ("sgd", "adagrad", "adam")
    for scheme in ("hash", "range")
] + [
    ("emb-padding-adam-hash", "emb", "adam", "hash", torch.float64, "padding"),
    ("bag-max-sgd-range", "bag-max", "sgd", "range", torch.float64, "2d"),
    ("emb-adam-hash-float32", "emb", "adam", "hash", torch.float32, "2d"),
    ("bag-sum-adagrad-hash-float32", "bag-sum", "adagrad", "hash", torch.float32, "2d"),
]
OTHER_CASES = ["errors", "memory", "state_dict", "export_import", "optimizer_api", "checkpoint_save",
               "checkpoint_refused", "bench_smoke"] + [f"checkpoint_load_from_{w}" for w in WORLDS]
BENCH_WORLD = 2  # the sharded benchmark's body runs (tiny) in this spawn only
ALL_CASES = [c[0] for c in TRAIN_CASES] + OTHER_CASES


# ------------------------------------------------------------------- the model


class Net(nn.Module):
    """A table (sharded or not) feeding a dense layer: the shape of a recommendation model."""

    def __init__(self, emb: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.emb = emb
        self.fc = nn.Linear(D, 1, dtype=dtype)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(1, D, generator=g).to(dtype) * 0.3)
            self.fc.bias.fill_(0.1)

    def forward(self, x, offsets=None, psw=None):
        if isinstance(self.emb, (nn.Embedding, sh.ShardedEmbedding)):
            pooled = self.emb(x).sum(dim=1)
        else:
            pooled = self.emb(x, offsets, per_sample_weights=psw)
        return self.fc(pooled).squeeze(-1)


def full_table(dtype: torch.dtype, padding: bool = False) -> torch.Tensor:
    t = torch.randn(V, D, generator=torch.Generator().manual_seed(11), dtype=torch.float64).to(dtype)
    if padding:
        t[0] = 0
    return t


def make_table(kind: str, sharded: bool, scheme: str, dtype: torch.dtype, padding: bool, weight=None):
    weight = full_table(dtype, padding) if weight is None else weight
    pad = 0 if padding else None
    if sharded:
        if kind == "emb":
            return sh.ShardedEmbedding(V, D, padding_idx=pad, scheme=scheme, dtype=dtype, _weight=weight)
        return sh.ShardedEmbeddingBag(V, D, mode=kind.split("-")[1], scheme=scheme, dtype=dtype, _weight=weight)
    if kind == "emb":
        return nn.Embedding(V, D, padding_idx=pad, sparse=True, _weight=weight.clone(), dtype=dtype)
    mode = kind.split("-")[1]
    # torch has no sparse gradient for mode="max"; plain SGD is the same update dense.
    return nn.EmbeddingBag(V, D, mode=mode, sparse=mode != "max", _weight=weight.clone(), dtype=dtype)


def make_batch(seed: int, step: int, rank: int, variant: str, dtype: torch.dtype):
    """Rank ``rank``'s batch at ``step``: skewed ids (many repeats, id 0 most frequent)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + rank)
    target = torch.randn(B, generator=g, dtype=torch.float64).to(dtype)
    if variant == "offsets":
        lengths = torch.randint(0, 2 * L, (B,), generator=g)          # empty bags included
        ids = (torch.rand(int(lengths.sum()), generator=g) ** 3 * V).long()
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        return dict(x=ids, offsets=offsets, psw=None, target=target)
    ids = (torch.rand(B, L, generator=g) ** 3 * V).long()
    psw = torch.rand(B, L, generator=g, dtype=torch.float64).to(dtype) if variant == "psw" else None
    return dict(x=ids, offsets=None, psw=psw, target=target)


def global_batch(seed, step, world, variant, dtype):
    """Every rank's batch, concatenated: what the single-process reference trains on."""
    parts = [make_batch(seed, step, r, variant, dtype) for r in range(world)]
    if variant == "offsets":
        shift = torch.tensor([0] + [p["x"].numel() for p in parts[:-1]]).cumsum(0)
        return dict(x=torch.cat([p["x"] for p in parts]),
                    offsets=torch.cat([p["offsets"] + s for p, s in zip(parts, shift)]),
                    psw=None, target=torch.cat([p["target"] for p in parts]))
    return {k: (torch.cat([p[k] for p in parts]) if parts[0][k] is not None else None)
            for k in ("x", "offsets", "psw", "target")}


def make_optimizers(model, opt: str, sharded: bool):
    dense = torch.optim.SGD(model.fc.parameters(), lr=0.05)
    lr = LR[opt]
    if sharded:
        sparse = {"sgd": lambda: sh.ShardedSGD(model, lr=lr),
                  "adagrad": lambda: sh.ShardedAdagrad(model, lr=lr, lr_decay=0.01, initial_accumulator_value=0.1),
                  "adam": lambda: sh.ShardedAdam(model, lr=lr)}[opt]()
    else:
        params = model.emb.parameters()
        sparse = {"sgd": lambda: torch.optim.SGD(params, lr=lr),
                  "adagrad": lambda: torch.optim.Adagrad(params, lr=lr, lr_decay=0.01, initial_accumulator_value=0.1),
                  "adam": lambda: torch.optim.SparseAdam(params, lr=lr)}[opt]()
    # The sharded optimizer must work with torch's LR schedulers like any optimizer.
    sched = torch.optim.lr_scheduler.StepLR(sparse, step_size=7, gamma=0.5)
    return dense, sparse, sched


def train_steps(model, forward_model, opts, batches):
    dense, sparse, sched = opts
    for b in batches:
        dense.zero_grad()
        sparse.zero_grad()
        loss = ((forward_model(b["x"], b["offsets"], b["psw"]) - b["target"]) ** 2).mean()
        loss.backward()
        dense.step()
        sparse.step()
        sched.step()


def reference(kind, opt, dtype, variant, world, seed, steps, start=0, padding=False):
    """Single process, replicated table, torch optimizers, every rank's batch at once."""
    model = Net(make_table(kind, False, "hash", dtype, padding), dtype)
    opts = make_optimizers(model, opt, False)
    batches = [global_batch(seed, s, world, variant, dtype) for s in range(start, start + steps)]
    train_steps(model, model, opts, batches)
    return model


def tol(dtype):
    return dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-5)


def assert_close(a, b, dtype, what):
    a, b = a.detach().double(), b.detach().double()
    t = tol(dtype)
    err = float((a - b).abs().max())
    assert torch.allclose(a, b, **t), f"{what}: max abs diff {err}"


# --------------------------------------------------------------- rank cases


def case_train(rank, world, name, kind, opt, scheme, dtype, variant):
    seed = ALL_CASES.index(name)
    padding = variant == "padding"
    model = Net(make_table(kind, True, scheme, dtype, padding), dtype)
    ddp = DDP(model)
    opts = make_optimizers(model, opt, True)
    batches = [make_batch(seed, s, rank, "2d" if padding else variant, dtype) for s in range(STEPS)]
    train_steps(model, ddp, opts, batches)
    ref = reference(kind, opt, dtype, "2d" if padding else variant, world, seed, STEPS, padding=padding)
    assert_close(model.emb.full_weight(), ref.emb.weight, dtype, f"{name}: table")
    assert_close(model.fc.weight, ref.fc.weight, dtype, f"{name}: dense layer")
    assert opts[1].param_groups[0]["lr"] == LR[opt] * 0.5 ** (STEPS // 7)
    if padding:
        assert float(model.emb.full_weight()[0].abs().max()) == 0.0
        if model.emb.layout.owners(torch.tensor([0]))[0] == rank:
            slot = model.emb.layout.slots(torch.tensor([0]))
            # Lazy: the padding row's moments never move.
            assert float(opts[1].state[model.emb.local_weight]["exp_avg"][slot].abs().max()) == 0.0


def case_errors(rank, world):
    emb = sh.ShardedEmbedding(30, 4, seed=1)
    bag = sh.ShardedEmbeddingBag(30, 4, mode="sum", seed=2)
    opt = sh.ShardedSGD([emb, bag], lr=0.1)
    good = torch.tensor([[1, 2], [3, 29]])
    last = world - 1

    def still_works():
        opt.zero_grad()
        (emb(good).sum() + bag(good).sum()).backward()
        opt.step()

    bad = torch.tensor([[1, 2], [3, 30 + last]]) if rank == last else good
    msg = expect_value_error(lambda: emb(bad), f"id {30 + last}")
    assert ("outside [0, 30)" in msg) and (rank == last or f"rank {last} looked up id" in msg), msg
    still_works()
    neg = torch.tensor([[-1, 2]]) if rank == 0 else good
    expect_value_error(lambda: emb(neg), "id -1")
    expect_value_error(lambda: bag(neg), "id -1")
    still_works()
    floats = good.float() if rank == 0 else good
    expect_value_error(lambda: emb(floats), "int32 or int64" if rank == 0 else "rank 0 passed an invalid input")
    # A strided 1-D input (its flat ids a view, not contiguous) on one rank: the same rows as a contiguous one,
    # on the rows path and pooled at the owners, not an error on that rank alone.
    plain = torch.tensor([1, 2, 3, 29])
    strided = torch.tensor([1, 0, 2, 0, 3, 0, 29, 0])[::2] if rank == last else plain
    pooled = sh.ShardedEmbeddingBag(30, 4, mode="sum", seed=2, owner_pooling="always")
    with torch.no_grad():
        assert torch.equal(emb(strided), emb(plain))
        assert torch.equal(pooled(strided, torch.tensor([0, 2])), pooled(plain, torch.tensor([0, 2])))
    flat = torch.tensor([1, 2, 3])
    offs = torch.tensor([1, 2]) if rank == last else torch.tensor([0, 2])
    expect_value_error(lambda: bag(flat, offs), "offsets[0] must be 0" if rank == last else f"rank {last} passed")
    expect_value_error(lambda: bag(flat), "offsets are required")
    still_works()
    if world > 1:
        twin = sh.ShardedEmbedding(30, 4, seed=1)
        expect_value_error(lambda: (emb if rank == 0 else twin)(good), "ranks must call the same tables")
        still_works()
    for bad_args, match in (((0, 4), "num_embeddings"), ((5, 0), "embedding_dim")):
        with pytest.raises(ValueError, match=match):
            sh.ShardedEmbedding(*bad_args)
    with pytest.raises(ValueError, match="mode"):
        sh.ShardedEmbeddingBag(5, 2, mode="median")
    with pytest.raises(TypeError, match="sharded tables"):
        sh.ShardedAdam([torch.zeros(3, requires_grad=True)])


def case_memory(rank, world):
    out = {}
    for scheme in ("hash", "range"):
        emb = sh.ShardedEmbedding(10_000, 16, scheme=scheme, seed=0)
        before = emb.memory_bytes()
        opt = sh.ShardedAdam(emb)
        n = emb.layout.num_local
        ids_bytes = emb.memory_breakdown()["ownership_map"]
        # The hash map costs at most 4 bytes per owned row (a sorted id list); range needs none.
        assert ids_bytes <= 4 * n + 64 if scheme == "hash" else ids_bytes == 0
        assert before == n * 16 * 4 + ids_bytes
        assert emb.memory_bytes() == 3 * n * 16 * 4 + ids_bytes == before + opt.memory_bytes()
        emb(torch.tensor([[1, 2]])).sum().backward()
        assert emb.memory_bytes(include_grad=True) >= emb.memory_bytes()
        out[scheme] = (n, emb.memory_bytes())
    return out


def case_state_dict(rank, world):
    model = Net(sh.ShardedEmbedding(V, D, seed=5, dtype=torch.float64), torch.float64)
    opt = sh.ShardedAdagrad(model, lr=0.1)
    b = make_batch(0, 0, rank, "2d", torch.float64)
    model(b["x"]).sum().backward()
    opt.step()
    sd, osd = model.state_dict(), opt.state_dict()
    # The whole table under nn.Embedding's key: a DTensor of id-order chunks, or the table itself without peers.
    assert set(sd) == {"emb.weight", "fc.weight", "fc.bias"} and tuple(sd["emb.weight"].shape) == (V, D)
    assert (type(sd["emb.weight"]).__name__ == "DTensor") == (world > 1)
    other = Net(sh.ShardedEmbedding(V, D, seed=6, dtype=torch.float64), torch.float64)
    other_opt = sh.ShardedAdagrad(other, lr=0.2)
    other.load_state_dict(sd)
    other_opt.load_state_dict(osd)
    assert torch.equal(other.emb.local_weight, model.emb.local_weight)
    assert torch.equal(other_opt.state[other.emb.local_weight]["sum"], opt.state[model.emb.local_weight]["sum"])
    assert other_opt.param_groups[0]["lr"] == 0.1
    # Another scheme takes the same state: the rows reshard.
    ranged = Net(sh.ShardedEmbedding(V, D, scheme="range", seed=5, dtype=torch.float64), torch.float64)
    ranged_opt = sh.ShardedAdagrad(ranged, lr=0.3)
    ranged.load_state_dict(sd)
    ranged_opt.load_state_dict(osd)
    assert torch.equal(ranged.emb.full_weight(), model.emb.full_weight())
    def whole(table, rows):
        ids, got = allgather_table_rows(table.layout.owned_ids(), rows, V, table.group)
        out = got.new_empty(got.shape)
        out[ids] = got
        return out

    assert torch.equal(whole(ranged.emb, ranged_opt.state[ranged.emb.local_weight]["sum"]),
                       whole(model.emb, opt.state[model.emb.local_weight]["sum"]))
    # The per-rank form loads back at the same layout only, without communication.
    local = {f"emb.{k}": v for k, v in model.emb.local_state_dict().items()}
    local.update({k: v for k, v in sd.items() if not k.startswith("emb.")})
    other.load_state_dict(local)
    with pytest.raises(RuntimeError, match="sparsecomm.sharded.load"):
        ranged.load_state_dict(local)
    bigger = dict(local)
    bigger["emb._extra_state"] = dict(local["emb._extra_state"], world_size=world + 1)
    with pytest.raises(RuntimeError, match=f"of {world + 1} of a"):
        other.load_state_dict(bigger)
    # So does the optimizer's per-rank form of earlier versions (torch's layout plus each table's layout).
    old = {"state": {0: {"step": 1, "sum": opt.state[model.emb.local_weight]["sum"].clone()}},
           "param_groups": [dict(opt.param_groups[0], params=[0])], "sharding": [model.emb.layout.describe()]}
    other_opt.load_state_dict(old)
    assert torch.equal(other_opt.state[other.emb.local_weight]["sum"], opt.state[model.emb.local_weight]["sum"])
    with pytest.raises(ValueError, match="to reshard"):
        ranged_opt.load_state_dict(old)


def case_export_import(rank, world):
    full = full_table(torch.float32)
    for scheme in ("hash", "range"):
        emb = sh.ShardedEmbedding.from_pretrained(full, freeze=False, scheme=scheme)
        assert torch.equal(emb.full_weight(), full)
        ids = torch.tensor([[0, V - 1, 7], [7, 7, 3]])
        assert torch.equal(emb(ids), full[ids])
        bag = sh.ShardedEmbeddingBag(V, D, mode="mean", scheme=scheme, _weight=full)
        assert torch.allclose(bag(ids), full[ids].mean(1))
        frozen = sh.ShardedEmbedding.from_pretrained(full)
        assert not frozen(ids).requires_grad
    # The default initialization is N(0, 1) and the same at every world size.
    a = sh.ShardedEmbedding(70_000, 2, seed=123, scheme="hash").full_weight()
    b = sh.ShardedEmbedding(70_000, 2, seed=123, scheme="range").full_weight()
    assert torch.equal(a, b) and abs(float(a.std()) - 1) < 0.02
    return float(a.sum())


def case_optimizer_api(rank, world):
    emb = sh.ShardedEmbedding(V, D, seed=3, dtype=torch.float64)
    opt = sh.ShardedAdam(emb, lr=0.1)
    before = emb.local_weight.clone()
    ids = torch.tensor([[1, 2, 3]])
    # Gradients accumulate over backward passes until step(); step() changes only touched rows.
    emb(ids).sum().backward()
    emb(ids).sum().backward()
    g = emb.local_weight.grad.coalesce()
    if g._nnz():
        assert float(g._values().abs().max()) == pytest.approx(2.0)  # 2 passes x N ranks / N
    opt.step()
    touched = set(g._indices()[0].tolist())
    changed = set((emb.local_weight != before).any(1).nonzero().flatten().tolist())
    assert changed == touched
    assert opt.state[emb.local_weight]["step"] == 1
    opt.zero_grad()
    assert emb.local_weight.grad is None
    # No backward through the table: no step (as SparseAdam with no gradient).
    opt.step()
    assert opt.state[emb.local_weight]["step"] == 1
    # Row-wise Adagrad: one accumulator per row.
    table = sh.ShardedEmbedding(V, D, seed=3)
    rw = sh.ShardedAdagrad(table, rowwise=True)
    assert rw.state[table.local_weight]["sum"].shape == (table.layout.num_local,)


# ---------------------------------------------------------- checkpoint cases

def ckpt_model(schemes=("hash", "range"), seed=99):
    emb = sh.ShardedEmbedding(V, D, scheme=schemes[0], dtype=torch.float64, seed=seed)
    emb.load_full_weight(full_table(torch.float64))
    model = Net(emb, torch.float64)
    model.bag = sh.ShardedEmbeddingBag(V, D, mode="sum", scheme=schemes[1], dtype=torch.float64,
                                      _weight=full_table(torch.float64) * 0.5)
    return model


class CkptForward(nn.Module):
    """Both tables in one loss, so that both shards and both optimizer states matter."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, offsets=None, psw=None):
        return self.model(x) + self.model.bag(x).sum(1)


def ckpt_step_batch(step):
    """The 6 samples of one training step: the same data at any world size (6 divides among 1, 2, 3)."""
    g = torch.Generator().manual_seed(500 + step)
    return (torch.rand(6, L, generator=g) ** 3 * V).long(), torch.randn(6, generator=g, dtype=torch.float64)


def ckpt_reference(steps):
    model = Net(nn.Embedding(V, D, sparse=True, _weight=full_table(torch.float64), dtype=torch.float64),
                torch.float64)
    model.bag = nn.EmbeddingBag(V, D, mode="sum", sparse=True, _weight=full_table(torch.float64) * 0.5,
                                dtype=torch.float64)
    dense = torch.optim.SGD(model.fc.parameters(), lr=0.05)
    sparse = torch.optim.SparseAdam(list(model.emb.parameters()) + list(model.bag.parameters()), lr=0.05)
    opts = (dense, sparse, torch.optim.lr_scheduler.StepLR(sparse, step_size=3, gamma=0.5))
    batches = [dict(x=x, offsets=None, psw=None, target=t) for x, t in map(ckpt_step_batch, range(steps))]
    train_steps(model, CkptForward(model), opts, batches)
    return model


def ckpt_batches(rank, world, start, steps):
    """This rank's share of each step's 6 samples."""
    per = 6 // world
    sl = slice(rank * per, (rank + 1) * per)
    return [dict(x=x[sl], offsets=None, psw=None, target=t[sl])
            for x, t in map(ckpt_step_batch, range(start, start + steps))]


def ckpt_optimizers(model):
    dense = torch.optim.SGD(model.fc.parameters(), lr=0.05)
    sparse = sh.ShardedAdam(model, lr=0.05)
    return dense, sparse, torch.optim.lr_scheduler.StepLR(sparse, step_size=3, gamma=0.5)


def check_against_reference(model, steps, world):
    ref = ckpt_reference(steps)
    assert_close(model.emb.full_weight(), ref.emb.weight, torch.float64, f"table after {steps} steps")
    assert_close(model.bag.full_weight(), ref.bag.weight, torch.float64, f"bag table after {steps} steps")
    assert_close(model.fc.weight, ref.fc.weight, torch.float64, "dense layer")


def case_checkpoint_save(rank, world, root):
    model = ckpt_model()
    opts = ckpt_optimizers(model)
    fwd = DDP(CkptForward(model))
    train_steps(model, fwd, opts, ckpt_batches(rank, world, 0, CKPT_STEPS))
    check_against_reference(model, CKPT_STEPS, world)
    extra = {"dense": opts[0].state_dict(), "sched": opts[2].state_dict(), "step": CKPT_STEPS}
    manifest = sh.save(os.path.join(root, f"w{world}"), model, opts[1], extra=extra)
    assert manifest["world_size"] == world and len(manifest["files"]) == world + 1
    # Uninterrupted: go on training and compare with the reference at 2 * CKPT_STEPS.
    train_steps(model, fwd, opts, ckpt_batches(rank, world, CKPT_STEPS, CKPT_STEPS))
    check_against_reference(model, 2 * CKPT_STEPS, world)


def resume(rank, world, directory, schemes=("hash", "range")):
    """Fresh model at this world size (different init), loaded from ``directory``, trained to the end."""
    model = ckpt_model(schemes, seed=1234)
    with torch.no_grad():
        model.emb.local_weight.fill_(7.0)  # anything the load must overwrite
    opts = ckpt_optimizers(model)
    extra = sh.load(directory, model, opts[1])
    opts[0].load_state_dict(extra["dense"])
    opts[2].load_state_dict(extra["sched"])
    assert extra["step"] == CKPT_STEPS
    assert opts[1].param_groups[0]["lr"] == 0.05 * 0.5 ** (CKPT_STEPS // 3)
    assert all(opts[1].state[t.local_weight]["step"] == CKPT_STEPS for t in opts[1].tables())
    fwd = DDP(CkptForward(model)) if dist.is_initialized() else CkptForward(model)
    train_steps(model, fwd, opts, ckpt_batches(rank, world, CKPT_STEPS, CKPT_STEPS))
    check_against_reference(model, 2 * CKPT_STEPS, world)
    return model


def case_checkpoint_load(rank, world, root, saved_at):
    src = os.path.join(root, f"w{saved_at}")
    if not os.path.exists(os.path.join(src, ckpt.MANIFEST)):
        return "skip: not saved yet"
    resume(rank, world, src)
    # The ownership scheme may change on load too (hash <-> range).
    resume(rank, world, src, schemes=("range", "hash"))


def case_checkpoint_refused(rank, world, root):
    src = os.path.join(root, f"w{world}")
    torn = os.path.join(root, f"torn{world}")
    if rank == 0:
        shutil.copytree(src, torn)
        victim = os.path.join(torn, ckpt._shard_name(world - 1, world))
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 100)
    dist.barrier()
    model = ckpt_model()
    opts = ckpt_optimizers(model)
    before = model.emb.local_weight.clone()
    expect_value_error(lambda: sh.load(torn, model, opts[1]), "torn")
    assert torch.equal(model.emb.local_weight, before)
    # A model that does not fit the checkpoint: refused by every rank with the reason.
    small = Net(sh.ShardedEmbedding(V, D + 1, seed=1), torch.float64)
    expect_value_error(lambda: sh.load(src, small), "that the model lacks")
    wrong_dim = ckpt_model()
    wrong_dim.bag = sh.ShardedEmbeddingBag(V, D + 1, seed=1)
    expect_value_error(lambda: sh.load(src, wrong_dim), f"the checkpoint holds {V} x {D}, the model has {V} x {D + 1}")
    other_opt = ckpt_model()
    expect_value_error(lambda: sh.load(src, other_opt, sh.ShardedAdagrad(other_opt)), "ShardedAdam, loading into")
    dist.barrier()


def case_bench_smoke(rank, world):
    """The benchmark's body on a tiny table: every method it can run here must check out (#wrong == 0)."""
    import argparse
    import importlib.util

    from sparsecomm.bench import sharded as bench

    methods = ["sparsecomm_hash", "sparsecomm_range", "ddp_replicated"]
    if importlib.util.find_spec("torchrec") is not None:
        methods.append("torchrec")
    a = argparse.Namespace(rows=5000, dim=8, batch=64, pooling="5", alpha="1.1", alphas=[1.1], poolings=[5],
                           lr=0.05, eps=1e-8, seed=0, warmup=2, iters=2, methods=",".join(methods), device="cpu",
                           owner_pooling="always", fused=1)
    rows = bench.body(a)
    if rank == 0:
        assert [r.cols["method"] for r in rows] == methods
        for r in rows:
            assert r.cols["#wrong"] == 0 and r.cols["step_ms"] > 0, r.cols
    return methods


def _worker(rank, world, root):
    results = {}

    def run(name, fn, *args):
        # Fail fast: a rank that fails midway through a case's collectives would
        # leave its peers waiting in the next case; exiting makes theirs fail too.
        try:
            out = fn(*args)
        except BaseException as exc:
            raise AssertionError(f"case {name} failed on rank {rank} of {world}") from exc
        results[name] = out if isinstance(out, str) and out.startswith("skip") else ("ok", out)

    for name, kind, opt, scheme, dtype, variant in TRAIN_CASES:
        run(name, case_train, rank, world, name, kind, opt, scheme, dtype, variant)
    run("errors", case_errors, rank, world)
    run("memory", case_memory, rank, world)
    run("state_dict", case_state_dict, rank, world)
    run("export_import", case_export_import, rank, world)
    run("optimizer_api", case_optimizer_api, rank, world)
    run("checkpoint_save", case_checkpoint_save, rank, world, root)
    run("checkpoint_refused", case_checkpoint_refused, rank, world, root)
    if world == BENCH_WORLD:
        run("bench_smoke", case_bench_smoke, rank, world)
    for w in WORLDS:
        run(f"checkpoint_load_from_{w}", case_checkpoint_load, rank, world, root, w)
    return results


# ------------------------------------------------------------------ pytest


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sharded"))
    out = {}
    for world in WORLDS:
        out[world] = run_ranks(world, _worker, root, join_timeout_s=150)
    return root, out


def _loads_before(world, case):
    # A spawn can only load the checkpoints of itself and of the spawns before it.
    saved_at = int(case.rsplit("_", 1)[1])
    return WORLDS.index(saved_at) <= WORLDS.index(world)


@pytest.mark.parametrize("world,case", [(w, c) for w in WORLDS for c in ALL_CASES
                                        if (not c.startswith("checkpoint_load_from_") or _loads_before(w, c))
                                        and (c != "bench_smoke" or w == BENCH_WORLD)])
def test_rank_case(runs, world, case):
    results = runs[1][world]
    for rank in range(world):
        r = results[rank][case]
        if isinstance(r, str) and r.startswith("skip"):
            pytest.skip(r)
        assert isinstance(r, tuple) and r[0] == "ok", f"rank {rank} of {world}, case {case}:\n{r}"


@pytest.mark.parametrize("num_rows,world", [(1, 1), (5, 3), (64, 2), (65, 2), (70_000, 3), (3000, 30)])
def test_row_layout_agrees_with_row_owners(num_rows, world):
    # Both slot maps (the bitmap up to 21 ranks, the sorted id list past that) and the range map.
    ids = torch.arange(num_rows)
    for scheme in ("hash", "range"):
        owners = sparsecomm.ops.row_owners(ids, world, scheme, num_rows)
        for rank in range(world):
            layout = sh.RowLayout(num_rows, world, rank, scheme)
            mine = ids[owners == rank]
            assert torch.equal(layout.owned_ids(), mine)
            assert layout.num_local == len(mine)
            assert torch.equal(layout.slots(mine.flip(0)), torch.arange(len(mine)).flip(0))
            assert torch.equal(layout.owners(mine), torch.full_like(mine, rank))
            assert layout.nbytes <= 4 * len(mine) + 64 and (scheme == "hash" or layout.nbytes == 0)


def test_a_hash_layout_built_again_makes_its_bitmap_once(monkeypatch):
    # A placement trial builds the same layouts at every move: the owner map's pass over every row runs once.
    from collections import OrderedDict
    from sparsecomm.sharded import layout as layout_module

    passes = []
    real = sparsecomm.ops.owned_bitmap
    monkeypatch.setattr(layout_module, "_BITMAPS", OrderedDict())
    monkeypatch.setattr(sparsecomm.ops, "owned_bitmap", lambda *a, **k: passes.append(a) or real(*a, **k))
    ids = torch.arange(70_003)
    owners = sparsecomm.ops.row_owners(ids, 3, "hash", 70_003)
    for rank in (1, 1, 2, 1, 2):
        layout = sh.RowLayout(70_003, 3, rank, spread=rank == 2)
        assert torch.equal(layout.owned_ids(), ids[owners == rank])
        assert torch.equal(layout.positions(ids[owners == rank]), torch.arange(int((owners == rank).sum())))
    assert len(passes) == 2
    for rows in range(100, 100 + layout_module._BITMAPS_KEPT):   # the oldest is let go of
        sh.RowLayout(rows, 3, 1)
    sh.RowLayout(70_003, 3, 1)
    assert len(passes) == 3 + layout_module._BITMAPS_KEPT


@pytest.mark.parametrize("num_rows,world", [(130, 2), (70_000, 3), (3000, 30)])
def test_a_spread_layout_owns_the_same_rows_at_their_ids(num_rows, world):
    ids = torch.arange(num_rows)
    owners = sparsecomm.ops.row_owners(ids, world, "hash", num_rows)
    for rank in range(world):
        dense, spread = sh.RowLayout(num_rows, world, rank), sh.RowLayout(num_rows, world, rank, spread=True)
        mine = ids[owners == rank]
        assert spread.spread and not dense.spread and spread.describe() == dense.describe()
        assert torch.equal(spread.owned_ids(), mine) and spread.num_local == len(mine)
        assert spread.num_slots == num_rows and dense.num_slots == len(mine)
        assert torch.equal(spread.slots(mine.flip(0)), mine.flip(0))
        assert torch.equal(spread.positions(mine.flip(0)), dense.slots(mine.flip(0)))
        assert torch.equal(spread.owns(ids), owners == rank)
        storage = torch.randn(num_rows, 2)
        rows = spread.owned_rows(storage)
        assert torch.equal(rows, storage[mine]) and dense.owned_rows(rows) is rows
        before = storage.clone()
        spread.put_owned_rows(storage, -rows)
        assert torch.equal(storage[mine], -before[mine])
        foreign = owners != rank
        assert torch.equal(storage[foreign], before[foreign])   # the rows other ranks own stay as they were
    # spread means nothing where slots already are ids, and is not offered for range
    assert not sh.RowLayout(10, 1, 0, spread=True).spread
    assert not sh.RowLayout(10, 2, 0, "range", spread=True).spread


@pytest.mark.parametrize("num_rows,world,scheme", [(1, 1, "hash"), (64, 2, "hash"), (65, 3, "hash"),
                                                   (1000, 4, "range"), (200_001, 5, "hash")])
def test_owned_bitmap_and_its_ids_are_row_owners_set(num_rows, world, scheme):
    ids = torch.arange(num_rows)
    owners = sparsecomm.ops.row_owners(ids, world, scheme, num_rows)
    for rank in range(world):
        words = sparsecomm.ops.owned_bitmap(num_rows, world, rank, scheme)
        assert words.shape == (-(-num_rows // 64),) and words.dtype == torch.int64
        bits = (words[ids // 64] >> (ids % 64)) & 1
        assert torch.equal(bits.bool(), owners == rank)
        mine = ids[owners == rank]
        assert torch.equal(sparsecomm.ops.bitmap_ids(words, len(mine)), mine)
        with pytest.raises(ValueError, match="set bits"):
            sparsecomm.ops.bitmap_ids(words, len(mine) + 1)
    with pytest.raises(ValueError, match="rank"):
        sparsecomm.ops.owned_bitmap(10, 2, 2)
    with pytest.raises(TypeError, match="words"):
        sparsecomm.ops.bitmap_ids(torch.zeros(2, dtype=torch.int32), 0)


@pytest.mark.parametrize("num_rows,world", [(1, 1), (65, 2), (70_001, 3)])
def test_bitmap_positions_and_owns_count_the_set_bits(num_rows, world):
    ids = torch.arange(num_rows)
    owners = sparsecomm.ops.row_owners(ids, world, "hash", num_rows)
    probe = torch.cat([ids.flip(0), torch.tensor([-1, num_rows, 64 * (-(-num_rows // 64)) + 5])])
    for rank in range(world):
        words = sparsecomm.ops.owned_bitmap(num_rows, world, rank)
        mine = owners == rank
        # the rank of each id among the owned ids: owned ids below it
        want = torch.cumsum(mine.long(), 0) - mine.long()
        counts = torch.tensor([int(mine[w * 64:(w + 1) * 64].sum()) for w in range(len(words))])
        for dtype in (torch.int32, torch.int64):
            before = (torch.cumsum(counts, 0) - counts).to(dtype)
            assert torch.equal(sparsecomm.ops.bitmap_positions(words, before, ids.flip(0)), want.flip(0))
            with pytest.raises(ValueError, match="outside the bitmap"):
                sparsecomm.ops.bitmap_positions(words, before, probe)
        owned = sparsecomm.ops.bitmap_owns(words, num_rows, probe)
        assert torch.equal(owned[:num_rows], mine.flip(0)) and not owned[num_rows:].any()
    with pytest.raises(TypeError, match="before"):
        sparsecomm.ops.bitmap_positions(words, torch.zeros(len(words) + 1, dtype=torch.int64), ids)
    with pytest.raises(ValueError, match="exceeds the bitmap"):
        sparsecomm.ops.bitmap_owns(words, 64 * len(words) + 1, ids)


def test_memory_is_about_a_world_fraction_of_the_table(runs):
    for world in (2, 3):
        per_rank = [runs[1][world][r]["memory"][1] for r in range(world)]
        for scheme in ("hash", "range"):
            rows = [p[scheme][0] for p in per_rank]
            assert sum(rows) == 10_000
            assert max(rows) <= 1.1 * 10_000 / world, rows
            # Adam: values + two moments, float32, d = 16 (+ 4-byte ids for hash).
            assert max(p[scheme][1] for p in per_rank) <= 1.1 * 10_000 / world * (3 * 16 * 4 + 4)


def test_initialization_is_independent_of_world_size(runs):
    sums = {runs[1][w][r]["export_import"][1] for w in WORLDS for r in range(w)}
    assert len(sums) == 1


@pytest.mark.parametrize("saved_at", [3, 2])
def test_checkpoint_loads_into_a_single_process(runs, saved_at):
    root = runs[0]
    resume(0, 1, os.path.join(root, f"w{saved_at}"))


def test_export_full_equals_the_reference_at_every_world_size(runs):
    ref = ckpt_reference(CKPT_STEPS)
    for world in WORLDS:
        tables = sh.export_full(os.path.join(runs[0], f"w{world}"))
        assert set(tables) == {"emb", "bag"}
        assert_close(tables["emb"], ref.emb.weight, torch.float64, f"export at world {world}")
        assert_close(tables["bag"], ref.bag.weight, torch.float64, f"export at world {world}")
    # Import for inference: an unsharded nn.Embedding from the exported table.
    served = nn.Embedding.from_pretrained(tables["emb"])
    assert torch.equal(served(torch.tensor([3])), tables["emb"][3:4])


def _corrupt(root, name, how):
    src = os.path.join(root, "w2")
    dst = os.path.join(root, f"bad-{name}")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    how(dst)
    return dst


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _edit_manifest(d, **changes):
    p = os.path.join(d, ckpt.MANIFEST)
    with open(p) as f:
        m = json.load(f)
    m.update(changes)
    with open(p, "w") as f:
        json.dump(m, f)


@pytest.mark.parametrize("name,how,match", [
    ("no-manifest", lambda d: os.remove(os.path.join(d, ckpt.MANIFEST)), "no manifest.json"),
    ("torn-manifest", lambda d: open(os.path.join(d, ckpt.MANIFEST), "w").write("{\"format\": "), "unreadable"),
    ("truncated", lambda d: os.truncate(os.path.join(d, ckpt._shard_name(1, 2)), 1000), "torn"),
    ("flipped", lambda d: _flip_byte(os.path.join(d, ckpt._shard_name(0, 2))), "sha256"),
    ("swapped", lambda d: shutil.copy(os.path.join(d, "..", "w3", "dense.pt"), os.path.join(d, "dense.pt")),
     "dense.pt"),
    ("missing-shard", lambda d: os.remove(os.path.join(d, ckpt._shard_name(1, 2))), "missing"),
    ("wrong-world", lambda d: _edit_manifest(d, world_size=3), "does not match world size 3"),
])
def test_torn_or_mismatched_checkpoint_is_refused(runs, name, how, match):
    bad = _corrupt(runs[0], name, how)
    model = ckpt_model()
    opts = ckpt_optimizers(model)
    before = model.emb.local_weight.clone()
    with pytest.raises(ValueError, match=match):
        sh.load(bad, model, opts[1])
    assert torch.equal(model.emb.local_weight, before)
    with pytest.raises(ckpt.CheckpointError):
        sh.export_full(bad)


def test_interrupted_save_never_leaves_a_loadable_mix(tmp_path, monkeypatch):
    d = str(tmp_path / "ck")
    model = ckpt_model()
    opt = ckpt_optimizers(model)[1]
    sh.save(d, model, opt)
    assert not [f for f in os.listdir(d) if ".tmp-" in f]
    calls = {"n": 0}
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:          # the shard went in; die writing dense.pt
            f.write(b"partial")
            raise KeyboardInterrupt("power cut")
        return real_save(obj, f, *a, **k)

    with torch.no_grad():
        model.emb.local_weight.add_(1.0)
    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        sh.save(d, model, opt)
    monkeypatch.setattr(torch, "save", real_save)
    # New shard + old dense.pt on disk, and no manifest: refused, never mixed.
    assert not [f for f in os.listdir(d) if ".tmp-" in f]
    with pytest.raises(ValueError, match="no manifest.json"):
        sh.load(d, ckpt_model(), None)
    sh.save(d, model, opt)
    fresh = ckpt_model()
    sh.load(d, fresh, ckpt_optimizers(fresh)[1])
    assert torch.equal(fresh.emb.local_weight, model.emb.local_weight)


def test_stale_shards_of_another_world_size_are_removed(runs, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(os.path.join(runs[0], "w3"), d)
    model = ckpt_model()
    sh.save(d, model, ckpt_optimizers(model)[1])
    assert sorted(os.listdir(d)) == sorted([ckpt.MANIFEST, ckpt.DENSE, ckpt._shard_name(0, 1)])
