"""Rows compressed on the wire (sparse_allreduce(compression="bf16"/"fp16")): within the documented bound of the
exact float64 sum on every path that compresses, half the value bytes, the same on every rank; off by default.

Real multi-process runs (gloo) at world 1-3; the two-level path at world 4 (slow).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.types import SparseSyncStats
from distributed import expect_value_error, run_ranks

V, D = 300, 8
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
COMPRESSING = ("partitioned", "allgather", "tree", "runs")


def _grad(rank: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(17 + rank)
    ids = torch.randint(0, V, (120,), generator=g)      # duplicates, and rows shared between ranks
    values = torch.randn(120, D, generator=g, dtype=torch.float64) * scale
    return torch.sparse_coo_tensor(ids[None], values.float(), (V, D), check_invariants=False)


def _reference(world: int, op: str):
    """Exact sums (float64) and sums of absolute values of every rank's float32 input, per row, and the touched rows."""
    total = torch.zeros(V, D, dtype=torch.float64)
    absolute = torch.zeros(V, D, dtype=torch.float64)
    for r in range(world):
        g = _grad(r)
        rows, vals = g._indices()[0], g._values().double()
        total.index_add_(0, rows, vals)
        absolute.index_add_(0, rows, vals.abs())
    touched = torch.unique(torch.cat([_grad(r)._indices()[0] for r in range(world)]))
    if op == "avg":
        total, absolute = total / world, absolute / world
    return total, absolute, touched


def _worker(rank, world, compression):
    out = {}
    for method in COMPRESSING + ("densify",):
        for op in ("sum", "avg"):
            exact_stats, stats = sparsecomm.SparseSyncStats(), sparsecomm.SparseSyncStats()
            exact = sparsecomm.sparse_allreduce(_grad(rank), op=op, method=method, stats=exact_stats)
            got = sparsecomm.sparse_allreduce(_grad(rank), op=op, method=method, compression=compression,
                                              stats=stats)
            out[method, op] = (got.indices(), got.values(), got.dtype, exact.indices(), exact.values(),
                               stats.bytes_sent, exact_stats.bytes_sent)
    return out


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_sums_are_within_the_bound_and_halve_the_value_bytes(world, compression):
    results = run_ranks(world, _worker, compression)
    u = UNIT_ROUNDOFF[compression]
    for op in ("sum", "avg"):
        total, absolute, touched = _reference(world, op)
        for method in COMPRESSING:
            ids0, values0 = results[0][method, op][:2]
            for rank in range(world):
                ids, values, dtype, exact_ids, exact_values, sent, exact_sent = results[rank][method, op]
                assert dtype == torch.float32                  # the input's dtype, whatever travelled
                assert torch.equal(ids[0], touched) and torch.equal(exact_ids[0], touched)
                assert torch.equal(ids, ids0) and torch.equal(values, values0), "ranks must agree bitwise"
                err = (values.double() - total[touched]).abs()
                bound = 2 * u * absolute[touched] + 1e-6 * absolute[touched] + 1e-30
                assert bool((err <= bound).all()), (method, op, float((err - bound).max()))
                if world > 1:
                    # Value rows at half the bytes; ids and metadata unchanged.
                    assert sent < exact_sent, (method, sent, exact_sent)
        for rank in range(world):  # densify keeps the backend's sums: compression does not apply
            ids, values, _, exact_ids, exact_values, sent, exact_sent = results[rank]["densify", op]
            assert torch.equal(values, exact_values) and sent == exact_sent


def _mismatch_worker(rank, world):
    return expect_value_error(lambda: sparsecomm.sparse_allreduce(_grad(rank), compression="bf16" if rank == 0
                                                                  else None), "ranks disagree")


def test_ranks_that_disagree_on_the_wire_dtype_raise_on_every_rank():
    results = run_ranks(2, _mismatch_worker)
    for r in range(2):
        assert "ranks disagree on the tensor" in results[r] and "on the wire: torch.bfloat16" in results[r]


def test_an_unknown_compression_is_refused_before_anything_moves():
    with pytest.raises(ValueError, match="compression must be 'bf16', 'fp16' or None"):
        sparsecomm.sparse_allreduce(_grad(0), compression="int8")


def _two_level_worker(rank, world):
    got = sparsecomm.sparse_allreduce(_grad(rank), local_world_size=2, compression="bf16")
    return got.indices(), got.values()


@pytest.mark.slow
def test_two_level_path_compresses_within_a_bound_per_level():
    results = run_ranks(4, _two_level_worker)
    total, absolute, touched = _reference(4, "sum")
    for rank in range(4):
        ids, values = results[rank]
        assert torch.equal(ids[0], touched)
        err = (values.double() - total[touched]).abs()
        assert bool((err <= 4 * UNIT_ROUNDOFF["bf16"] * absolute[touched] + 1e-6).all())


def _per_tensor_worker(rank, world):
    tensors = [_grad(rank), _grad(rank, scale=3.0)]
    exact = [SparseSyncStats() for _ in tensors]
    mixed = [SparseSyncStats() for _ in tensors]
    ref = sparsecomm.sparse_allreduce_coalesced(tensors, method="allgather", stats=exact)
    got = sparsecomm.sparse_allreduce_coalesced(tensors, method="allgather", compression=["bf16", None], stats=mixed)
    # The second tensor travelled exact: bitwise the exact call's; the first in bf16: fewer bytes, not exact.
    assert torch.equal(got[1].values(), ref[1].values()) and mixed[1].bytes_sent == exact[1].bytes_sent
    assert mixed[0].bytes_sent < exact[0].bytes_sent and not torch.equal(got[0].values(), ref[0].values())
    return expect_value_error(lambda: sparsecomm.sparse_allreduce_coalesced(tensors, compression=["bf16"]),
                              "one of those per tensor")


def test_compression_per_tensor_keeps_the_others_exact():
    for message in run_ranks(2, _per_tensor_worker).values():
        assert "one of those per tensor" in message


class _BagNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode="sum", sparse=True)
        self.lin = nn.Linear(D, 1)

    def forward(self, ids):
        return self.lin(self.bag(ids)).squeeze(1)


def _hook_dense_worker(rank, world, ddp_kwargs):
    torch.manual_seed(0)
    base = _BagNet()
    ours, plain = DDP(copy.deepcopy(base), **ddp_kwargs), DDP(copy.deepcopy(base), **ddp_kwargs)
    state = sparsecomm.register(ours, sparse_compression="bf16")
    for step in range(3):   # no optimizer: the weights stay equal; static_graph's first, rebuilt and later steps
        g = torch.Generator().manual_seed(10 * step + rank)
        ids, y = torch.randint(0, V, (16, 4), generator=g), torch.randn(16, generator=g)
        for model in (ours, plain):
            model.zero_grad(set_to_none=True)
            ((model(ids) - y) ** 2).mean().backward()
        # The dense bucket rode in the compressed sparse exchange, yet its gradient is plain DDP's to roundoff.
        for name in ("lin.weight", "lin.bias"):
            a, b = ours.module.get_parameter(name).grad, plain.module.get_parameter(name).grad
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (step, name, float((a - b).abs().max()))
    assert "dense-fused" in state.stats
    return True


@pytest.mark.parametrize("ddp_kwargs", [{}, {"static_graph": True}])
def test_hook_keeps_fused_dense_buckets_exact_under_sparse_compression(ddp_kwargs):
    assert all(run_ranks(2, _hook_dense_worker, ddp_kwargs).values())
