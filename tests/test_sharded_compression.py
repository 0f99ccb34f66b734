"""Rows on the wire in half precision: ``ShardedTable.compression`` and ``parallelize(sparse_compression=)``.

Opt-in and not exact, so every case checks the rounding it promises against
numbers computed here from the same inputs:

- a pulled row arrives as the table's row rounded once to the wire dtype
  (bitwise), a world of one rounds nothing;
- an owner's gradient is the mean of each rank's gradient rows rounded once
  (float64 reference sums), within ``u sum_r |g_r| / N`` of the exact
  gradient and, with peers, not equal to it (the rounding is real);
- a pooled bag is within ``u sum_j |partial_j|`` of the exact bag;
- a deferred push applies the same rounded rows as an immediate one (bitwise);
- a compressed round sends fewer bytes than the exact one on the same ids;
- ``parallelize`` with ``sparse_compression`` trains close to one process
  (and not equal), keeps the setting across ``replan``, and refuses bad or
  conflicting settings on every rank; ranks whose tables compress
  differently raise ``ValueError`` on every rank at the first lookup.

Worlds 1, 2 and 3, skewed and uneven batches (one rank's batch is empty).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sparsecomm
import sparsecomm.sharded as sh
from sparsecomm.hooks.config import HookConfig
from sparsecomm.sharded.wire import with_compression

from distributed import expect_value_error, full_weights, run_cases, run_ranks, spawned_fixture

V, D = 64, 8
WIRES = {"bf16": (torch.bfloat16, 2.0 ** -8), "fp16": (torch.float16, 2.0 ** -11)}


def initial() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(V, D, generator=g) * 3


def unique_ids(rank: int, world: int, step: int) -> torch.Tensor:
    """Distinct ids (no duplicate rows to sum before the wire), skewed; rank 1 of 3 looks up nothing."""
    if world == 3 and rank == 1:
        return torch.empty(0, dtype=torch.int64)
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randperm(V // 2, generator=g)[: 12 + 4 * rank] * (1 + rank % 2)


def coefficients(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randn(n, D, generator=g)


def owned_gradient(t: sh.ShardedEmbedding) -> tuple:
    """``(owned ids, their gradient rows)`` of this rank's shard after a backward."""
    owned = t.layout.owned_ids()
    dense = t.local_weight.grad.coalesce().to_dense()
    return owned, dense[t.layout.slots(owned)]


def case_rows_and_gradients_round_once(rank, world, wire):
    dtype, u = WIRES[wire]
    w = initial()
    t = sh.ShardedEmbedding(V, D, _weight=w, seed=0)
    t.compression = wire
    assert t.compression == wire and t.wire_dtype == dtype
    ids = unique_ids(rank, world, 0)
    out = t(ids)
    sent = w.to(dtype).to(w.dtype) if world > 1 else w
    assert torch.equal(out, sent[ids]), "pulled rows are not the table's rows rounded once"
    (out * coefficients(rank, 0, ids.numel())).sum().backward()
    plain = sh.ShardedEmbedding(V, D, _weight=w, seed=0)   # the same round, exact: its bytes
    (plain(ids) * coefficients(rank, 0, ids.numel())).sum().backward()
    if world > 1:   # ids and metadata stay; the rows both ways take half the bytes
        assert t.stats.bytes_sent < plain.stats.bytes_sent, (t.stats.bytes_sent, plain.stats.bytes_sent)

    rounded = torch.zeros(V, D, dtype=torch.float64)   # the mean of every rank's rounded rows, float64
    exact = torch.zeros(V, D, dtype=torch.float64)
    bound = torch.zeros(V, D, dtype=torch.float64)
    for r in range(world):
        ids_r, c = unique_ids(r, world, 0), coefficients(r, 0, unique_ids(r, world, 0).numel())
        on_wire = c.to(dtype).to(torch.float32) if world > 1 else c
        rounded.index_add_(0, ids_r, on_wire.double() / world)
        exact.index_add_(0, ids_r, c.double() / world)
        bound.index_add_(0, ids_r, c.double().abs() * u / world)
    owned, got = owned_gradient(t)
    got = got.double()
    assert torch.allclose(got, rounded[owned], rtol=1e-6, atol=1e-6), (got - rounded[owned]).abs().max()
    assert bool(((got - exact[owned]).abs() <= bound[owned] + 1e-6).all()), "outside the documented bound"
    return float((got - exact[owned]).abs().max()) if owned.numel() else 0.0


def case_pooled_bags_within_bound(rank, world, wire):
    dtype, u = WIRES[wire]
    w = initial()
    t = sh.ShardedEmbeddingBag(V, D, mode="sum", owner_pooling="always", _weight=w, seed=0)
    t.compression = wire
    plain = sh.ShardedEmbeddingBag(V, D, mode="sum", owner_pooling="always", _weight=w, seed=0)   # exact twin
    g = torch.Generator().manual_seed(50 + rank)
    ids = (torch.rand(6 * 5, generator=g) ** 2 * V).long().view(6, 5)    # bags of 5 skewed ids
    out, twin = t(ids), plain(ids)
    exact = nn.functional.embedding_bag(ids, w, mode="sum")
    # Each owner's partial bag is rounded once: off by at most u times the sum of |partial| <= u sum |row|.
    bound = u * nn.functional.embedding_bag(ids, w.abs(), mode="sum") + 1e-5
    assert bool(((out - exact).abs() <= bound).all()), "a pooled bag is outside the documented bound"
    if world > 1:   # the same round uncompressed gives other bits: the partial bags travelled rounded
        assert not torch.equal(out, twin), "nothing was rounded: the partial bags did not travel compressed"
    else:
        assert torch.equal(out, twin)
    return True


def defer_loop(rank, world, defer, compression="bf16"):
    t = sh.ShardedEmbeddingBag(V, D, mode="sum", owner_pooling="always", _weight=initial(), seed=0)
    t.compression = compression
    opt = sh.ShardedSGD(t, lr=0.3, fused=True, defer=defer)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        ids = (torch.rand(4 * 3, generator=g) ** 2 * V).long().view(4, 3)
        (t(ids) * coefficients(rank, step, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    sh.flush(t)
    return t.local_weight.detach().clone()


def case_deferred_push_rounds_alike(rank, world):
    deferred = defer_loop(rank, world, True)
    assert torch.equal(deferred, defer_loop(rank, world, False))
    assert torch.equal(deferred, defer_loop(rank, world, True, None)) == (world == 1 or deferred.numel() == 0)
    return True


def case_no_change_while_a_round_is_in_flight(rank, world):
    t = sh.ShardedEmbedding(V, D, _weight=initial(), seed=0)
    handle = t.prefetch(unique_ids(rank, world, 0))
    expect_value_error(lambda: setattr(t, "compression", "bf16"), "a prefetched round is pending")
    with torch.no_grad():
        t(handle)             # the round ran, and no backward awaits it
    t.compression = "bf16"   # between steps: allowed
    return t.compression == "bf16"


def case_ranks_that_disagree_raise(rank, world):
    t = sh.ShardedEmbedding(V, D, _weight=initial(), seed=0)
    t.compression = "bf16" if rank == 0 else None
    expect_value_error(lambda: t(unique_ids(rank, world, 0)), "wire dtype")
    return True


CASES = [("rows_bf16", case_rows_and_gradients_round_once, ("bf16",)),
         ("rows_fp16", case_rows_and_gradients_round_once, ("fp16",)),
         ("bags_bf16", case_pooled_bags_within_bound, ("bf16",)),
         ("defer", case_deferred_push_rounds_alike, ()),
         ("busy", case_no_change_while_a_round_is_in_flight, ()),
         ("disagree", case_ranks_that_disagree_raise, ())]
spawned = spawned_fixture(CASES)


def test_pulled_rows_and_pushed_gradients_are_rounded_once(spawned):
    world, results = spawned
    for r in range(world):
        assert results[r]["rows_bf16"] >= 0 and results[r]["rows_fp16"] >= 0
    # Some owner saw a gradient that differs from the exact one: the push really travelled compressed.
    assert max(results[r]["rows_bf16"] for r in range(world)) > 0
    assert max(results[r]["rows_fp16"] for r in range(world)) > 0
    assert all(results[r]["bags_bf16"] and results[r]["defer"] and results[r]["busy"] for r in range(world))


def test_ranks_that_compress_differently_raise_on_every_rank(spawned):
    world, results = spawned
    assert all(results[r]["disagree"] for r in range(world))


def test_a_world_of_one_rounds_nothing():
    out = run_ranks(1, run_cases, [("rows", case_rows_and_gradients_round_once, ("bf16",)),
                                   ("bags", case_pooled_bags_within_bound, ("bf16",))])
    assert out[0]["rows"] == 0.0 and out[0]["bags"]


def test_compression_must_be_a_wire_dtype():
    t = sh.ShardedEmbedding(V, D, seed=0)
    with pytest.raises(ValueError, match="compression must be"):
        t.compression = "fp8"
    with pytest.raises(ValueError, match="compression must be"):
        sh.group_tables(nn.ModuleDict({"t": t}), compression="int8")


# ------------------------------------------------------------------ parallelize

class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.big = nn.EmbeddingBag(400, D, mode="sum", sparse=True)
        self.words = nn.Embedding(300, D, sparse=True)
        self.small = nn.Embedding(40, D, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(3 * D, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, b):
        parts = [self.big(b["bags"]), self.words(b["words"]), self.small(b["small"])]
        return self.mlp(torch.cat(parts, 1)).squeeze(1)


def batch(step: int, rank: int, world: int):
    """Rank r's share of the step's 12 samples (rank 1 of 3 gets none: an empty batch)."""
    g = torch.Generator().manual_seed(900 + step)
    whole = {"bags": (torch.rand(12, 4, generator=g) ** 3 * 400).long(),
             "words": (torch.rand(12, generator=g) ** 3 * 300).long(),
             "small": torch.randint(0, 40, (12,), generator=g), "y": torch.randn(12, generator=g)}
    if world == 1:
        return whole
    cuts = {2: [0, 5, 12], 3: [0, 6, 6, 12]}[world]
    return {k: v[cuts[rank]:cuts[rank + 1]] for k, v in whole.items()}


def loss_sum(model, b):
    # A sum over the global batch, divided by its size: empty ranks contribute nothing, as in one process.
    return ((model(b) - b["y"]) ** 2).sum() * (sparsecomm_world() / 12)


def sparsecomm_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def train(rank, world, compression, steps=3):
    model = Net()
    plan = sparsecomm.plan(model, small_table_bytes=0)
    plan.override("big", "shard", "hash")
    plan.override("words", "shard", "table", owner=world - 1)
    plan.override("small", "replicate")
    model, opt = sparsecomm.parallelize(model, torch.optim.SGD, plan=plan, trial=False, lr=0.2,
                                        sparse_compression=compression)
    inner = getattr(model, "module", model)
    for step in range(steps):
        opt.zero_grad()
        loss_sum(model, batch(step, rank, world)).backward()
        opt.step()
    return model, opt


def case_parallelize(rank, world):
    exact = {k: v.detach().clone() for k, v in full_weights(train(rank, world, None)[0]).items()}
    model, opt = train(rank, world, "bf16")
    inner = getattr(model, "module", model)
    assert inner.big.compression == "bf16" and inner.words.compression == "bf16"
    if world > 1:
        assert inner.sparsecomm_state.config.sparse_compression == "bf16"
    got = full_weights(model)
    # Across a replan (all replicated, then sharded again) the setting stays.
    opt.zero_grad()
    plan = copy.deepcopy(inner.sparsecomm_plan)
    for name in ("big", "words"):
        plan.override(name, "replicate")
    model, opt = sparsecomm.replan(model, opt, plan)
    inner = getattr(model, "module", model)
    if world > 1:
        assert inner.sparsecomm_state.config.sparse_compression == "bf16"
    plan = copy.deepcopy(plan)
    plan.override("big", "shard", "hash")
    model, opt = sparsecomm.replan(model, opt, plan)
    assert getattr(model, "module", model).big.compression == "bf16"
    return {k: v.detach().clone() for k, v in got.items()}, exact


def reference(steps=3):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(steps):
        opt.zero_grad()
        b = batch(step, 0, 1)
        (((model(b) - b["y"]) ** 2).sum() / 12).backward()
        opt.step()
    return {f"{k}": v for k, v in model.state_dict().items()}


def case_refusals(rank, world):
    expect_value_error(lambda: sparsecomm.parallelize(Net(), torch.optim.SGD, lr=0.1, sparse_compression="fp8"),
                       "sparse_compression must be")
    expect_value_error(lambda: sparsecomm.parallelize(Net(), torch.optim.SGD, lr=0.1, sparse_compression="bf16",
                                                      hook_options={"sparse_compression": "fp16"}),
                       "give it once")
    expect_value_error(lambda: sparsecomm.parallelize(Net(), torch.optim.SGD, lr=0.1, sparse_compression="bf16",
                                                      hook_options={"config": HookConfig(sparse_compression="fp16")}),
                       "give it once")
    if world > 1:
        mine = "bf16" if rank == 0 else "fp16"
        expect_value_error(lambda: sparsecomm.parallelize(Net(), torch.optim.SGD, lr=0.1, sparse_compression=mine),
                           "sparse_compression")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parallelize_with_compressed_rows_trains_close_to_one_process(world):
    out = run_ranks(world, run_cases, [("train", case_parallelize, ()), ("refuse", case_refusals, ())])
    want = reference()
    got, exact = out[0]["train"]
    worst = max(float((got[k] - v).abs().max()) for k, v in want.items())
    exact_worst = max(float((exact[k] - v).abs().max()) for k, v in want.items())
    # Three SGD steps at lr 0.2 on rows rounded to 8 significant bits: far below the weights' scale.
    assert worst < 2e-2 and exact_worst < 1e-5, (worst, exact_worst)
    if world > 1:   # and far above what the exact call's summation order alone makes
        assert worst > 10 * exact_worst + 1e-5, f"nothing was rounded: {worst} vs exact {exact_worst}"
    else:
        assert worst < 1e-5, "a world of one rounds nothing"
    assert all(out[r]["refuse"] for r in out)


def test_the_hook_gets_the_setting_unless_its_options_set_their_own():
    assert with_compression(None, "bf16") == {"sparse_compression": "bf16"}
    assert with_compression({"nonfinite": "raise"}, None) == {"nonfinite": "raise"}
    assert with_compression({"sparse_compression": "fp16"}, "bf16") == {"sparse_compression": "fp16"}
    mine = HookConfig(sparse_compression="fp16")
    assert with_compression({"config": mine}, "bf16") == {"config": mine}
    plain = HookConfig()
    assert with_compression({"config": plain}, "bf16") == {"config": plain, "sparse_compression": "bf16"}
