"""sparse_allreduce, the DDP hook and sharded tables on CUDA tensors: gloo at world 2, NCCL at world 1.

Each result is compared with the same computation on CPU tensors (float64
reference for the collective, single-process training for the hook).
Skipped without a CUDA device or without CuPy.
"""

from __future__ import annotations

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cupy", reason="needs CuPy (pip install sparsecomm[gpu])")

import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import sparsecomm  # noqa: E402
from sparsecomm.synthetic import zipf_ids  # noqa: E402

from distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.gpu
V, D = 1000, 16


def _grad(rank, device, dtype=torch.float32):
    ids = zipf_ids(200, V, 1.1, seed=rank)
    vals = torch.randn(200, D, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    return torch.sparse_coo_tensor(ids[None], vals.to(dtype), (V, D)).to(device)


def _collective_worker(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    ref = sum(_grad(r, "cpu", torch.float64).to_dense() for r in range(world))
    out = {}
    for method in ("partitioned", "allgather", "densify", "runs"):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            res = sparsecomm.sparse_allreduce(_grad(rank, dev, dtype), method=method)
            assert res.device == dev and res.dtype == dtype
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            assert torch.allclose(res.to_dense().double().cpu(), ref, atol=tol * world, rtol=tol), (method, dtype)
            out[(method, str(dtype))] = True
    # async: the worker thread runs on the caller's stream
    fut = sparsecomm.sparse_allreduce(_grad(rank, dev), async_op=True)
    assert torch.allclose(fut.wait().to_dense().double().cpu(), ref, atol=1e-4)
    return len(out)


@pytest.mark.parametrize("world,backend", [(2, "gloo"), (1, "nccl")])
def test_sparse_allreduce_on_cuda_tensors(world, backend):
    assert all(v == 12 for v in run_ranks(world, _collective_worker, backend=backend).values())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(V, D, mode="sum", sparse=True)
        self.mlp = nn.Linear(D, 1)

    def forward(self, x):
        return self.mlp(self.emb(x)).squeeze(1)


def _hook_worker(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    base = Net()
    ours = DDP(copy.deepcopy(base).to(dev), device_ids=[dev.index])
    single = copy.deepcopy(base).to(dev)
    sparsecomm.register(ours)
    o1, o2 = torch.optim.SGD(ours.parameters(), lr=0.01), torch.optim.SGD(single.parameters(), lr=0.01)
    for step in range(5):
        xs = [zipf_ids(8 * 4, V, 1.1, seed=step * 10 + r).view(8, 4).to(dev) for r in range(world)]
        o1.zero_grad(set_to_none=True)
        (ours(xs[rank]) ** 2).mean().backward()
        o1.step()
        o2.zero_grad(set_to_none=True)
        (sum((single(x) ** 2).mean() for x in xs) / world).backward()
        o2.step()
    return max(float((a - b).abs().max()) for a, b in zip(ours.module.parameters(), single.parameters()))


@pytest.mark.parametrize("world,backend", [(2, "gloo"), (1, "nccl")])
def test_ddp_hook_with_a_cuda_model(world, backend):
    for diff in run_ranks(world, _hook_worker, backend=backend).values():
        assert diff < 1e-5


def _sharded_worker(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    # The same table (same seed) on the GPU and on the CPU; padding exercises the id-to-slot path.
    gpu = sparsecomm.ShardedEmbeddingBag(V, D, mode="sum", padding_idx=3, seed=7, device=dev)
    cpu = sparsecomm.ShardedEmbeddingBag(V, D, mode="sum", padding_idx=3, seed=7)
    opts = [sparsecomm.ShardedSGD(gpu, lr=0.1), sparsecomm.ShardedSGD(cpu, lr=0.1)]
    worst = 0.0
    for step in range(3):
        ids = zipf_ids(64, V, 1.1, seed=step * 10 + rank).view(16, 4)
        outs = []
        for table, opt, x in zip((gpu, cpu), opts, (ids.to(dev), ids)):
            out = table(x)
            (out ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out.detach().cpu())
        assert outs[0].device.type == "cpu"
        worst = max(worst, float((outs[0] - outs[1]).abs().max()))
    return worst


@pytest.mark.parametrize("world,backend", [(2, "gloo"), (1, "nccl")])
def test_sharded_embedding_bag_on_cuda(world, backend):
    for diff in run_ranks(world, _sharded_worker, backend=backend).values():
        assert diff < 1e-5
