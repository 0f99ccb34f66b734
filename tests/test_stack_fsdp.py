"""``sparsecomm.parallelize`` with FSDP2 for the dense part: ``dense="fsdp"``, or submodules already ``fully_shard``-ed.

Two sharded tables (one lookup round each step), a replicated table with a
dense gradient (FSDP's) and an MLP train like one process on the whole batch
(the reference), with each optimizer; ranks start from different weights
(rank 0's must win, as under DDP). What FSDP cannot hold is refused on every
rank before the model changes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import sparsecomm
from sparsecomm import sharded

from distributed import expect_value_error, run_cases, run_ranks

PER_RANK, D, STEPS = 4, 4, 4
TOL = 1e-9
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.3)), "adagrad": (torch.optim.Adagrad, dict(lr=0.2)),
              "adam": (torch.optim.Adam, dict(lr=0.05))}


class Net(nn.Module):
    def __init__(self, feature_sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.user = nn.Embedding(300, D, sparse=True)                                  # sharded
        self.extra = nn.EmbeddingBag(200, D, mode="sum", sparse=True)                  # sharded
        self.feature = nn.EmbeddingBag(30, D, mode="sum", sparse=feature_sparse)       # replicated: FSDP's
        self.mlp = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, 1))
        self.double()

    def forward(self, b):
        h = torch.tanh(self.user(b["user"]))
        extra = self.extra(b["extra"], b["offsets"])
        if b["extra_on"].any():   # a sharded table's lookup unused on some ranks: their graphs differ
            h = h + b["extra_on"].unsqueeze(1) * extra
        if b["feature_on"]:       # a dense parameter (FSDP's) unused on some ranks
            h = h + self.feature(b["feature"], b["offsets"])
        return self.mlp(h).squeeze(1)


def rank_batch(rank: int, step: int, without_extra: int = -1):
    """Rank ``rank``'s batch; rank ``without_extra``'s does not use the ``extra`` table."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 4, (PER_RANK,), generator=g)
    total = int(lengths.sum())
    return {"user": (torch.rand(PER_RANK, generator=g) ** 2 * 300).long(),
            "extra": torch.randint(0, 200, (total,), generator=g), "feature": torch.randint(0, 30, (total,), generator=g),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]),
            "extra_on": torch.full((PER_RANK,), float(rank != without_extra), dtype=torch.float64),
            "feature_on": True, "y": torch.randn(PER_RANK, generator=g, dtype=torch.float64)}


def whole_batch(world: int, step: int, without_extra: int = -1):
    parts = [rank_batch(r, step, without_extra) for r in range(world)]
    out = {k: torch.cat([p[k] for p in parts]) for k in ("user", "extra", "feature", "extra_on", "y")}
    lengths = torch.cat([torch.diff(p["offsets"], append=torch.tensor([p["extra"].numel()])) for p in parts])
    out["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    out["feature_on"] = True
    return out


def step(model, opts, b) -> None:
    for o in opts:
        o.zero_grad()
    ((model(b) - b["y"]) ** 2).mean().backward()
    for o in opts:
        o.step()


def reference_optimizers(model: Net, name: str):
    cls, kw = OPTIMIZERS[name]
    if name != "adam":
        return [cls(model.parameters(), **kw)]
    lazy = [model.user.weight, model.extra.weight]   # parallelize's rule: sharded tables' Adam is lazy
    ids = {id(p) for p in lazy}
    return [torch.optim.Adam([p for p in model.parameters() if id(p) not in ids], **kw),
            torch.optim.SparseAdam(lazy, **kw)]


def weights_of(model) -> dict:
    out = {f"{n}.weight": m.full_weight() for n, m in model.named_children()
           if isinstance(m, (sharded.ShardedEmbedding, sharded.ShardedEmbeddingBag))}
    for k, v in model.state_dict().items():
        if k not in out and not k.endswith(("local_weight", "_extra_state")):
            out[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def max_diff(model, reference) -> float:
    got, want = weights_of(model), reference.state_dict()
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def make_plan(model):
    plan = sparsecomm.plan(model, small_table_bytes=0)
    for table, placement in (("user", "shard"), ("extra", "shard"), ("feature", "replicate")):
        plan.override(table, placement)
    return plan


def perturbed(rank: int, mlp: bool = True, **kwargs) -> Net:
    """The reference's model, its dense weights (the MLP's too if ``mlp``) moved on ranks other than 0 (rank 0's
    must win)."""
    model = Net(**kwargs)
    with torch.no_grad():
        for p in (list(model.mlp.parameters()) if mlp else []) + [model.feature.weight]:
            p.add_(rank)
    return model


def _train_against_reference(rank, world, model, name, without_extra=-1, **kwargs):
    cls, kw = OPTIMIZERS[name]
    ours, opt = sparsecomm.parallelize(model, cls, plan=make_plan(model), **kwargs, **kw)
    assert ours is model and isinstance(model, FSDPModule), type(model)
    assert all(isinstance(p, DTensor) for p in model.mlp.parameters()) and isinstance(model.feature.weight, DTensor)
    assert opt.sharded is not None and {n for n, _ in model.named_children() if not isinstance(getattr(model, n),
                                        FSDPModule)} >= {"user", "extra"}
    reference = Net()
    ref_opts = reference_optimizers(reference, name)
    start, worst = weights_of(model), 0.0
    for s in range(STEPS):
        step(model, [opt], rank_batch(rank, s, without_extra))
        step(reference, ref_opts, whole_batch(world, s, without_extra))
        worst = max(worst, max_diff(model, reference))
        assert worst < TOL, (name, s, worst)
    assert max(float((start[k] - v).abs().max()) for k, v in weights_of(model).items()) > 1e-3   # it trained
    return worst


def _dense_fsdp(rank, world, name):
    """``dense="fsdp"``: the tables sharded, the rest under one ``fully_shard`` at the root."""
    return _train_against_reference(rank, world, perturbed(rank), name, dense="fsdp")


def _sharded_lookup_unused_on_one_rank(rank, world, name):
    """Rank 1 does not use the ``extra`` table's lookup: the sharded round's graph differs, FSDP's does not."""
    return _train_against_reference(rank, world, perturbed(rank), name, without_extra=1, dense="fsdp")


def _presharded(rank, world, name):
    """The MLP ``fully_shard``-ed by the user beforehand: accepted (no DDP), the root sharded by parallelize.
    (Each rank holds its shard of its own MLP: they start equal, as FSDP2 does not broadcast.)"""
    model = perturbed(rank, mlp=False)
    fully_shard(model.mlp, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    return _train_against_reference(rank, world, model, name)


def _untouched(model: nn.Module, fn, match: str) -> float:
    """``fn`` raises ValueError naming ``match`` and leaves ``model``'s modules and weights as they were."""
    kinds = [type(m) for m in model.modules()]
    before = _full_state(model)
    expect_value_error(fn, match)
    assert [type(m) for m in model.modules()] == kinds
    after = _full_state(model)
    assert set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())
    return 0.0


def _full_state(model: nn.Module) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user, self.out = nn.Embedding(300, D, sparse=True), nn.Linear(D, 1)

    def forward(self, ids):
        return self.out(self.user(ids))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = Tower()

    def forward(self, ids):
        return self.tower(ids)


def _refusals(rank, world):
    """What FSDP cannot hold, and options that do not apply to it: every rank refuses, nothing changes."""
    sgd = torch.optim.SGD
    model = perturbed(rank, feature_sparse=True)
    _untouched(model, lambda: sparsecomm.parallelize(model, sgd, plan=make_plan(model), dense="fsdp", lr=0.1),
               "table 'feature' is replicated with sparse=True, but fully_shard (dense='fsdp') reduce-scatters "
               "dense gradients only: shard it (plan.override('feature', 'shard')) or make it sparse=False")
    model = perturbed(rank)
    _untouched(model, lambda: sparsecomm.parallelize(model, sgd, plan=make_plan(model), dense="fsdp",
                                                     hook_options={"fused": True}, lr=0.1),
               "ddp_kwargs and hook_options configure DDP and its hook")
    _untouched(model, lambda: sparsecomm.parallelize(model, sgd, plan=make_plan(model), dense="zero", lr=0.1),
               "dense must be one of ('ddp', 'fsdp'), got 'zero'")
    fully_shard(model.mlp, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    _untouched(model, lambda: sparsecomm.parallelize(model, sgd, plan=make_plan(model), dense="ddp", lr=0.1),
               "dense='ddp', but submodules ['mlp'] are fully_shard-ed (DDP cannot wrap them): use dense='fsdp'")
    _untouched(model, lambda: sparsecomm.parallelize(model, sgd, plan=make_plan(model), lr=0.1,
                                                     ddp_kwargs={"static_graph": True}),
               "ddp_kwargs and hook_options configure DDP and its hook; dense='fsdp' uses neither")
    model = perturbed(rank, feature_sparse=True)
    fully_shard(model.feature, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))   # the planner sees no table
    plan = sparsecomm.plan(model, small_table_bytes=0).override("user", "shard").override("extra", "shard")
    _untouched(model, lambda: sparsecomm.parallelize(model, sgd, plan=plan, lr=0.1),
               "table 'feature' is replicated with sparse=True, but fully_shard (dense='fsdp') reduce-scatters dense "
               "gradients only: make it sparse=False or do not fully_shard it")
    model = Outer()
    fully_shard(model.tower, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    plan = sparsecomm.plan(model, small_table_bytes=0).override("tower.user", "shard")
    return _untouched(model, lambda: sparsecomm.parallelize(model, sgd, plan=plan, lr=0.1),
                      "table 'tower.user' is planned sharded but lies in 'tower', already fully_shard-ed")


def _checkpoint(rank, world, path):
    """``get_state_dict`` -> ``dcp.save`` -> ``dcp.load`` -> ``set_state_dict`` into a fresh model: the same
    weights, and both train on alike (the optimizers' state came back too)."""
    models, opts = [], []
    for _ in range(2):
        model = Net()
        opts.append(sparsecomm.parallelize(model, torch.optim.Adagrad, plan=make_plan(model), dense="fsdp",
                                           lr=0.2)[1])
        models.append(model)
    for s in range(2):
        step(models[0], [opts[0]], rank_batch(rank, s))
    msd, osd = get_state_dict(models[0], opts[0])
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    msd, osd = get_state_dict(models[1], opts[1])
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(models[1], opts[1], model_state_dict=state["model"], optim_state_dict=state["optim"])
    diffs = [max(float((weights_of(models[1])[k] - v).abs().max()) for k, v in weights_of(models[0]).items())]
    for s in range(2, 4):
        for model, opt in zip(models, opts):
            step(model, [opt], rank_batch(rank, s))
    diffs.append(max(float((weights_of(models[1])[k] - v).abs().max()) for k, v in weights_of(models[0]).items()))
    assert max(diffs) < TOL, diffs
    return max(diffs)


CASES = ([(f"dense-fsdp-{name}", _dense_fsdp, (name,)) for name in OPTIMIZERS]
         + [(f"presharded-{name}", _presharded, (name,)) for name in ("sgd", "adagrad")]
         # Adam is left out: the reference's lazy Adam moves rows with a zero gradient, which rank 1 never sends
         + [(f"sharded-lookup-unused-{name}", _sharded_lookup_unused_on_one_rank, (name,)) for name in ("sgd", "adagrad")]
         + [("refusals", _refusals, ())])


def _all_cases(rank, world, root):
    return run_cases(rank, world, CASES + [("checkpoint", _checkpoint, (os.path.join(root, "checkpoint"),))])


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fsdp_dense_part_equals_one_process_on_the_whole_batch(world, tmp_path):
    for res in run_ranks(world, _all_cases, str(tmp_path)).values():
        assert len(res) == len(CASES) + 1 and max(res.values()) < TOL, res


def _dense_parameter_unused_on_one_rank(rank, world):
    model = perturbed(rank)
    _, opt = sparsecomm.parallelize(model, torch.optim.SGD, plan=make_plan(model), dense="fsdp", lr=0.1)
    b = rank_batch(rank, 0)
    b["feature_on"] = rank != 1
    try:
        step(model, [opt], b)
    except RuntimeError as exc:
        return f"error: {exc}"
    return "trained"


def test_a_dense_parameter_unused_on_one_rank_is_an_error_not_a_hang():
    """FSDP2 reduce-scatters the gradients each rank has: a rank without the feature table's makes the collective
    fail (gloo may abort that rank's process); no rank may train on or wait forever."""
    results = run_ranks(2, _dense_parameter_unused_on_one_rank, expect_dead=True, join_timeout_s=120)
    assert results and all(r.startswith("error: ") for r in results.values()), results
