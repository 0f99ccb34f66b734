"""Hot-row replication (``HotRowConfig``) against the sharded-only table and single-process training.

A table with hot rows must train like the same table without them (up to
floating-point summation order: float64 here, 1e-12) and like one process
training ``nn.EmbeddingBag(sparse=True)`` / ``nn.Embedding(sparse=True)`` on
every rank's batch with torch's optimizer, while its hot set changes during
training (the ids' popularity moves every few steps, the window is 2 rounds),
with skewed batches (rank 0 looks up the most), a rank with no ids at some
steps, empty bags, padding, fused and unfused optimizers, and through
save / reshard / load. Every rank's replica must stay bitwise equal.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
import torch.nn as nn

import sparsecomm.sharded as sh
from sparsecomm.collectives.objects import all_gather_objects
from sparsecomm.synthetic import zipf_ids

from distributed import expect_value_error, run_cases, run_ranks

V, D = 80, 4
STEPS = 8
# Room for ~24 rows of float64 values with row-wise Adagrad: values 32 B + accumulator 8 B + index 16 B.
BUDGET = 24 * (D * 8 + 8 + 16)
HOT = sh.HotRowConfig(budget_bytes=BUDGET, window=2, min_count=1)


def batch(rank: int, world: int, step: int):
    """Bag ids, offsets (some bags empty) and loss weights of one rank's step; the last rank of 3+ has none at odd steps."""
    n = 0 if (world > 2 and rank == world - 1 and step % 2) else 24 + 12 * (world - 1 - rank)
    ids = zipf_ids(n, V, 1.3, seed=1000 * rank + step, popularity_seed=step // 3)
    bags = 6
    offsets = torch.tensor([0, 0] + sorted(torch.randint(0, n + 1, (bags - 2,),
                                                         generator=torch.Generator().manual_seed(step)).tolist()))
    w = torch.randn(bags, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7 * rank + step))
    return ids, offsets, w


def make_optimizer(table, opt: str, fused: bool):
    if opt == "sgd":
        return sh.ShardedSGD(table, lr=0.2, fused=fused)
    if opt == "adam":
        return sh.ShardedAdam(table, lr=0.05, fused=fused)
    return sh.ShardedAdagrad(table, lr=0.3, rowwise=opt == "rowwise", fused=fused)


def train(rank, world, hot: bool, opt="rowwise", fused=False, kind="bag", mode="mean", padding=3, steps=STEPS,
          table=None, optimizer=None, first_step=0):
    """Outputs per step, the final full table, and the hot sets seen (ids per step)."""
    if table is None:
        cls = sh.ShardedEmbeddingBag if kind == "bag" else sh.ShardedEmbedding
        kwargs = dict(mode=mode) if kind == "bag" else {}
        table = cls(V, D, padding_idx=padding, seed=5, dtype=torch.float64, hot_rows=HOT if hot else None,
                    **kwargs)
        optimizer = make_optimizer(table, opt, fused)
    outs, sets = [], []
    for step in range(first_step, first_step + steps):
        ids, offsets, w = batch(rank, world, step)
        if kind == "bag":
            out = table(ids, offsets)
            loss = (out * w).sum()
        else:
            out = table(ids)
            loss = (out * w[0]).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        outs.append(out.detach())
        if hot:
            sets.append(table.hot.ids.clone())
    return outs, table.full_weight(), sets, table, optimizer


def reference(rank, world, opt="rowwise", kind="bag", mode="mean", padding=3, steps=STEPS):
    """One process trains on every rank's batch, the loss averaged over ranks (``grad_reduction="mean"``)."""
    # The initial table (the same at any world size), assembled from this world's shards.
    full = sh.ShardedEmbedding(V, D, padding_idx=padding, seed=5, dtype=torch.float64).full_weight()
    if kind == "bag":
        m = nn.EmbeddingBag.from_pretrained(full.clone(), freeze=False, mode=mode, padding_idx=padding, sparse=True)
    else:
        m = nn.Embedding.from_pretrained(full.clone(), freeze=False, padding_idx=padding, sparse=True)
    opts = {"sgd": lambda p: torch.optim.SGD(p, lr=0.2), "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.3),
            "adam": lambda p: torch.optim.SparseAdam(p, lr=0.05)}
    o = opts[opt](list(m.parameters()))
    outs = []
    for step in range(steps):
        loss = 0
        for r in range(world):
            ids, offsets, w = batch(r, world, step)
            out = m(ids, offsets) if kind == "bag" else m(ids)
            loss = loss + ((out * w).sum() if kind == "bag" else (out * w[0]).sum()) / world
            if r == rank:
                outs.append(out.detach())
        loss.backward()
        o.step()
        o.zero_grad()
    return outs, m.weight.detach()


def close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), f"{what}: max diff {(a - b).abs().max().item()}"


def case_equals_sharded_only(rank, world):
    """Every optimizer, fused or not, bags and plain lookups: the same training with and without hot rows."""
    changes = 0
    for opt in ("sgd", "rowwise", "adagrad", "adam"):
        for fused in (False, True):
            for kind in (("bag", "emb") if opt == "rowwise" else ("bag",)):
                hot = train(rank, world, True, opt, fused, kind)
                plain = train(rank, world, False, opt, fused, kind)
                what = f"{opt} fused={fused} {kind}"
                for step, (a, b) in enumerate(zip(hot[0], plain[0])):
                    close(a, b, f"{what} step {step}")
                close(hot[1], plain[1], f"{what} final table")
                sets = [tuple(s.tolist()) for s in hot[2]]
                assert any(sets), f"{what}: the hot set stayed empty"
                changes += len({s for s in sets if s}) - 1
                table = hot[3]
                assert 3 not in table.hot.ids.tolist(), "the padding row must never be hot"
                # The replica equals the shard rows, and every rank holds bitwise the same one.
                if table.hot.size:
                    close(table.hot.weight, hot[1][table.hot.ids], f"{what}: replica vs shards")
                replicas = all_gather_objects((table.hot.ids, table.hot.weight), table._group)
                for ids, weight in replicas:
                    assert torch.equal(ids, table.hot.ids) and torch.equal(weight, table.hot.weight), \
                        f"{what}: replicas differ between ranks"
                mem = table.memory_breakdown()
                assert 0 < mem["hot_rows"], mem
    assert changes > 0, "the hot set never changed while training"
    return changes


def case_equals_single_process(rank, world):
    """Against torch's own sparse training of one table on every rank's batch."""
    for opt, kind, mode in (("adagrad", "bag", "mean"), ("sgd", "bag", "sum"), ("adam", "emb", "mean")):
        got = train(rank, world, True, opt, False, kind, mode)
        want = reference(rank, world, opt, kind, mode)
        for step, (a, b) in enumerate(zip(got[0], want[0])):
            close(a, b, f"{opt} {kind} step {step}")
        close(got[1], want[1], f"{opt} {kind} final table")
    return True


def case_grouped_with_prefetch(rank, world):
    """Two grouped tables (one hot, one not) with prefetched lookups train like two plain tables."""
    results = []
    for hot in (True, False):
        holder = nn.Module()
        holder.a = sh.ShardedEmbeddingBag(V, D, mode="sum", seed=5, dtype=torch.float64, hot_rows=HOT if hot else None)
        holder.b = sh.ShardedEmbeddingBag(V, D, mode="sum", seed=6, dtype=torch.float64)
        sh.group_tables(holder)
        opt = sh.ShardedAdagrad(holder, lr=0.3, rowwise=True, fused=True)
        batches = [batch(rank, world, s) for s in range(STEPS)]
        handles = sh.prefetch((holder.a, batches[0][:2]), (holder.b, batches[0][:2]))
        for step in range(STEPS):
            out = holder.a(handles[0]) + holder.b(handles[1])
            if step + 1 < STEPS:
                handles = sh.prefetch((holder.a, batches[step + 1][:2]), (holder.b, batches[step + 1][:2]))
            (out * batches[step][2]).sum().backward()
            opt.step()
            opt.zero_grad()
        results.append((holder.a.full_weight(), holder.b.full_weight()))
        if hot:
            assert holder.a.hot.version > 2
    close(results[0][0], results[1][0], "hot grouped table")
    close(results[0][1], results[1][1], "its plain neighbour")
    return True


def case_accumulation_keeps_the_set(rank, world):
    """Unfused, two backward passes before step(): the gradients add up; the set waits for step()."""
    out = []
    for hot in (True, False):
        t = sh.ShardedEmbeddingBag(V, D, mode="sum", seed=5, dtype=torch.float64, hot_rows=HOT if hot else None)
        o = sh.ShardedAdagrad(t, lr=0.3, rowwise=True)
        for step in range(STEPS):
            ids, offsets, w = batch(rank, world, step)
            (t(ids, offsets) * w).sum().backward()
            (t(ids, offsets) * w).sum().backward()   # a second round before step(): may fall on a window's end
            o.step()
            o.zero_grad()
        out.append(t.full_weight())
    close(out[0], out[1], "accumulated")
    return True


def case_disagreeing_ranks_raise(rank, world):
    """A rank whose hot set differs (it alone reloaded the table) makes every rank raise; a fresh load heals it."""
    if world == 1:
        return None
    t = sh.ShardedEmbeddingBag(V, D, mode="sum", seed=5, dtype=torch.float64, hot_rows=HOT)
    o = sh.ShardedAdagrad(t, lr=0.3, rowwise=True)
    for step in range(4):
        ids, offsets, w = batch(rank, world, step)
        (t(ids, offsets) * w).sum().backward()
        o.step()
        o.zero_grad()
    state = t.local_state_dict()  # the per-rank form: one rank loads it alone, without communication
    if rank == 0:
        t.load_state_dict(state)
    ids, offsets, _ = batch(rank, world, 5)
    expect_value_error(lambda: t(ids, offsets), "hot-row version")
    if rank != 0:
        t.load_state_dict(state)  # now every rank has reloaded: the same (empty) hot set everywhere
    assert t.hot.size == 0
    t(ids, offsets)
    return True


def _save_worker(rank, world, directory, hot):
    _, _, _, table, opt = train(rank, world, hot, "rowwise", True, steps=5)
    holder = nn.Module()
    holder.table = table
    assert not hot or table.hot.size > 0
    sh.save(directory, holder, opt)
    return table.full_weight()


def _load_worker(rank, world, directories):
    finals = []
    for directory, hot in directories:
        table = sh.ShardedEmbeddingBag(V, D, mode="mean", padding_idx=3, seed=9, dtype=torch.float64,
                                       hot_rows=HOT if hot else None)
        opt = make_optimizer(table, "rowwise", True)
        holder = nn.Module()
        holder.table = table
        sh.load(directory, holder, opt)
        *_, table, opt = train(rank, world, hot, table=table, optimizer=opt, steps=5, first_step=5)
        finals.append(table.full_weight())
    close(finals[0], finals[1], "hot vs sharded-only after reshard")
    return True


@pytest.mark.slow
def test_save_reshard_load_trains_like_the_sharded_only_table():
    """Saved at 2 ranks while rows are hot (the shards are current: write-through), loaded at 3, trained on."""
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [(os.path.join(tmp, name), hot) for name, hot in (("hot", True), ("plain", False))]
        saved = [run_ranks(2, _save_worker, d, hot)[0] for d, hot in dirs]
        close(saved[0], saved[1], "saved tables")
        full = sh.export_full(dirs[0][0])
        close(next(iter(full.values())), saved[1], "exported hot checkpoint")
        assert all(run_ranks(3, _load_worker, dirs).values())


CASES = [("sharded_only", case_equals_sharded_only, ()), ("single", case_equals_single_process, ()),
         ("grouped", case_grouped_with_prefetch, ()), ("accumulate", case_accumulation_keeps_the_set, ()),
         ("disagree", case_disagreeing_ranks_raise, ())]


@functools.lru_cache(maxsize=None)
def runs(world):
    return run_ranks(world, run_cases, CASES, join_timeout_s=300)


def test_config_is_checked():
    with pytest.raises(ValueError, match="budget_bytes"):
        sh.HotRowConfig(budget_bytes=-1)
    with pytest.raises(ValueError, match="window"):
        sh.HotRowConfig(budget_bytes=10, window=0)
    with pytest.raises(TypeError, match="HotRowConfig"):
        sh.ShardedEmbedding(V, D, hot_rows=1000)
    assert sh.ShardedEmbedding(V, D, hot_rows=sh.HotRowConfig(budget_bytes=0)).hot is None


def test_in_one_process_hot_rows_train_like_the_sharded_only_table():
    assert case_equals_sharded_only(0, 1) > 0
    assert case_equals_single_process(0, 1)
    assert case_accumulation_keeps_the_set(0, 1)


def test_without_an_optimizer_nothing_is_replicated():
    t = sh.ShardedEmbeddingBag(V, D, mode="sum", seed=5, dtype=torch.float64, hot_rows=HOT)
    for step in range(5):
        ids, offsets, w = batch(0, 1, step)
        (t(ids, offsets) * w).sum().backward()
    assert t.hot.size == 0 and t.hot.choices == 2


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_hot_rows_train_like_the_sharded_only_table(world):
    out = runs(world)
    assert all(out[r]["sharded_only"] > 0 for r in range(world))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_hot_rows_train_like_a_single_process(world):
    assert all(runs(world)[r]["single"] for r in range(world))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_grouped_prefetched_and_accumulated_hot_rows(world):
    out = runs(world)
    assert all(out[r]["grouped"] and out[r]["accumulate"] for r in range(world))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_different_hot_sets_raise_on_every_rank(world):
    assert all(runs(world)[r]["disagree"] for r in range(world))
