"""The tree path (recursive doubling with merges) against a float64 sum, the other paths, and lying peers.

Ranks are spawned once per world size; each runs every case and reports back.
"""

import hashlib

import pytest
import torch
import torch.nn as nn

import sparsecomm
from sparsecomm.collectives import sync_wire
from sparsecomm.collectives.methods.tree import tree_bytes, tree_schedule
from sparsecomm.cost_model import allgather_bytes
from sparsecomm.types import SparseSyncStats

from distributed import run_ranks
from reference import hook_against_single
from test_sparse_allreduce import _check_result, make_input

CASES = []
for i, (kind, dtype, dim, rows) in enumerate([
    ("uniform", torch.float32, (8,), 100),
    ("zipf", torch.float64, (3,), 50_000),           # int32 ids on the wire
    ("uniform", torch.bfloat16, (8,), 200),
    ("uniform", torch.float16, (5,), 200),
    ("empty_rank", torch.float32, (4,), 60),
    ("all_empty", torch.float32, (4,), 60),
    ("uniform", torch.float16, (3,), 300),           # 6-byte rows: ids must stay aligned
    ("same_row", torch.float32, (2,), 10),
    ("uniform", torch.float32, (2, 3), 40),          # trailing dims
    ("uniform", torch.float32, (4,), 2**33),         # int64 ids on the wire, table never allocated
]):
    for op in ("sum", "avg"):
        CASES.append(dict(kind=kind, dtype=dtype, dim=dim, rows=rows, seed=100 + i, op=op, scheme="hash",
                          method="tree"))


def _two_sparse_dims(rank):
    g = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randint(0, 5, (30,), generator=g), torch.randint(0, 7, (30,), generator=g)])
    return torch.sparse_coo_tensor(idx, torch.randn(30, 2, generator=g, dtype=torch.float64), (5, 7, 2))


def _digest(t):
    return hashlib.sha256(t.values().double().numpy().tobytes() + t.indices().numpy().tobytes()).hexdigest()


def _tree_worker(rank, world, lws):
    digests = []
    for case in CASES:
        t = make_input(case, rank, world)
        stats = SparseSyncStats()
        out = sparsecomm.sparse_allreduce(t, op=case["op"], method="tree", local_world_size=lws, stats=stats)
        _check_result(case, out, world)
        assert stats.method == "tree" and stats.rows_out == out.indices().shape[1]
        if case["dtype"] in (torch.float32, torch.float64) and case["rows"] < 2**20:
            # Same rows as the partitioned path, sums equal up to summation order.
            ref = sparsecomm.sparse_allreduce(t, op=case["op"], method="partitioned")
            assert torch.equal(ref.indices(), out.indices())
            assert torch.allclose(ref.values(), out.values(), rtol=1e-5, atol=1e-6)
        digests.append(_digest(out))
    # Several sparse dims, against a dense float64 sum.
    mine = _two_sparse_dims(rank)
    out = sparsecomm.sparse_allreduce(mine, method="tree", local_world_size=lws)
    dense = sum(_two_sparse_dims(r).to_dense() for r in range(world))
    assert out.is_coalesced() and torch.allclose(out.to_dense(), dense)
    digests.append(_digest(out))
    # Fused with other methods in one call, and asynchronously.
    tensors = [make_input(c, rank, world) for c in CASES[:6]]
    methods = ["tree", "partitioned", "tree", "allgather", "tree", "densify"]
    outs = sparsecomm.sparse_allreduce_coalesced(tensors, op="avg", method=methods, local_world_size=lws)
    for c, o in zip(CASES[:6], outs):
        _check_result(dict(c, op="avg"), o, world)
    fut = sparsecomm.sparse_allreduce(make_input(CASES[0], rank, world), method="tree", async_op=True)
    _check_result(dict(CASES[0], op="sum"), fut.wait(), world)
    return digests


# World 3 (a folded rank and a doubling) runs by default; the others are slow-marked to keep the suite short.
@pytest.mark.parametrize("world,lws", [pytest.param(1, 1, marks=pytest.mark.slow),
                                       pytest.param(2, 1, marks=pytest.mark.slow), (3, 1),
                                       pytest.param(4, 2, marks=pytest.mark.slow),
                                       pytest.param(5, 1, marks=pytest.mark.slow)])
def test_tree_matches_float64_sum_and_other_paths(world, lws):
    results = run_ranks(world, _tree_worker, lws)
    # Bitwise the same result on every rank.
    assert all(results[r] == results[0] for r in range(world))


def _bytes_worker(rank, world):
    # Disjoint rows: the tree sends each rank's k rows once per rank reached, as an allgather does.
    k, dim = 50, 4
    ids = torch.arange(k) + k * rank
    t = torch.sparse_coo_tensor(ids[None], torch.ones(k, dim), (k * world, dim))
    stats = SparseSyncStats()
    sparsecomm.sparse_allreduce(t, method="tree", stats=stats)
    row = stats.row_bytes + stats.index_bytes
    return stats.bytes_sent, row, stats.num_rows


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tree_bytes_match_the_formula(world):
    results = run_ranks(world, _bytes_worker)
    p, _ = tree_schedule(world)
    for rank, (sent, row, num_rows) in results.items():
        k = num_rows // world
        # Metadata (21 + N int64 per peer), per-stage counts and the verdict round ride on top of the rows.
        overhead = 8 * (sync_wire.RECORD_FIXED + world) * (world - 1) + 8 * (world - 1) + 8 * 4
        if rank < p and world == p:
            payload = tree_bytes(world, k, num_rows, row)
            assert payload == allgather_bytes(world, k, row)
            assert payload <= sent <= payload + overhead, (rank, sent, payload)


def _lying_worker(rank, world, attack):
    """Rank 1 lies to its partners; every rank must raise ValueError, nothing crashes or hangs."""
    import sparsecomm.collectives.methods.tree as tree_mod

    t = torch.sparse_coo_tensor(torch.arange(12)[None] * (rank + 1), torch.ones(12, 4), (100, 4))
    if rank == 1 and attack == "huge-count":
        tree_mod._Link._count = lambda self, ids, err: 10**9
    if rank == 1 and attack == "bad-ids":
        real = tree_mod._Link._pack

        def lying_pack(self, ids, values):
            return real(self, ids + 1000, values)

        tree_mod._Link._pack = lying_pack
    try:
        sparsecomm.sparse_allreduce(t, method="tree")
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow  # one spawn of 3 ranks each; the default suite keeps only the world-3 equivalence test
@pytest.mark.parametrize("attack,match", [("huge-count", "impossible row count"), ("bad-ids", "row ids outside")])
def test_a_lying_partner_makes_every_rank_raise(attack, match):
    # World 3: rank 2 folds into rank 0, ranks 0 and 1 double; rank 1 lies to rank 0.
    results = run_ranks(3, _lying_worker, attack, timeout_s=20)
    for rank, message in results.items():
        assert match in message, (rank, message)


def test_schedule_any_world_size_and_node_bits_first():
    assert tree_schedule(1) == (1, [])
    assert tree_schedule(5) == (4, [1, 2])
    assert tree_schedule(8) == (8, [1, 2, 4])
    assert tree_schedule(8, node_size=2) == (8, [2, 4, 1])  # stages between nodes first
    assert tree_schedule(6, node_size=3) == (4, [1, 2])     # node size not a power of two: plain order


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 4, sparse=True)
        self.lin = nn.Linear(4, 1)

    def forward(self, ids):
        return self.lin(self.emb(ids)).squeeze(1)


def _tree_data(r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randint(0, 50, (6,), generator=g), torch.randn(6, generator=g)


def _hook_worker(rank, world):
    torch.manual_seed(0)
    return hook_against_single(_Net(), {"emb.weight": "tree"}, _tree_data, rank, world, lr=0.2)


@pytest.mark.slow
def test_hook_override_tree_trains_like_single_process():
    results = run_ranks(2, _hook_worker)
    for diff, paths in results.values():
        assert diff < 1e-5 and "tree" in paths
