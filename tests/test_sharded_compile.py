"""Sharded tables under ``torch.compile(fullgraph=True)`` train like the eager model.

A compiled lookup is one custom operator (``sparsecomm.sharded.compiled``):
the graph must hold it without a break, the run must give the eager round's
results (forward and every table update) step by step, bad input must still
raise on every rank, and a round's saved graph must be freed when its
backward ran or its result died. The default suite runs a world of one with
the ``aot_eager`` backend (Dynamo + AOTAutograd, no C++ codegen); the slow
tests spawn worlds of 2 and 3 and use inductor.
"""

from __future__ import annotations

import functools
import gc
import importlib.util

import pytest
import torch
import torch.nn as nn

import sparsecomm.sharded as sh
from sparsecomm.sharded import compiled

from distributed import expect_value_error, run_ranks

V, D, STEPS = 40, 4, 3


class Model(nn.Module):
    """A bag table (or a plain one, ``kind="emb"``) and a linear layer; one table or two grouped ones."""

    def __init__(self, kind: str, mode: str, grouped: bool = False, **table) -> None:
        super().__init__()
        self.kind = kind
        make = (lambda seed: sh.ShardedEmbeddingBag(V, D, mode=mode, seed=seed, **table)) if kind == "bag" else \
            (lambda seed: sh.ShardedEmbedding(V, D, seed=seed, **table))
        self.a = make(1)
        self.b = make(2) if grouped else None
        self.lin = nn.Linear(D, 1, dtype=torch.float64)
        if grouped:
            sh.group_tables(self)

    def forward(self, ids, offsets=None, weights=None):
        tables = [t for t in (self.a, self.b) if t is not None]
        outs = [t(ids, offsets, weights) if self.kind == "bag" else t(ids) for t in tables]
        return self.lin(sum(outs).double().reshape(-1, D)).sum()


def batch(rank: int, step: int, kind: str):
    g = torch.Generator().manual_seed(100 * rank + step)
    if kind == "emb":
        return (torch.randint(0, V, (3, 2 + step), generator=g),), {}
    n = 0 if rank == 1 else 9 + 4 * step + 3 * rank       # skewed, rank 1 empty
    ids = (torch.rand(n, generator=g) ** 2 * V).long()
    offsets = torch.tensor([0, min(2, n), min(2, n), n // 2])     # an empty bag
    weights = torch.rand(n, generator=g)
    return (ids, offsets), {"weights": weights}


def train(rank, world, compile_backend, kind="bag", mode="sum", psw=False, fused=False, grouped=False,
          opt="adagrad", **table):
    """Train; returns per-step losses, psw grads and the final tables (full)."""
    torch._dynamo.reset()   # every Model is new code to guard on: do not pile up recompilations
    torch.manual_seed(0)
    model = Model(kind, mode, grouped, **table)
    tables = [t for t in (model.a, model.b) if t is not None]
    make = sh.ShardedAdagrad if opt == "adagrad" else sh.ShardedSGD
    sparse_opt = [make(t, lr=0.2, fused=fused) for t in tables]
    dense_opt = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    run = torch.compile(model, fullgraph=True, backend=compile_backend) if compile_backend else model
    losses, grads = [], []
    for step in range(STEPS):
        args, kwargs = batch(rank, step, kind)
        if table.get("include_last_offset"):
            args = (args[0], torch.cat([args[1], args[1].new_tensor([args[0].numel()])]))
        if psw:
            kwargs["weights"].requires_grad_()
        elif kind == "bag":
            kwargs = {}
        loss = run(*args, **kwargs)
        loss.backward()
        for o in sparse_opt + [dense_opt]:
            o.step()
            o.zero_grad()
        losses.append(loss.detach())
        grads.append(kwargs["weights"].grad if psw else None)
    return losses, grads, [t.full_weight() for t in tables], [(t.stats.row_lookups, t.stats.pooled_lookups) for t in tables]


def same(eager, comp, what, exact=True):
    cmp = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-12))
    for step, (a, b) in enumerate(zip(eager[0], comp[0])):
        assert cmp(a, b), f"{what}: step {step} loss {a.item()} eager vs {b.item()} compiled"
    for step, (a, b) in enumerate(zip(eager[1], comp[1])):
        assert (a is None) == (b is None) and (a is None or cmp(a, b)), f"{what}: step {step} psw grad"
    for a, b in zip(eager[2], comp[2]):
        assert cmp(a, b), f"{what}: final table off by {(a - b).abs().max():.3g}"
    assert eager[3] == comp[3], f"{what}: lookups {eager[3]} eager vs {comp[3]} compiled"


VARIANTS = {
    "sum": dict(mode="sum"),
    "mean-padding": dict(mode="mean", padding_idx=3),
    "max": dict(mode="max"),
    "psw-grad-fused": dict(mode="sum", psw=True, fused=True),
    "last-offset-pooled": dict(mode="sum", include_last_offset=True, owner_pooling="always", opt="sgd"),
    "embedding": dict(kind="emb", padding_idx=0),
    "grouped": dict(mode="mean", grouped=True),
}


# ------------------------------------------------------------------ world of one, in this process


@pytest.mark.parametrize("variant", ["sum", "psw-grad-fused", "embedding", "grouped", "last-offset-pooled"])
def test_compiled_model_trains_like_the_eager_one(variant):
    v = VARIANTS[variant]
    same(train(0, 1, None, **v), train(0, 1, "aot_eager", **v), variant)


def test_the_graph_holds_the_lookup_op_without_a_break():
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    model = Model("bag", "sum")
    out = torch.compile(model, fullgraph=True, backend=backend)(torch.tensor([1, 2, 3]), torch.tensor([0, 1]))
    out.backward()
    op = torch.ops.sparsecomm.sharded_lookup
    assert op in seen or op.default in seen, seen
    assert model.a.local_weight.grad is not None and model.a.local_weight.grad.is_sparse


def test_rounds_are_freed_after_backward_or_when_unused_and_run_backward_once():
    torch._dynamo.reset()
    model = Model("bag", "sum")
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids, offsets = torch.tensor([1, 2, 3, 1]), torch.tensor([0, 2])
    before = compiled.open_rounds()
    loss = run(ids, offsets)
    assert compiled.open_rounds() == before + 1
    loss.backward()
    assert compiled.open_rounds() == before
    for _ in range(3):                      # forward with gradients, no backward: freed with the graph
        loss = run(ids, offsets)
    del loss
    gc.collect()
    assert compiled.open_rounds() == before
    with torch.no_grad():
        run(ids, offsets)
    assert compiled.open_rounds() == before
    # The op called eagerly: a second backward through the same round is refused, not silently doubled.
    out = compiled.lookup(model.a, ids, offsets)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward already ran"):
        out.sum().backward()


def test_bad_ids_raise_under_compile_and_the_table_stays_usable():
    torch._dynamo.reset()
    model = Model("bag", "sum")
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    expect_value_error(lambda: run(torch.tensor([1, V]), torch.tensor([0])), f"id {V}")
    run(torch.tensor([1, 2]), torch.tensor([0])).backward()
    assert model.a.local_weight.grad is not None


# ------------------------------------------------------------------ spawned worlds (slow)


def _worker(rank, world):
    out = {}
    for name, v in VARIANTS.items():
        same(train(rank, world, None, **v), train(rank, world, "aot_eager", **v), f"{name} rank {rank}")
        out[name] = True
    v = VARIANTS["mean-padding"]
    same(train(rank, world, None, **v), train(rank, world, "inductor", **v), f"inductor rank {rank}", exact=False)
    out["inductor"] = True
    expect_value_error(lambda: torch.compile(Model("bag", "sum"), fullgraph=True, backend="aot_eager")(
        torch.tensor([V + rank]) if rank == world - 1 else torch.tensor([0]), torch.tensor([0])), f"id {V + world - 1}")
    out["bad"] = True
    out["parallelize"] = case_parallelize(rank, world)
    return out


class _Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(V, D, mode="sum", sparse=True)
        self.lin = nn.Linear(D, 1)

    def forward(self, ids, offsets):
        return self.lin(self.emb(ids, offsets)).sum()


def case_parallelize(rank, world):
    """A parallelized model (sharded table + DDP with the hook) trains the same compiled and eager."""
    import sparsecomm

    def run(backend):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Dense()
        model, opt = sparsecomm.parallelize(model, torch.optim.Adagrad, plan=sparsecomm.plan(model).override(
            "emb", "shard"), lr=0.1)
        f = torch.compile(model, backend=backend) if backend else model
        losses = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(7 * step + rank)
            loss = f(torch.randint(0, V, (9,), generator=g), torch.tensor([0, 3]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    eager, comp = run(None), run("aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(eager, comp)), (eager, comp)
    return True


@functools.lru_cache(maxsize=None)
def runs(world):
    return run_ranks(world, _worker, join_timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_compiled_training_matches_eager_on_every_rank(world):
    for rank, out in runs(world).items():
        assert out == {**{name: True for name in VARIANTS}, "inductor": True, "bad": True, "parallelize": True}, \
            f"rank {rank}: {out}"


_CUDA_OK = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA_OK, reason="needs a CUDA device and CuPy (pip install sparsecomm[gpu])")
def test_compiled_lookup_on_a_cuda_table_trains_like_eager():
    def run(backend):
        torch._dynamo.reset()
        emb = sh.ShardedEmbeddingBag(V, D, mode="mean", seed=3, device="cuda", padding_idx=1)
        opt = sh.ShardedAdagrad(emb, lr=0.2, rowwise=True, fused=True)
        f = (lambda ids, offsets: emb(ids, offsets).square().sum())
        f = torch.compile(f, fullgraph=True, backend=backend) if backend else f
        losses = []
        for step in range(STEPS):
            ids = torch.randint(0, V, (10 + step,), generator=torch.Generator().manual_seed(step)).cuda()
            loss = f(ids, torch.tensor([0, 4, 4], device="cuda"))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, emb.full_weight()

    eager, comp = run(None), run("aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(eager[0], comp[0]))
    assert torch.equal(eager[1], comp[1])
