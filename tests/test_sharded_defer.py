"""Deferred gradient pushes (``defer=True``): the same training with one all-to-all fewer a step.

A deferred backward keeps its gradient rows until the next round's request
carries them; they land before the owner serves that round: applied there
(``fused=True``), or added to ``local_weight.grad`` with the ``step()`` and
``zero_grad()`` calls made meanwhile replayed in order (unfused, what
``parallelize`` builds). Every case compares against the same optimizer
without ``defer`` bitwise (the same rule applied to the same coalesced
gradient, in the same order), and the single-process reference of
``test_sharded_pooling`` covers the rules themselves. World sizes 1-3 with
skewed batches, an empty rank and empty bags.
"""

from __future__ import annotations

import functools
import gc
import os
import tempfile

import pytest
import torch
import torch.nn as nn

import sparsecomm.sharded as sh
from sparsecomm.collectives.exchange import all_to_all_calls

from distributed import run_cases, run_ranks
from test_sharded_pooling import STEPS, V, D, batch, check, initial, reference

WORLDS = (1, 2, 3)
OPTS = {"sgd": lambda t, d: sh.ShardedSGD(t, lr=0.3, fused=True, defer=d),
        "rowwise": lambda t, d: sh.ShardedAdagrad(t, lr=0.3, rowwise=True, fused=True, defer=d),
        "adagrad": lambda t, d: sh.ShardedAdagrad(t, lr=0.3, fused=True, defer=d),
        "adam": lambda t, d: sh.ShardedAdam(t, lr=0.1, fused=True, defer=d),
        "rowwise_in_step": lambda t, d: sh.ShardedAdagrad(t, lr=0.3, rowwise=True),
        # Unfused: the update happens in step(), which a deferred gradient replays when it lands.
        "sgd_step": lambda t, d: sh.ShardedSGD(t, lr=0.3, defer=d),
        "rowwise_step": lambda t, d: sh.ShardedAdagrad(t, lr=0.3, rowwise=True, defer=d),
        "adagrad_step": lambda t, d: sh.ShardedAdagrad(t, lr=0.3, lr_decay=0.05, defer=d),
        "adam_step": lambda t, d: sh.ShardedAdam(t, lr=0.1, defer=d)}


def table(pooling="always", mode="sum", reduction="mean"):
    return sh.ShardedEmbeddingBag(V, D, mode=mode, owner_pooling=pooling, _weight=initial(torch.float64),
                                  dtype=torch.float64, seed=0, grad_reduction=reduction)


def loop(rank, defer, opt="rowwise", pooling="always", two_tables=False, eval_between=False, steps=STEPS,
         reduction="mean", accumulate=1, schedule=False, set_to_none=True, zero_first=False):
    """Train one table (or two grouped ones); outputs per step, and the model and its optimizers.

    ``accumulate`` backward passes (each its own batch) per step; ``schedule``: an LR scheduler steps after
    every step; ``zero_first``: ``zero_grad()`` before the forward (the usual loop's order) instead of after
    ``step()``.
    """
    tables = [table(pooling, reduction=reduction) for _ in range(2 if two_tables else 1)]
    model = nn.Module()
    for i, t in enumerate(tables):
        setattr(model, f"t{i}", t)
    if two_tables:
        sh.group_tables(model)
    opts = [OPTS[opt](t, defer) for t in tables]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in opts] if schedule else []
    outs = []
    for step in range(steps):
        for o in opts if zero_first else ():
            o.zero_grad(set_to_none=set_to_none)
        for micro in range(accumulate):
            ids, offsets, psw, w = batch(rank, step * accumulate + micro, torch.float64, True)
            out = sum(t(ids, offsets, psw) for t in tables)
            (out * w).sum().backward()
            outs.append(out.detach())
        for o in opts:
            o.step()
            if not zero_first:
                o.zero_grad(set_to_none=set_to_none)
        for s in scheds:
            s.step()
        if eval_between:  # a lookup without gradient: it carries the pending rows and sees the update
            with torch.no_grad():
                outs.append(sum(t(ids, offsets) for t in tables))
    return outs, model, opts


def weights(model):
    sh.flush(model)
    return [t.local_weight.detach().clone() for _, t in sorted(model.named_children())]


def same(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: tensor {i} differs by {(x - y).abs().max():.3g}"


def case_defer_equals_fused(rank, world):
    """Every rule, both paths, one table and two grouped, with lookups between steps: bitwise as without defer."""
    for opt in ("sgd", "rowwise", "adagrad", "adam"):
        for pooling in ("always", "never", "auto"):
            for two in (False, True):
                plain = loop(rank, False, opt, pooling, two, eval_between=two)
                late = loop(rank, True, opt, pooling, two, eval_between=two)
                what = f"{opt} {pooling} two={two}"
                same(plain[0], late[0], what + " outputs")
                same(weights(plain[1]), weights(late[1]), what + " tables")
                for a, b in zip(plain[2], late[2]):
                    pa, pb = a.tables()[0].local_weight, b.tables()[0].local_weight  # the state is the shard's
                    assert a.state[pa]["step"] == b.state[pb]["step"] == STEPS, what
    # And like one process training on every rank's batch.
    got = loop(rank, True, "adagrad", "always")
    want = reference(rank, world, torch.float64, "sum", psw=True, opt="adagrad", long_bags=True)
    full = got[1].t0.full_weight()
    check((got[0], full), want, torch.float64, "defer vs single process")
    return True


def case_defer_in_step_equals_immediate(rank, world):
    """Unfused rules (the update in step()): a deferred push replays step() and zero_grad() where the gradient
    lands, bitwise as the immediate push; with gradient accumulation, an LR scheduler, zero_grad() before the
    forward or keeping zeroed gradients, and lookups between steps."""
    variants = [dict(opt=o, pooling=p, two_tables=two) for o in ("sgd_step", "rowwise_step", "adagrad_step",
                                                                 "adam_step")
                for p in ("always", "never") for two in (False, True)]
    variants += [dict(opt="adagrad_step", pooling="auto", accumulate=2, schedule=True),
                 dict(opt="adam_step", pooling="never", two_tables=True, zero_first=True, set_to_none=False,
                      schedule=True),
                 dict(opt="sgd_step", pooling="always", eval_between=True, accumulate=3, zero_first=True)]
    for v in variants:
        plain, late = loop(rank, False, **v), loop(rank, True, **v)
        same(plain[0], late[0], f"{v} outputs")
        same(weights(plain[1]), weights(late[1]), f"{v} tables")
        for a, b in zip(plain[2], late[2]):
            pa, pb = a.tables()[0].local_weight, b.tables()[0].local_weight
            assert a.state[pa]["step"] == b.state[pb]["step"] == STEPS, v
            assert not b.in_flight(pb) and b.param_groups[0]["lr"] == a.param_groups[0]["lr"], v
    # And like one process training on every rank's batch.
    got = loop(rank, True, "sgd_step", "always")
    want = reference(rank, world, torch.float64, "sum", psw=True, opt="sgd", long_bags=True)
    check((got[0], got[1].t0.full_weight()), want, torch.float64, "unfused defer vs single process")
    return True


def case_summed_fused_like_step(rank, world):
    """Summed gradients (TorchRec's rule), fused row-wise Adagrad, pooled or not, deferred or not: like the same
    rule applied in step() to the sparse gradient."""
    for pooling in ("always", "never"):
        want = loop(rank, False, "rowwise_in_step", pooling, reduction="sum")
        for defer in (False, True):
            got = loop(rank, defer, "rowwise", pooling, reduction="sum")
            for a, b in zip(got[0] + weights(got[1]), want[0] + weights(want[1])):
                assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), f"{pooling} defer={defer}: {(a - b).abs().max()}"
    return True


def case_one_all_to_all_fewer(rank, world):
    """A deferred step runs two all-to-alls (request with the gradient, pull), not three."""
    if world == 1:
        return True
    per_step = {}
    for defer, opt in ((False, "rowwise"), (True, "rowwise"), ("unfused", "rowwise_step")):
        t = table("always")
        o = OPTS[opt](t, bool(defer))
        ids, offsets, psw, w = batch(rank, 0, torch.float64, True)
        for _ in range(3):  # warm-up: the request's width is learned on the first rounds
            (t(ids, offsets, psw) * w).sum().backward()
            o.step()
        before = all_to_all_calls()
        for _ in range(4):
            (t(ids, offsets, psw) * w).sum().backward()
            o.step()
        per_step[defer] = (all_to_all_calls() - before) / 4
        sh.flush(t)
    assert per_step == {False: 3, True: 2, "unfused": 2}, per_step
    return True


def case_growing_rounds_keep_their_count(rank, world):
    """Rounds whose ids grow a little every step (within the padded capacity) still take two all-to-alls each:
    the first one's width follows the round's capacity, so no rank resends its request at a larger width."""
    if world == 1:
        return True
    t = table("never")
    o = OPTS["rowwise"](t, True)
    g = torch.Generator().manual_seed(rank)
    counts = []
    for step in range(12):
        n = 16 + 3 * step   # +3 ids a step: the capacity (last largest + 1/8 + 8) holds them, and grows
        ids = torch.randperm(V, generator=g)[:n]
        before = all_to_all_calls()
        t(ids, torch.arange(0, n, 2)).sum().backward()
        o.step()
        counts.append(all_to_all_calls() - before)
    sh.flush(t)
    assert counts[3:] == [2] * 9, counts
    return True


def case_save_load_and_prefetch(rank, world, directory):
    """save/load push a pending gradient first; a prefetch pushes it before its request starts."""
    plain = loop(rank, False, "rowwise")
    late = loop(rank, True, "rowwise")
    sh.save(directory, late[1], late[2][0])  # the last backward's update is still pending here
    fresh = nn.Module()
    fresh.t0 = table()
    opt = OPTS["rowwise"](fresh.t0, True)
    sh.load(directory, fresh, opt)
    same(weights(plain[1]), weights(fresh), "saved after a deferred backward")
    p0, p1 = plain[2][0].tables()[0].local_weight, opt.tables()[0].local_weight
    assert torch.equal(plain[2][0].state[p0]["sum"], opt.state[p1]["sum"])
    # Prefetched lookups: the prefetch pushes the pending gradient, then rounds push in backward.
    t = table("always")
    o = OPTS["rowwise"](t, True)
    batches = [batch(rank, step, torch.float64, True) for step in range(STEPS)]
    outs = []
    for step in range(STEPS):
        ids, offsets, psw, w = batches[step]
        out = t(ids, offsets, psw) if step % 2 == 0 else t(t.prefetch(ids, offsets, psw))
        (out * w).sum().backward()
        o.step()
        outs.append(out.detach())
    same(plain[0], outs, "mixed prefetched and deferred lookups")
    same(weights(plain[1]), weights(_holder(t)), "mixed prefetched and deferred lookups, tables")
    return True


def _holder(t):
    m = nn.Module()
    m.t0 = t
    return m


def case_bad_request_keeps_the_update(rank, world):
    """A bad id in the round that carries the gradient raises on every rank; the update still lands."""
    for opt in ("rowwise", "adagrad_step"):
        _bad_request(rank, opt)
    return True


def _bad_request(rank, opt):
    plain, late = table(), table()
    po, lo = OPTS[opt](plain, False), OPTS[opt](late, True)
    ids, offsets, psw, w = batch(rank, 0, torch.float64, True)
    for t, o in ((plain, po), (late, lo)):
        (t(ids, offsets, psw) * w).sum().backward()
        o.step()
    bad = torch.tensor([V + 5 if rank == 0 else 1])
    try:
        late(bad, torch.tensor([0]))
    except ValueError as e:
        assert "outside" in str(e) or "rank 0" in str(e), e
    else:
        raise AssertionError("an id outside the table must raise on every rank")
    same([plain.local_weight.detach()], [late.local_weight.detach()], f"{opt}: update applied despite the bad round")
    # And the table keeps training.
    for t, o in ((plain, po), (late, lo)):
        (t(ids, offsets, psw) * w).sum().backward()
        o.step()
    same(weights(_holder(plain)), weights(_holder(late)), f"{opt}: after the bad round")


def _worker(rank, world, directory):
    return run_cases(rank, world, (("equal", case_defer_equals_fused, ()),
                                   ("in_step", case_defer_in_step_equals_immediate, ()),
                                   ("fewer", case_one_all_to_all_fewer, ()),
                                   ("growing", case_growing_rounds_keep_their_count, ()),
                                   ("summed", case_summed_fused_like_step, ()),
                                   ("checkpoint", case_save_load_and_prefetch, (directory,)),
                                   ("bad", case_bad_request_keeps_the_update, ())))


@functools.lru_cache(maxsize=None)
def runs(world):
    directory = tempfile.mkdtemp(prefix=f"sparsecomm-defer-{world}-")
    return run_ranks(world, _worker, directory, join_timeout_s=240)


WORLD_PARAMS = [pytest.param(w, marks=pytest.mark.slow) if w == 3 else w for w in WORLDS[1:]]


def test_unfused_defer_holds_step_and_zero_grad_until_the_gradient_lands():
    t = table()
    o = OPTS["adagrad_step"](t, True)
    ids, offsets, psw, w = batch(0, 0, torch.float64, True)
    before = t.local_weight.detach().clone()
    (t(ids, offsets, psw) * w).sum().backward()
    assert t.local_weight.grad is None and o.in_flight(t.local_weight)   # the gradient waits for the next round
    o.step()
    assert torch.equal(t.local_weight.detach(), before) and o.in_flight(t.local_weight)   # stepped, not cleared
    o.zero_grad()
    assert not o.in_flight(t.local_weight)   # it will land, be stepped and cleared
    sh.flush(t)
    assert not torch.equal(t.local_weight.detach(), before) and t.local_weight.grad is None
    assert o.state[t.local_weight]["step"] == 1
    # An optimizer dropped while its stepped update is in flight: the update still lands.
    (t(ids, offsets, psw) * w).sum().backward()
    o.step()
    stepped = t.local_weight.detach().clone()
    del o
    gc.collect()
    sh.flush(t)
    assert not torch.equal(t.local_weight.detach(), stepped)


def test_in_one_process_deferred_pushes_train_like_fused_ones():
    assert case_defer_equals_fused(0, 1)
    assert case_defer_in_step_equals_immediate(0, 1)
    assert case_bad_request_keeps_the_update(0, 1)


def test_in_one_process_save_load_and_prefetch_push_a_pending_gradient(tmp_path):
    assert case_save_load_and_prefetch(0, 1, str(tmp_path))


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_deferred_pushes_train_like_fused_ones(world):
    assert all(runs(world)[r]["equal"] for r in range(world))


def test_in_one_process_summed_fused_updates_train_like_step():
    assert case_summed_fused_like_step(0, 1)


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_summed_fused_updates_train_like_step(world):
    assert all(runs(world)[r]["summed"] for r in range(world))


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_a_deferred_step_runs_one_all_to_all_fewer(world):
    assert all(runs(world)[r]["fewer"] for r in range(world))


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_rounds_that_grow_within_their_capacity_send_their_request_once(world):
    assert all(runs(world)[r]["growing"] for r in range(world))


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_save_load_and_prefetch_push_a_pending_gradient(world):
    assert all(runs(world)[r]["checkpoint"] for r in range(world))


@pytest.mark.parametrize("world", WORLD_PARAMS)
def test_a_bad_round_raises_everywhere_and_keeps_the_deferred_update(world):
    assert all(runs(world)[r]["bad"] for r in range(world))
