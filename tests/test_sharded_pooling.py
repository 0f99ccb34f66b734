"""Owner-side pooling and fused optimizers of sharded bag tables, against single-process training.

One spawn per world size (1, 2, 3) runs every case. The reference is an
``nn.EmbeddingBag(sparse=True)`` trained in one process on every rank's batch
(the loss averaged over ranks, as ``grad_reduction="mean"`` does), with
torch's own optimizer; owner pooling ``"always"``, ``"never"`` and ``"auto"``
must all train like it, with skewed batches (rank 0 looks up the most),
empty bags, a rank with no ids at all, padding, per-sample weights and
``include_last_offset``. Fused optimizers (update in backward) must train
exactly like their unfused selves.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import sparsecomm.sharded as sh

from distributed import run_cases, run_ranks

V, D = 60, 4
WORLDS = (1, 2, 3)
STEPS = 3


def batch(rank: int, step: int, dtype: torch.dtype, long_bags: bool):
    """Rank ``rank``'s bags at ``step``: ids, offsets (with empty bags), per-sample weights, loss weights."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    n = 0 if rank == 1 else (40 if rank == 0 else 12) * (3 if long_bags else 1)   # skewed; rank 1 empty
    ids = (torch.rand(n, generator=g) ** 3 * V).long()                              # hot low ids
    bags = 7
    cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts])                  # repeats: empty bags
    psw = torch.rand(n, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(bags, D, generator=g, dtype=torch.float64).to(dtype)
    return ids, offsets, psw, w


def initial(dtype):
    return torch.randn(V, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)


def with_last_offset(offsets, n, step):
    """``include_last_offset`` offsets: the bags' starts, then the end of the input."""
    return torch.cat([offsets, offsets.new_tensor([n])])


def tol(dtype):
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]


def train(rank, world, dtype, mode, pooling, *, psw=False, padding=None, last_offset=False, opt="sgd",
          fused=False, long_bags=False, psw_grad=False):
    """Train the sharded table; returns (outputs per step, full weight, stats, psw grads)."""
    emb = sh.ShardedEmbeddingBag(V, D, mode=mode, padding_idx=padding, include_last_offset=last_offset,
                                 owner_pooling=pooling, _weight=initial(dtype), dtype=dtype, seed=0)
    make = {"sgd": lambda: sh.ShardedSGD(emb, lr=0.3, fused=fused),
            "adagrad": lambda: sh.ShardedAdagrad(emb, lr=0.3, fused=fused),
            "rowwise": lambda: sh.ShardedAdagrad(emb, lr=0.3, rowwise=True, fused=fused),
            "adam": lambda: sh.ShardedAdam(emb, lr=0.1, fused=fused)}
    optimizer = make[opt]()
    outs, psw_grads = [], []
    for step in range(STEPS):
        ids, offsets, weights, w = batch(rank, step, dtype, long_bags)
        if last_offset:
            offsets = with_last_offset(offsets, ids.numel(), step)
        weights = weights.requires_grad_(psw_grad) if psw else None
        optimizer.zero_grad()
        out = emb(ids, offsets, weights)
        (out * w[:out.shape[0]]).sum().backward()
        if fused:
            assert emb.local_weight.grad is None, "a fused optimizer leaves no gradient"
        optimizer.step()
        outs.append(out.detach())
        psw_grads.append(weights.grad if psw_grad else None)
    return outs, emb.full_weight(), emb.stats, psw_grads


def reference(rank, world, dtype, mode, *, psw=False, padding=None, last_offset=False, opt="sgd", long_bags=False,
              psw_grad=False):
    """Single-process training on every rank's batch: this rank's outputs, the final table, psw grads."""
    ref = nn.EmbeddingBag(V, D, mode=mode, padding_idx=padding, include_last_offset=last_offset, sparse=mode != "max",
                          _weight=initial(dtype).clone(), dtype=dtype)
    optimizer = {"sgd": lambda: torch.optim.SGD(ref.parameters(), lr=0.3),
                 "adagrad": lambda: torch.optim.Adagrad(ref.parameters(), lr=0.3),
                 "adam": lambda: torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)}[opt]()
    outs, psw_grads = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = 0
        for r in range(world):
            ids, offsets, weights, w = batch(r, step, dtype, long_bags)
            if last_offset:
                offsets = with_last_offset(offsets, ids.numel(), step)
            weights = weights.requires_grad_(psw_grad) if psw else None
            out = ref(ids, offsets, weights)
            loss = loss + (out * w[:out.shape[0]]).sum() / world
            if r == rank:
                mine, my_weights = out.detach(), weights
        loss.backward()
        optimizer.step()
        outs.append(mine)
        psw_grads.append(my_weights.grad * world if psw_grad else None)
    return outs, ref.weight.detach()


def check(got, want, dtype, what):
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        assert a.shape == b.shape, f"{what}: step {step} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.allclose(a.double(), b.double(), atol=tol(dtype), rtol=tol(dtype)), \
            f"{what}: step {step} output off by {(a.double() - b.double()).abs().max():.3g}"
    err = (got[1].double() - want[1].double()).abs().max()
    assert err <= tol(dtype) * (1 + want[1].double().abs().max()), f"{what}: final table off by {err:.3g}"


VARIANTS = [
    dict(mode="sum"),
    dict(mode="mean", padding=3),
    dict(mode="sum", psw=True),
    dict(mode="sum", psw=True, padding=0, long_bags=True),
    dict(mode="mean", last_offset=True, long_bags=True),
    dict(mode="max"),
]


def case_paths_match_single_process(rank, world):
    """Every pooling choice, variant and dtype trains like one process on the whole batch."""
    runs = 0
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for variant in (VARIANTS if dtype == torch.float64 else VARIANTS[2:4]):
            want = reference(rank, world, dtype, **variant)
            for pooling in ("always", "never", "auto", "bytes"):
                got = train(rank, world, dtype, pooling=pooling, **variant)
                check(got, want, dtype, f"{variant} {pooling} {dtype}")
                stats = got[2]
                if variant["mode"] == "max" or pooling == "never":
                    assert stats.pooled_lookups == 0, f"{variant} {pooling}: max and 'never' take rows"
                elif pooling == "always":
                    assert stats.pooled_lookups == STEPS and stats.row_lookups == 0
                elif pooling == "auto":  # measures rows first (rounds 0-2; round 0 is a warm-up)
                    paths = (stats.row_lookups, stats.pooled_lookups)
                    assert paths == (3, 0), paths
                else:  # bytes: the first round takes rows, then the cheaper path by the round's estimates
                    assert stats.row_lookups >= 1 and stats.pooled_lookups + stats.row_lookups == STEPS
                runs += 1
    return runs


def case_bytes_rule(rank, world):
    """Long bags at 2+ ranks move fewer bytes pooled; bags of one id move fewer as unique rows."""
    if world == 1:
        return None
    long = train(rank, world, torch.float64, "sum", "bytes", long_bags=True)[2]
    ones = sh.ShardedEmbeddingBag(V, D, mode="sum", seed=1, dtype=torch.float64, owner_pooling="bytes")
    for step in range(STEPS):
        ids = batch(rank, step, torch.float64, False)[0]
        ones(ids, torch.arange(ids.numel())).sum().backward()
    return long.pooled_lookups, ones.stats.pooled_lookups


def case_psw_with_grad_takes_rows(rank, world):
    """Per-sample weights that need a gradient: the rows path, and their gradient is right."""
    got = train(rank, world, torch.float64, "sum", "always", psw=True, psw_grad=True)
    want = reference(rank, world, torch.float64, "sum", psw=True, psw_grad=True)
    check(got, want, torch.float64, "psw with grad")
    assert got[2].pooled_lookups == 0
    return True


def case_fused_equals_unfused(rank, world):
    """A fused optimizer (update in backward) trains exactly like the same optimizer in step()."""
    for opt in ("sgd", "adagrad", "rowwise", "adam"):
        for pooling in ("always", "never"):
            plain = train(rank, world, torch.float64, "sum", pooling, psw=True, opt=opt, long_bags=True)
            fused = train(rank, world, torch.float64, "sum", pooling, psw=True, opt=opt, long_bags=True, fused=True)
            check(fused, plain[:2], torch.float64, f"fused {opt} {pooling}")
            if opt != "rowwise":
                want = reference(rank, world, torch.float64, "sum", psw=True, opt=opt, long_bags=True)
                check(fused, want, torch.float64, f"fused {opt} {pooling} vs torch")
    return True


def prefetch_loop(rank, world, pooling, prefetching, fused=False, two_tables=False):
    """Train with the next batch's ids exchanged early (or not): outputs per step and the final tables.

    The prefetch of batch t+1 is issued after batch t's forward and before
    its backward and step, so batch t+1's rows must be pulled after the update.
    """
    tables = [sh.ShardedEmbeddingBag(V, D, mode="sum", owner_pooling=pooling, _weight=initial(torch.float64),
                                     dtype=torch.float64, seed=0) for _ in range(2 if two_tables else 1)]
    opts = [sh.ShardedAdagrad(t, lr=0.3, fused=fused) for t in tables]
    if two_tables:
        holder = nn.Module()
        holder.a, holder.b = tables
        sh.group_tables(holder)
    batches = [batch(rank, step, torch.float64, True) for step in range(STEPS)]

    def calls(step):
        ids, offsets, psw, _ = batches[step]
        return [(t, (ids, offsets, psw)) for t in tables]

    handles = sh.prefetch(*calls(0)) if prefetching else None
    outs = []
    for step in range(STEPS):
        args = handles if prefetching else [c[1] for c in calls(step)]
        out = sum(t(*(a,) if prefetching else a) for t, a in zip(tables, args))
        if prefetching and step + 1 < STEPS:
            handles = sh.prefetch(*calls(step + 1))
        (out * batches[step][3]).sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
        outs.append(out.detach())
    return outs, [t.full_weight() for t in tables]


def case_prefetch(rank, world):
    """Prefetched lookups train exactly as plain ones (rows pulled after each update), alone and grouped."""
    for pooling in ("never", "always"):
        for fused in (False, True):
            for two in (False, True):
                plain = prefetch_loop(rank, world, pooling, False, fused, two)
                early = prefetch_loop(rank, world, pooling, True, fused, two)
                for a, b in zip(plain[0] + plain[1], early[0] + early[1]):
                    assert torch.equal(a, b), f"prefetch {pooling} fused={fused} two={two}: differs from plain"
    # One table: the same as one process on every rank's batch (Adagrad).
    want = reference(rank, world, torch.float64, "sum", psw=True, opt="adagrad", long_bags=True)
    got = prefetch_loop(rank, world, "always", True)
    check((got[0], got[1][0]), want, torch.float64, "prefetch vs single process")
    # A prefetch left unused is ended by the next plain lookup; a bad prefetched input raises on every rank.
    emb = sh.ShardedEmbeddingBag(V, D, mode="sum", _weight=initial(torch.float64), dtype=torch.float64, seed=0)
    ids = torch.tensor([[1, 2], [3, 4]])
    emb.prefetch(ids)
    assert torch.allclose(emb(ids), initial(torch.float64)[ids].sum(1))
    bad = emb.prefetch(torch.tensor([[1, V]]) if rank == 0 else ids)
    try:
        emb(bad)
    except ValueError as e:
        assert "outside" in str(e) or "rank 0" in str(e), e
    else:
        raise AssertionError("a bad prefetched id must raise")
    assert torch.allclose(emb(ids), initial(torch.float64)[ids].sum(1))
    return True


def _worker(rank, world):
    return run_cases(rank, world, (("paths", case_paths_match_single_process, ()),
                                   ("bytes", case_bytes_rule, ()),
                                   ("psw_grad", case_psw_with_grad_takes_rows, ()),
                                   ("fused", case_fused_equals_unfused, ()),
                                   ("prefetch", case_prefetch, ())))


@functools.lru_cache(maxsize=None)
def runs(world):
    return run_ranks(world, _worker, join_timeout_s=240)


# The spawned runs (about 45 s) are slow tests; the default suite trains in this process (a world of one).
SLOW = pytest.mark.slow
WORLD_PARAMS = [pytest.param(w, marks=SLOW) for w in WORLDS]


@pytest.mark.parametrize("pooling", ["always", "never", "bytes"])
@pytest.mark.parametrize("fused", [False, True])
def test_in_one_process_every_path_trains_like_nn_embedding_bag(pooling, fused):
    variant = dict(mode="mean", psw=False, padding=3, long_bags=True)
    check(train(0, 1, torch.float64, pooling=pooling, fused=fused, **variant),
          reference(0, 1, torch.float64, **variant), torch.float64, f"{pooling} fused={fused}")
    variant = dict(mode="sum", psw=True, last_offset=True)
    check(train(0, 1, torch.float64, pooling=pooling, fused=fused, opt="adagrad", **variant),
          reference(0, 1, torch.float64, opt="adagrad", **variant), torch.float64, f"{pooling} fused={fused} psw")


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_every_pooling_path_trains_like_a_single_process(world):
    assert all(runs(world)[r]["paths"] == 6 * 4 + 2 * 2 * 4 for r in range(world))


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_per_sample_weights_with_gradient_take_the_rows_path(world):
    assert all(runs(world)[r]["psw_grad"] for r in range(world))


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_fused_optimizers_train_like_unfused_ones(world):
    assert all(runs(world)[r]["fused"] for r in range(world))


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_prefetched_lookups_train_exactly_like_plain_ones(world):
    assert all(runs(world)[r]["prefetch"] for r in range(world))


def test_in_one_process_prefetch_trains_like_plain_lookups():
    assert case_prefetch(0, 1)


@pytest.mark.parametrize("world", [pytest.param(w, marks=SLOW) for w in WORLDS[1:]])
def test_bytes_rule_pools_long_bags_and_not_single_ids(world):
    for r in range(world):
        long_pooled, single_pooled = runs(world)[r]["bytes"]
        assert long_pooled == STEPS - 1, "after the first round, long bags are pooled at their owners"
        assert single_pooled == 0, "bags of one id move fewer bytes as unique rows"


def test_auto_measures_both_paths_then_keeps_the_faster():
    from sparsecomm.sharded.pooling import REMEASURE_ROUNDS, choose_pooling

    assert choose_pooling("auto", [(0, 0), (0, 0)], 0) is None            # nothing measured: keep rows
    assert choose_pooling("auto", [(0, 700), (800, 900)], 1) is False     # a rank has not timed rows
    assert choose_pooling("auto", [(900, 0), (800, 0)], 2) is True        # rows known everywhere: try pooled
    assert choose_pooling("auto", [(900, 700), (800, 0)], 3) is True      # one rank has not timed pooled yet
    assert choose_pooling("auto", [(900, 700), (800, 1200)], 4) is False  # 1700 rows < 1900 pooled
    assert choose_pooling("auto", [(900, 700), (800, 900), (0, 0)], 5) is True   # a rank without lookups abstains
    assert choose_pooling("auto", [(900, 700), (800, 1200)], REMEASURE_ROUNDS - 1) is True  # re-measure the other
    assert choose_pooling("bytes", [(100, 40), (100, 80)], 0) is True and choose_pooling("bytes", [(0, 0)], 0) is None
    assert choose_pooling("always", [(1, 2)], 0) is None and choose_pooling("never", [(1, 2)], 0) is None
