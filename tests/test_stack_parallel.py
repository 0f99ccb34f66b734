"""``sparsecomm.parallelize`` inside real training stacks: ``static_graph=True``, graphs that differ by rank, Join.

The model has a sharded table looked up in the first round, a second
sharded table looked up in a later round whose result is used only when the
batch has an optional feature, a replicated sparse table for that feature
(the feature is absent from rank 1's batches, so both are unused there), and
an MLP. The two sharded tables' rounds, the replicated table's bucket and
the MLP's bucket then become ready in a different order on each rank: every
case must neither deadlock nor differ from the reference (single-process
training on the whole batch, or plain DDP under ``Join`` on a replicated
twin). A case that hung would fail at the collective timeout.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm import sharded

from distributed import run_cases, run_ranks, weight_diffs

PER_RANK, D, STEPS = 4, 4, 5
TOL = 1e-9
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.3)), "adagrad": (torch.optim.Adagrad, dict(lr=0.2))}


class Net(nn.Module):
    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.user = nn.Embedding(300, D, sparse=sparse)                        # sharded, first round
        self.extra = nn.EmbeddingBag(200, D, mode="sum", sparse=sparse)        # sharded, second round
        self.feature = nn.EmbeddingBag(30, D, mode="sum", sparse=sparse)       # replicated, optional feature
        self.mlp = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, 1))
        self.double()

    def forward(self, b):
        h = torch.tanh(self.user(b["user"]))           # using the first round's result runs it
        extra = self.extra(b["extra"], b["extra_offsets"])
        if b["feature"].numel():                       # absent on some ranks: neither table is used there
            h = h + extra + self.feature(b["feature"], b["feature_offsets"])
        return self.mlp(h).squeeze(1)


def rank_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = PER_RANK
    has_feature = rank != 1
    lengths = torch.randint(1, 4, (n,), generator=g) if has_feature else torch.zeros(n, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    total = int(lengths.sum())
    return {"user": (torch.rand(n, generator=g) ** 2 * 300).long(),
            "extra": torch.randint(0, 200, (total,), generator=g), "extra_offsets": offsets,
            "feature": torch.randint(0, 30, (total,), generator=g), "feature_offsets": offsets,
            "y": torch.randn(n, generator=g, dtype=torch.float64)}


def whole_batch(world: int, step: int):
    parts = [rank_batch(r, step) for r in range(world)]
    out = {k: torch.cat([p[k] for p in parts]) for k in ("user", "extra", "feature", "y")}
    lengths = torch.cat([torch.diff(p["extra_offsets"], append=torch.tensor([p["extra"].numel()])) for p in parts])
    out["extra_offsets"] = out["feature_offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64),
                                                               lengths.cumsum(0)[:-1]])
    return out


def loss_of(model, b):
    return ((model(b) - b["y"]) ** 2).mean()


def train(model, opt, batches):
    for b in batches:
        opt.zero_grad()
        loss_of(model, b).backward()
        opt.step()


def max_diff(model, reference) -> float:
    return max(weight_diffs(model, reference).values())


def parallel(world: int, name: str, **kwargs):
    model = Net()
    plan = sparsecomm.plan(model, small_table_bytes=0)
    for table, placement in (("user", "shard"), ("extra", "shard"), ("feature", "replicate")):
        plan.override(table, placement)
    cls, kw = OPTIMIZERS[name]
    return sparsecomm.parallelize(model, cls, plan=plan, **kwargs, **kw)


def _rank_dependent(rank, world, name, ddp_kwargs):
    """Against one process on the whole batch: a round and a replicated table unused on rank 1 only."""
    ddp, opt = parallel(world, name, ddp_kwargs=ddp_kwargs)
    inner = ddp.module
    reference = Net()
    ref_opt = OPTIMIZERS[name][0](reference.parameters(), **OPTIMIZERS[name][1])
    worst = 0.0
    for step in range(STEPS):
        train(ddp, opt, [rank_batch(rank, step)])
        train(reference, ref_opt, [whole_batch(world, step)])
        worst = max(worst, max_diff(ddp, reference))
        assert worst < TOL, (name, step, worst)
    assert inner.user._set is inner.extra._set and inner.user._set.rounds == 2 * STEPS  # two rounds a step
    return worst


def _join(rank, world, name, short):
    """Rank ``world - 1`` runs out of batches ``short`` steps early; plain DDP under Join on replicas is the
    reference. The joined rank keeps serving its rows and landing their gradients (its shards)."""
    steps = STEPS + 1 - (short if rank == world - 1 else 0)
    batches = [rank_batch(rank, step) for step in range(steps)]
    ddp, opt = parallel(world, name)
    reference = DDP(Net(sparse=False), find_unused_parameters=True)  # rank 1 uses two tables less
    before = copy.deepcopy(reference.module)
    ref_opt = OPTIMIZERS[name][0](reference.parameters(), **OPTIMIZERS[name][1])
    for model, optimizer in ((ddp, opt), (reference, ref_opt)):
        with Join([model]):
            train(model, optimizer, batches)
    diff = max_diff(ddp, reference.module)
    assert diff < TOL, (name, diff)
    assert max_diff(ddp, before) > 1e-3  # it trained
    return diff


class ShardedNet(nn.Module):
    """A standalone sharded table (an eager round per lookup) beside an MLP under DDP with the hook."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.user = sharded.ShardedEmbedding.from_pretrained(weight, freeze=False)
        self.mlp = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, 1)).double()

    def forward(self, b):
        return self.mlp(torch.tanh(self.user(b["user"]))).squeeze(1)


def _join_fused_deferred(rank, world, short):
    """``sparsecomm.register`` with a standalone sharded table whose optimizer updates in backward and sends
    the gradient with the next request (``fused=True, defer=True``): the joined rank's shadow carries it too."""
    steps = STEPS + 1 - (short if rank == world - 1 else 0)
    batches = [rank_batch(rank, step) for step in range(steps)]
    reference = Net(sparse=False)
    model = ShardedNet(reference.user.weight.detach())
    model.mlp.load_state_dict(reference.mlp.state_dict())
    ours = DDP(model)
    sparsecomm.register(ours)
    opts = [torch.optim.SGD(model.mlp.parameters(), lr=0.3), sharded.ShardedSGD(model, lr=0.3, fused=True, defer=True)]
    ref = DDP(nn.ModuleDict({"user": reference.user, "mlp": reference.mlp}))
    ref.module.forward = lambda b: ref.module["mlp"](torch.tanh(ref.module["user"](b["user"]))).squeeze(1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    with Join([ours]):
        for b in batches:
            for o in opts:
                o.zero_grad()
            loss_of(ours, b).backward()
            for o in opts:
                o.step()
    with Join([ref]):
        train(ref, ref_opt, batches)
    start = ShardedNet(Net(sparse=False).user.weight.detach())
    full = model.user.full_weight()
    diff = max(float((full - reference.user.weight).abs().max()),
               max(float((a - b).abs().max()) for a, b in zip(model.mlp.parameters(), reference.mlp.parameters())))
    assert diff < TOL and float((full - start.user.full_weight()).abs().max()) > 1e-3, diff  # equal, and trained
    return diff


CASES = [(f"{kind}-{name}", fn, (name, arg)) for name in OPTIMIZERS for kind, fn, arg in
         (("static-graph", _rank_dependent, {"static_graph": True}),
          ("rank-dependent-graph", _rank_dependent, {"find_unused_parameters": False}),
          ("join-two-short", _join, 2))] + [("join-fused-deferred", _join_fused_deferred, (2,))]


def _all_cases(rank, world):
    return run_cases(rank, world, CASES)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_parallelize_under_static_graph_rank_dependent_graphs_and_join(world):
    for res in run_ranks(world, _all_cases).values():
        assert len(res) == len(CASES) and max(res.values()) < TOL, res
