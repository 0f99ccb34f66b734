"""The DDP hook under stress: every option at once with the async API beside it, and AMP's GradScaler.

Each test trains against single-process training on the whole batch (or plain DDP) step by step.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.synthetic import zipf_ids

from distributed import run_ranks

V, D, B = 50, 4, 6


class Mixed(nn.Module):
    """Two sparse tables, one dense-gradient embedding, an MLP."""

    def __init__(self):
        super().__init__()
        self.a = nn.Embedding(V, D, sparse=True)
        self.b = nn.EmbeddingBag(V + 3, D, mode="mean", sparse=True)
        self.c = nn.Embedding(V, D, sparse=False)
        self.mlp = nn.Sequential(nn.Linear(3 * D, 6), nn.Tanh(), nn.Linear(6, 1))

    def forward(self, x, bags):
        return self.mlp(torch.cat([self.a(x), self.b(bags), self.c(x)], 1)).squeeze(1)


def data(rank, step):
    x = zipf_ids(B, V, 1.2, seed=step * 100 + rank)
    if rank == 0 and step % 5 == 0:
        x = x[:0].new_full((B,), 7)  # skew: one row for the whole batch
    bags = zipf_ids(B * 2, V, 1.1, seed=step * 100 + rank + 50).view(B, 2)
    y = torch.randn(B, generator=torch.Generator().manual_seed(step * 7 + rank))
    return x, bags, y


def max_diff(m1, m2):
    return max(float((p1.detach() - p2.detach()).abs().max()) for p1, p2 in zip(m1.parameters(), m2.parameters()))


def _stress_worker(rank, world, lws, steps):
    torch.manual_seed(0)
    base = Mixed()
    ours, single = DDP(copy.deepcopy(base)), copy.deepcopy(base)
    state = sparsecomm.register(ours, overlap_sparse=True, sparse_dense_embeddings=True, local_world_size=lws,
                                overrides={"a.weight": "partitioned"})
    o1 = torch.optim.SGD(ours.parameters(), lr=0.1)
    o2 = torch.optim.SGD(single.parameters(), lr=0.1)
    worst = 0.0
    for step in range(steps):
        # The user's own async sparse syncs on the default group, in flight during backward.
        side = torch.sparse_coo_tensor(torch.tensor([[rank, 9]]), torch.ones(2, 3), (16, 3))
        fut = sparsecomm.sparse_allreduce(side, async_op=True)
        x, bags, y = data(rank, step)
        o1.zero_grad(set_to_none=True)
        ((ours(x, bags) - y) ** 2).mean().backward()
        o1.step()
        assert fut.wait().to_dense()[9].tolist() == [float(world)] * 3
        everyone = [data(r, step) for r in range(world)]
        xs, bs, ys = (torch.cat(t) for t in zip(*everyone))
        o2.zero_grad(set_to_none=True)
        ((single(xs, bs) - ys) ** 2).mean().backward()
        o2.step()
        worst = max(worst, max_diff(ours.module, single))
        assert worst < 2e-5, (step, worst)
    x = torch.ones(1)
    dist.all_reduce(x)  # the default group is still in step with every rank
    return worst, sorted(state.stats)


# The default suite runs world 2; worlds 3 and 4 (two ranks per node) are slow tests, which CI runs too.
@pytest.mark.parametrize("world,lws", [(2, 1), pytest.param(3, 1, marks=pytest.mark.slow),
                                       pytest.param(4, 2, marks=pytest.mark.slow)])
def test_every_option_at_once_matches_single_process(world, lws):
    # Overlap (worker thread), dense-gradient rows, two-level aggregation (4 = 2 x 2), a forced
    # partitioned table beside the classifier's choice, and the user's async API on another group.
    results = run_ranks(world, _stress_worker, lws, 30)
    for worst, paths in results.values():
        assert worst < 2e-5
        assert "dense-embedding-rows" in paths and "partitioned" in paths


def _amp_worker(rank, world):
    torch.manual_seed(0)
    base = Mixed()
    twin = copy.deepcopy(base)
    twin.a.sparse = twin.b.sparse = False  # plain DDP on dense gradients: gloo's sparse allreduce crashes at times
    ours, ref = DDP(copy.deepcopy(base)), DDP(twin)
    sparsecomm.register(ours)  # defaults: non-finite gradients pass through, as in plain DDP
    runs = []
    for model in (ours, ref):
        runs.append((model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=256.0)))
    skipped = []
    for step in range(6):
        x, bags, y = data(rank, step)
        for model, opt, scaler in runs:
            before = copy.deepcopy(model.module.state_dict())
            opt.zero_grad(set_to_none=True)
            loss = ((model(x, bags) - y) ** 2).mean()
            if step == 2 and rank == 0:
                loss = loss * float("inf")  # an overflow on one rank only
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            same = all(torch.equal(before[k], v) for k, v in model.module.state_dict().items())
            skipped.append((step, model is ours, same, scaler.get_scale()))
        assert max_diff(ours.module, ref.module) < 2e-5, step
    return skipped


def test_gradscaler_skips_the_overflow_step_on_every_rank_like_plain_ddp():
    results = run_ranks(2, _amp_worker)
    for skipped in results.values():
        for step, is_ours, unchanged, scale in skipped:
            assert unchanged == (step == 2), (step, is_ours, unchanged)
            assert scale == (128.0 if step >= 2 else 256.0)
