"""The DDP hook inside real training stacks: ``no_sync`` accumulation, ``gradient_as_bucket_view``, bf16 autocast,
``static_graph=True``, ``Join`` with uneven inputs, errors intact.

Each case trains the hook (``sparsecomm.register``) and plain DDP on a twin
with dense gradients (same weights, ``sparse=False``: gloo's sparse
allreduce inside plain DDP crashes now and then) step by step, and compares
every weight after every step; the static-graph case also compares with
one process training on the whole batch. A case that hung would fail at the
collective timeout instead of passing.
"""

import contextlib
import copy
import os
import signal
import time

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.hooks import eager_trial
from sparsecomm.hooks.state import SparseCommState
from sparsecomm.synthetic import zipf_ids

from distributed import run_cases, run_ranks

V, D, B = 40, 4, 5
TOL = 2e-5


class Net(nn.Module):
    """Two sparse tables (one an EmbeddingBag), an MLP: two sparse buckets and a dense one."""

    def __init__(self, sparse=True):
        super().__init__()
        self.a = nn.Embedding(V, D, sparse=sparse)
        self.b = nn.EmbeddingBag(V + 5, D, mode="sum", sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(2 * D, 6), nn.Tanh(), nn.Linear(6, 1))

    def forward(self, x, bags):
        return self.mlp(torch.cat([self.a(x), self.b(bags)], 1)).squeeze(1)


def batch(rank, step):
    x = zipf_ids(B, V, 1.2, seed=100 * step + rank)
    bags = zipf_ids(2 * B, V + 5, 1.1, seed=100 * step + rank + 50).view(B, 2)
    y = torch.randn(B, generator=torch.Generator().manual_seed(100 * step + rank))
    return x, bags, y


def whole_batch(world, step):
    return tuple(torch.cat(t) for t in zip(*[batch(r, step) for r in range(world)]))


def train_step(model, opt, data):
    x, bags, y = data
    opt.zero_grad(set_to_none=True)
    ((model(x, bags) - y) ** 2).mean().backward()
    opt.step()


def max_diff(m1, m2):
    return max(float((p1.detach() - p2.detach()).abs().max()) for p1, p2 in zip(m1.parameters(), m2.parameters()))


def twins(seed, ddp_kwargs=None, **options):
    """The hook on sparse tables and plain DDP on dense-gradient twins, from the same weights."""
    torch.manual_seed(seed)
    base = Net()
    ours = DDP(copy.deepcopy(base), **(ddp_kwargs or {}))
    state = sparsecomm.register(ours, **options)
    ref = DDP(Net(sparse=False), **(ddp_kwargs or {}))
    ref.module.load_state_dict(base.state_dict())
    return base, ours, state, ref


def _static_graph(rank, world, options):
    base, ours, state, ref = twins(1, {"static_graph": True}, **options)
    single = copy.deepcopy(base)
    opts = [torch.optim.SGD(m.parameters(), lr=0.2) for m in (ours, ref, single)]
    worst = 0.0
    for step in range(6):  # the first iteration (delayed allreduce), the bucket rebuild, later ones
        train_step(ours, opts[0], batch(rank, step))
        train_step(ref, opts[1], batch(rank, step))
        train_step(single, opts[2], whole_batch(world, step))
        worst = max(worst, max_diff(ours.module, ref.module), max_diff(ours.module, single))
        assert worst < TOL, (step, worst)
    assert state.iteration == 6 and state.stats, state.summary()
    return worst


def _join(rank, world, options, short):
    """Rank ``world - 1`` has ``short`` batches fewer; the others keep training while it shadows them."""
    _, ours, state, ref = twins(2, **options)
    opts = [torch.optim.Adagrad(m.parameters(), lr=0.1) for m in (ours, ref)]
    steps = 6 - (short if rank == world - 1 else 0)
    for model, opt in ((ours, opts[0]), (ref, opts[1])):
        with Join([model]):
            for step in range(steps):
                train_step(model, opt, batch(rank, step))
    diff = max_diff(ours.module, ref.module)
    assert diff < TOL, diff
    assert state.iteration == 6, state.iteration  # the joined rank's shadow steps count too
    return diff


def _errors_intact(rank, world, options=None):
    """An error raised inside the hook reaches loss.backward() with its own type and message, on every rank,
    and the DDP model keeps training afterwards like plain DDP."""
    _, ours, _, ref = twins(3, nonfinite="raise", fuse_dense=False, **(options or {}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.2) for m in (ours, ref)]
    seen = []
    for step in range(4):
        x, bags, y = batch(rank, step)
        if step == 1:
            x[0] = 7  # a row every rank looks up: NaN in rank 0's replica only
            saved = ours.module.a.weight.detach()[7].clone()
            if rank == 0:
                with torch.no_grad():
                    ours.module.a.weight[7] = float("nan")
            opts[0].zero_grad(set_to_none=True)
            try:
                ((ours(x, bags) - y) ** 2).mean().backward()
            except ValueError as exc:
                seen.append(str(exc))
            else:
                raise AssertionError("no ValueError from backward")
            assert ours.module.a.weight.grad is None  # not synchronized: reset, nothing to step with
            with torch.no_grad():
                ours.module.a.weight[7] = saved
            continue
        train_step(ours, opts[0], (x, bags, y))
        train_step(ref, opts[1], (x, bags, y))
        assert max_diff(ours.module, ref.module) < TOL, step
    return seen


def _accumulate(rank, world, ddp_kwargs, autocast, options=None):
    """``no_sync`` for the first of every two micro-batches (gradients add up locally, sparse and dense), a synced
    second one, then a step; with ``ddp_kwargs`` (``gradient_as_bucket_view``) and under bf16 autocast: the hook
    against plain DDP doing the same, every weight after every step."""
    _, ours, state, ref = twins(4, ddp_kwargs, **({"fuse_dense": False} if autocast else {}), **(options or {}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.2) for m in (ours, ref)]
    tol = 2e-2 if autocast else TOL
    worst = 0.0
    for step in range(4):
        for model, opt in ((ours, opts[0]), (ref, opts[1])):
            opt.zero_grad(set_to_none=True)
            for micro in range(2):
                x, bags, y = batch(rank, 2 * step + micro)
                with (model.no_sync() if micro == 0 else contextlib.nullcontext()), \
                        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = ((model(x, bags).float() - y) ** 2).mean()
                loss.backward()
            opt.step()
        worst = max(worst, max_diff(ours.module, ref.module))
        assert worst < tol, (step, worst)
    assert state.iteration == 4, state.iteration  # one synced backward a step
    return worst


def _short_trial(start, case):
    """``case`` with ``eager_sparse='auto'`` (the default) trying its modes early: the hook's step ``start`` eager,
    the next one fused, each timed once, the mode kept from the step after the next."""
    def run(rank, world, *args):
        saved = eager_trial.START, eager_trial.WARMUP, eager_trial.SAMPLES, SparseCommState.begin_step
        eager_trial.START, eager_trial.WARMUP, eager_trial.SAMPLES = start, 0, 1
        modes = []
        SparseCommState.begin_step = lambda state: modes.append(saved[3](state)) or modes[-1]
        try:
            result = case(rank, world, *args)
        finally:
            eager_trial.START, eager_trial.WARMUP, eager_trial.SAMPLES, SparseCommState.begin_step = saved
        assert modes[start - 1:start + 1] == [True, False], modes   # both modes ran, on every rank
        return result

    return run


CASES = [
    ("no-sync", _accumulate, (None, False)),
    ("no-sync-bucket-view", _accumulate, ({"gradient_as_bucket_view": True}, False)),
    ("no-sync-bf16-autocast", _accumulate, (None, True)),
    ("static-graph", _static_graph, ({},)),
    ("static-graph-overlap-unfused", _static_graph, ({"overlap_sparse": True, "fuse_dense": False},)),
    ("join-two-short", _join, ({}, 2)),
    ("join-overlap-rows", _join, ({"overlap_sparse": True, "sparse_dense_embeddings": True}, 1)),
    ("static-graph-eager", _static_graph, ({"eager_sparse": True},)),
    ("join-eager", _join, ({"eager_sparse": True}, 2)),
    ("no-sync-eager", _accumulate, (None, False, {"eager_sparse": True})),
    ("errors-intact-eager", _errors_intact, ({"eager_sparse": True},)),
    ("errors-intact", _errors_intact, ()),
    # Modes switching mid-run: the joined rank shadows an eager step and the agreement (hook steps 4-6); an
    # error in a fused step, then an eager one; static graph and no_sync across a switch.
    ("join-auto", _short_trial(4, _join), ({}, 2)),
    ("errors-intact-auto", _short_trial(2, _errors_intact), ()),
    ("static-graph-auto", _short_trial(2, _static_graph), ({},)),
    ("no-sync-auto", _short_trial(2, _accumulate), (None, False)),
    # The bag table on the runs path (ids as they are, each bag's row once).
    ("static-graph-runs", _static_graph, ({"overrides": {"b.weight": "runs"}},)),
    ("join-runs", _join, ({"overrides": {"b.weight": "runs"}}, 2)),
    ("no-sync-runs", _accumulate, (None, False, {"overrides": {"b.weight": "runs"}})),
]


def _all_cases(rank, world):
    return run_cases(rank, world, CASES)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_static_graph_join_and_errors_match_plain_ddp(world):
    results = run_ranks(world, _all_cases)
    for r, res in results.items():
        assert res["static-graph"] < TOL and res["join-two-short"] < TOL
        assert res["no-sync"] < TOL and res["no-sync-bucket-view"] < TOL and res["no-sync-bf16-autocast"] < 2e-2
        assert len(res["errors-intact"]) == 1 and "NaN" in res["errors-intact"][0], res["errors-intact"]
        # Each sparse bucket synced as it arrives, on the worker thread: the same results, the same errors.
        assert res["static-graph-eager"] < TOL and res["join-eager"] < TOL and res["no-sync-eager"] < TOL
        # Which NaN is found first (the sparse table's rows or the dense bucket) depends on the threads' timing.
        eager = res["errors-intact-eager"]
        assert len(eager) == 1 and "NaN" in eager[0], eager
        # 'auto' switching modes mid-run, every rank alike (a joined one too): the same results and errors.
        assert res["join-auto"] < TOL and res["static-graph-auto"] < TOL and res["no-sync-auto"] < TOL
        assert len(res["errors-intact-auto"]) == 1 and "NaN" in res["errors-intact-auto"][0]
        assert res["static-graph-runs"] < TOL and res["join-runs"] < TOL and res["no-sync-runs"] < TOL


def _dead_peer(rank, world):
    torch.manual_seed(0)
    ours = DDP(Net())
    sparsecomm.register(ours)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(2):  # after DDP's bucket rebuild (a gloo broadcast in the second forward)
        train_step(ours, opt, batch(rank, step))
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.perf_counter()
    try:
        train_step(ours, opt, batch(rank, 2))  # the first collective is the hook's fused sync (shared memory)
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), time.perf_counter() - start
    return "no error", "", 0.0


def test_a_dead_peer_surfaces_as_the_librarys_own_error_through_the_hook():
    results = run_ranks(2, _dead_peer, timeout_s=60, expect_dead=True, join_timeout_s=120)
    kind, message, seconds = results[0]
    assert kind == "RuntimeError" and "exited" in message and "Unable to cast" not in message, message
