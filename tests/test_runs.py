"""The runs path (ids as they are, each run of equal rows sent once) against a float64 sum and the allgather path.

Inputs are shaped like a sum-pooled EmbeddingBag's gradient (one row per bag,
repeated for each of its ids), plus inputs without runs, empty ranks, -0.0/0.0
and NaN rows; and peers that lie about their runs.
"""

import copy
import hashlib

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.collectives import sync_plan
from sparsecomm.collectives.methods import InputRuns, by_name
from sparsecomm.collectives.methods.runs import LENGTH_BYTES
from sparsecomm.collectives.probe import LinkProbe
from sparsecomm.hooks.classifier import bottleneck_bytes, choose_method, method_costs
from sparsecomm.types import SparseSyncStats, SyncMethod

from distributed import run_ranks
from reference import hook_against_single

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def bags_input(rank, rows, dim, dtype, bags=12, size=4, seed=0, empty_rank=None):
    """A sum-pooled bag's gradient: ``bags`` rows, each repeated for its ``size`` ids (ids uncoalesced)."""
    if rank == empty_rank:
        bags = 0
    g = torch.Generator().manual_seed(1000 * seed + rank)
    ids = torch.randint(0, rows, (bags * size,), generator=g)
    rows_ = torch.randn((bags, *dim), generator=g, dtype=torch.float64).to(dtype)
    values = rows_.repeat_interleave(size, dim=0)
    return torch.sparse_coo_tensor(ids[None], values, (rows, *dim), check_invariants=False)


def _reference(inputs, absolute=False):
    ids = torch.cat([t._indices()[0] for t in inputs])
    vals = torch.cat([t._values().double() for t in inputs])
    vals = vals.abs() if absolute else vals
    uniq, inv = torch.unique(ids, return_inverse=True)
    return uniq, torch.zeros((len(uniq), *vals.shape[1:]), dtype=torch.float64).index_add_(0, inv, vals)


CASES = [  # (rows, dim, dtype, bags, size, empty_rank)
    (100, (8,), torch.float32, 12, 4, None),
    (50_000, (3,), torch.float64, 20, 8, None),    # int32 ids on the wire
    (200, (8,), torch.bfloat16, 10, 3, None),
    (200, (5,), torch.float16, 10, 3, None),       # 10-byte rows
    (60, (4,), torch.float32, 12, 4, 1),           # one rank sends nothing
    (40, (2, 3), torch.float32, 6, 2, None),       # trailing dims
    (30, (4,), torch.float32, 25, 1, None),        # no runs at all (an Embedding's gradient)
]


def _digest(t):
    return hashlib.sha256(t.values().double().numpy().tobytes() + t.indices().numpy().tobytes()).hexdigest()


def _runs_worker(rank, world):
    digests = []
    for i, (rows, dim, dtype, bags, size, empty) in enumerate(CASES):
        make = [bags_input(r, rows, dim, dtype, bags, size, seed=i, empty_rank=empty) for r in range(world)]
        stats = SparseSyncStats()
        out = sparsecomm.sparse_allreduce(make[rank], method="runs", stats=stats)
        ref_ids, ref_vals = _reference(make)
        assert out.is_coalesced() and out.dtype == dtype and tuple(out.shape) == (rows, *dim)
        assert torch.equal(out.indices()[0], ref_ids)
        err = (out.values().double() - ref_vals).abs()
        assert bool((err <= TOL[dtype] * world * (1 + ref_vals.abs())).all()), (i, float(err.max()))
        # What was sent: the input's ids and one row per run, counted on every rank.
        mine = 0 if rank == empty else bags
        assert stats.method == "runs" and stats.runs_local == mine and stats.rows_in == mine * size
        assert stats.runs_local_sum == sum(0 if r == empty else bags for r in range(world))
        assert stats.rows_local == make[rank].coalesce().indices().shape[1]
        if dtype in (torch.float32, torch.float64):
            ag = sparsecomm.sparse_allreduce(make[rank], method="allgather")
            assert torch.equal(ag.indices(), out.indices())
            assert torch.allclose(ag.values(), out.values(), rtol=1e-5, atol=1e-6)
        # Compressed on the wire: within the documented 2 u sum |x| of the exact sum.
        half = sparsecomm.sparse_allreduce(make[rank], method="runs", compression="bf16")
        bound = 2 * 2.0 ** -8 * _reference(make, absolute=True)[1] + TOL[dtype] * world
        assert torch.equal(half.indices()[0], ref_ids)
        assert bool(((half.values().double() - ref_vals).abs() <= bound).all()), i
        digests.append(_digest(out))
    # Fused with the other paths in one call, averaged.
    tensors = [bags_input(rank, rows, dim, dtype, b, s, seed=i, empty_rank=e)
               for i, (rows, dim, dtype, b, s, e) in enumerate(CASES[:4])]
    outs = sparsecomm.sparse_allreduce_coalesced(tensors, op="avg",
                                                 method=["runs", "partitioned", "allgather", "runs"])
    for i, o in enumerate(outs):
        rows, dim, dtype, b, s, e = CASES[i]
        ref_ids, ref_vals = _reference([bags_input(r, rows, dim, dtype, b, s, seed=i, empty_rank=e)
                                        for r in range(world)])
        assert torch.equal(o.indices()[0], ref_ids)
        assert torch.allclose(o.values().double(), ref_vals / world, rtol=TOL[dtype] * world, atol=TOL[dtype])
    return digests


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                   3])
def test_runs_match_float64_sum_and_allgather(world):
    results = run_ranks(world, _runs_worker)
    assert all(results[r] == results[0] for r in range(world))  # bitwise the same on every rank


def test_runs_are_bitwise():
    # -0.0 and 0.0, and NaNs with different payloads, are different rows: expanding gives back the input bytes.
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    v = torch.tensor([[0.0, 1.0], [-0.0, 1.0], [-0.0, 1.0], [float("nan"), 2.0], [float("nan"), 2.0],
                      [nan2.item(), 2.0], [3.0, 4.0]])
    rows, lengths = sync_plan._runs(v)
    assert lengths.tolist() == [1, 2, 2, 1, 1] and lengths.dtype == torch.int32
    back = rows.repeat_interleave(lengths.long(), dim=0)
    assert torch.equal(back.view(torch.int32), v.view(torch.int32))
    assert sync_plan._first_value_runs(v) <= 5  # the cheap count never exceeds the runs
    assert sync_plan._runs(v[:0])[1].numel() == 0 and sync_plan._runs(v[:1])[1].tolist() == [1]
    assert sync_plan._runs(torch.zeros(5, 3, dtype=torch.float16))[1].tolist() == [5]  # 6-byte rows


def _error_of(t):
    """The ValueError a runs sync of ``t`` raises here, or "no error"."""
    try:
        sparsecomm.sparse_allreduce(t, method="runs")
    except ValueError as e:
        return str(e)
    return "no error"


def _nonfinite_worker(rank, world):
    t = bags_input(rank, 50, (4,), torch.float32, seed=3)
    if rank == 1:
        t = torch.sparse_coo_tensor(t._indices(), t._values().index_fill(0, torch.tensor([2]), float("inf")), t.shape)
    out = sparsecomm.sparse_allreduce(t, method="runs", nonfinite="propagate")
    assert bool(torch.isinf(out.values()).any())
    return _error_of(t)


def test_nonfinite_rows_raise_on_every_rank_or_propagate():
    for rank, message in run_ranks(3, _nonfinite_worker).items():
        assert "non-finite" in message or "NaN" in message, (rank, message)


def _lying_worker(rank, world, attack):
    """Rank 1 sends runs or ids that its metadata does not allow; every rank raises ValueError."""
    from sparsecomm.collectives.methods import runs as runs_mod

    t = bags_input(rank, 100, (4,), torch.float32, seed=5)
    if rank == 1 and attack in ("long-run", "empty-run"):
        real = sync_plan._runs

        def lying_runs(values):
            rows, lengths = real(values)
            lengths = lengths.clone()
            lengths[0] += 1  # covers one id more than it sent
            if attack == "empty-run":
                lengths[1] = 0
            return rows, lengths

        sync_plan._runs = lying_runs
    if rank == 1 and attack == "bad-ids":
        real_push = runs_mod.PATH.push

        def lying_push(rows, peers, plan):
            rows.ids = rows.ids + 1000
            return real_push(rows, peers, plan)

        object.__setattr__(by_name("runs"), "push", lying_push)
    return _error_of(t)


@pytest.mark.parametrize("attack,match", [("long-run", "run lengths"), ("empty-run", "run lengths"),
                                          ("bad-ids", "row ids outside")])
def test_a_lying_peer_makes_every_rank_raise(attack, match):
    for rank, message in run_ranks(3, _lying_worker, attack, timeout_s=30).items():
        assert match in message, (rank, message)


def _bad_ids_worker(rank, world):
    t = bags_input(rank, 10, (2,), torch.float32, seed=1)
    if rank == 0:  # id 12 of a 10-row table
        t = torch.sparse_coo_tensor(torch.tensor([[3, 12]]), torch.ones(2, 2), (10, 2), check_invariants=False)
    return _error_of(t)


def test_ids_out_of_range_raise_on_every_rank():
    for rank, message in run_ranks(2, _bad_ids_worker).items():
        assert "range" in message or "outside" in message, (rank, message)


# ------------------------------------------------------------------ pricing

def test_runs_priced_from_the_inputs_runs_and_chosen_on_a_slow_link():
    # Benchmark-like table: 4096 ids in 512 bags, 1500 distinct, rows of 32 float32, 2 hosts at 1 Gbit/s.
    shape = (2, 500_000, 32, 4, 4, 1500, 2900)
    runs = InputRuns(4096, 512)
    ag = bottleneck_bytes(SyncMethod.ALLGATHER, *shape)
    rb = bottleneck_bytes(SyncMethod.RUNS, *shape, runs=runs)
    assert rb == 1 * (4096 * 4 + 512 * (32 * 4 + LENGTH_BYTES)) and ag == 1500 * (32 * 4 + 4)
    link = LinkProbe(latency_s=1e-4, bytes_per_s=125e6)
    assert choose_method(*shape, link=link, fitted=False, runs=runs).method is SyncMethod.RUNS
    # Unknown runs: not offered; no runs in the input (an Embedding's gradient): not chosen.
    assert SyncMethod.RUNS not in method_costs(*shape, list(SyncMethod), link=link)
    assert choose_method(*shape, link=link, fitted=False).method is not SyncMethod.RUNS
    assert choose_method(*shape, link=link, fitted=False, runs=InputRuns(1500, 1500)).method is not SyncMethod.RUNS


def test_runs_merge_priced_at_the_measured_rate():
    # It merges (N+1) n rows where the allgather merges N k: on a fast link that decides, on a slow one bytes do.
    shape, runs = (2, 500_000, 32, 4, 4, 1500, 2900), InputRuns(4096, 512)
    merge = 0.2e-9   # s per value byte, as measured on this machine's CPU
    fast = LinkProbe(latency_s=3e-4, bytes_per_s=1.2e9, merge_s_per_byte=merge)
    slow = LinkProbe(latency_s=3e-4, bytes_per_s=75e6, merge_s_per_byte=merge)
    costs = method_costs(*shape, list(SyncMethod), link=fast, runs=runs)
    free = method_costs(*shape, list(SyncMethod), link=LinkProbe(3e-4, 1.2e9), runs=runs)
    assert costs[SyncMethod.RUNS] - free[SyncMethod.RUNS] == pytest.approx(3 * 4096 * 128 * merge)
    assert costs[SyncMethod.ALLGATHER] - free[SyncMethod.ALLGATHER] == pytest.approx(2 * 1500 * 128 * merge)
    assert choose_method(*shape, link=fast, fitted=False, runs=runs).method is SyncMethod.ALLGATHER
    assert choose_method(*shape, link=slow, fitted=False, runs=runs).method is SyncMethod.RUNS


# ------------------------------------------------------------------ in the hook

class _Bags(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(80, 4, mode="sum", sparse=True)
        self.lin = nn.Linear(4, 1)

    def forward(self, ids):
        return self.lin(self.bag(ids)).squeeze(1)


def _bag_data(r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randint(0, 80, (6, 5), generator=g), torch.randn(6, generator=g)


def _hook_worker(rank, world):
    torch.manual_seed(0)
    return hook_against_single(_Bags(), {"bag.weight": "runs"}, _bag_data, rank, world, lr=0.1)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_hook_override_runs_trains_like_single_process(world):
    for diff, paths in run_ranks(world, _hook_worker).values():
        assert diff < 1e-5 and "runs" in paths


def _nodes_worker(rank, world):
    # Two ranks per node: partitioned tensors go two-level, the runs tensor stays flat, in one call.
    cases = CASES[:2]
    tensors = [bags_input(rank, rows, dim, dtype, b, s, seed=i) for i, (rows, dim, dtype, b, s, _) in enumerate(cases)]
    outs = sparsecomm.sparse_allreduce_coalesced(tensors, method=["runs", "partitioned"], local_world_size=2)
    for i, o in enumerate(outs):
        rows, dim, dtype, b, s, _ = cases[i]
        ref_ids, ref_vals = _reference([bags_input(r, rows, dim, dtype, b, s, seed=i) for r in range(world)])
        assert torch.equal(o.indices()[0], ref_ids)
        assert torch.allclose(o.values().double(), ref_vals, rtol=TOL[dtype] * world, atol=TOL[dtype])
    return _digest(outs[0])


@pytest.mark.slow
def test_runs_beside_two_level_tensors():
    results = run_ranks(4, _nodes_worker)
    assert all(results[r] == results[0] for r in results)


def _empty_step_worker(rank, world):
    # Rank 1 looks up nothing in odd steps: its gradient has no ids and no runs; sum losses, as DDP averages.
    torch.manual_seed(0)
    base = _Bags()
    single, ours = copy.deepcopy(base), DDP(copy.deepcopy(base))
    sparsecomm.register(ours, overrides={"bag.weight": "runs"})
    opts = [torch.optim.SGD(ours.parameters(), lr=0.05), torch.optim.SGD(single.parameters(), lr=0.05)]

    def data(r, step):
        x, y = _bag_data(r, step)
        return (x[:0], y[:0]) if r == 1 and step % 2 else (x, y)

    for step in range(4):
        whole = tuple(torch.cat(z) for z in zip(*[data(r, step) for r in range(world)]))
        for model, opt, (x, y), scale in ((ours, opts[0], data(rank, step), 1.0), (single, opts[1], whole, 1 / world)):
            opt.zero_grad()
            (((model(x) - y) ** 2).sum() * scale).backward()
            opt.step()
    return max(float((a - b).abs().max()) for a, b in zip(ours.module.parameters(), single.parameters()))


def test_hook_runs_with_a_rank_that_looks_up_nothing():
    for diff in run_ranks(2, _empty_step_worker).values():
        assert diff < 1e-5


def test_edge_inputs_of_run_finding_and_pricing():
    # Zero-width rows are one run; an offset view whose bytes do not align to wide words still works.
    assert sync_plan._runs(torch.zeros(4, 0))[1].tolist() == [4]
    base = torch.arange(13, dtype=torch.float16)
    view = base[1:].view(6, 2)     # storage offset 2 bytes: no int32/int64 view of it
    view[1] = view[0]
    rows, lengths = sync_plan._runs(view)
    assert lengths.tolist() == [2, 1, 1, 1, 1] and torch.equal(rows.repeat_interleave(lengths.long(), 0), view)
    # Only the runs path without counts: refused with a reason, not an empty min().
    with pytest.raises(ValueError, match="can be priced"):
        choose_method(2, 1000, 4, 4, 4, 10, 20, allowed=[SyncMethod.RUNS], fitted=False,
                      link=LinkProbe(1e-4, 1e8))
