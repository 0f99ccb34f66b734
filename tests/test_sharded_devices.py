"""Sharded tables keep every tensor on an explicit device: the same checks on the CPU and on a GPU.

Each test runs on ``cpu`` and, where a CUDA device and CuPy are present, on
``cuda`` (marked ``gpu``; skipped cleanly otherwise). The CUDA cases catch
what a CPU run cannot: a CPU tensor combined with a device tensor (the
layout's map with host ids, the padding id in a lookup, checkpoint ids with
device slots). Single process: no process group needed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn

import sparsecomm.sharded as sh
from sparsecomm import ops

_CUDA_OK = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _CUDA_OK, reason="needs a CUDA device and CuPy (pip install sparsecomm[gpu])")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_rows,world", [(70, 3), (3000, 30), (65, 2)])  # bitmap, sorted id list, bitmap
@pytest.mark.parametrize("scheme", ["hash", "range"])
def test_layout_answers_on_the_ids_device(device, num_rows, world, scheme):
    ids = torch.arange(-2, num_rows + 2)
    inside = ids.clamp(0, num_rows - 1)
    owners = ops.row_owners(inside, world, scheme, num_rows)
    for rank in range(world):
        layout = sh.RowLayout(num_rows, world, rank, scheme, torch.device(device))
        owned = layout.owned_ids()
        assert owned.device.type == device
        for where in ("cpu", device):  # host ids against a device map, and device ids
            got = layout.owns(ids.to(where))
            assert got.device.type == where
            expected = (owners == rank) & (ids >= 0) & (ids < num_rows)
            assert torch.equal(got.cpu(), expected)
            slots = layout.slots(owned.to(where))
            assert slots.device.type == where
            assert torch.equal(slots.cpu(), torch.arange(layout.num_local))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["hash", "range"])
def test_padding_row_on_the_tables_device(device, scheme):
    emb = sh.ShardedEmbedding(50, 3, padding_idx=7, scheme=scheme, device=device, seed=0)
    assert float(emb.full_weight()[7].abs().max()) == 0.0  # zeroed at construction
    ref = nn.Embedding(50, 3, padding_idx=7, _weight=emb.full_weight().cpu().clone())
    ids = torch.tensor([[7, 1, 7], [49, 0, 7]])
    out = emb(ids.to(device))
    assert out.device.type == device
    assert torch.equal(out.cpu(), ref(ids))
    out.sum().backward()
    grad = emb.local_weight.grad.coalesce()
    assert 7 not in grad.indices()[0].tolist()  # the padding row gets no gradient


@pytest.mark.parametrize("device", DEVICES)
def test_input_on_another_device_is_refused(device):
    emb = sh.ShardedEmbedding(20, 2, device=device)
    with pytest.raises(ValueError, match="input is on meta"):
        emb(torch.tensor([1, 2], device="meta"))


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_round_trip_on_the_tables_device(device, tmp_path):
    def model():
        m = nn.Module()
        m.emb = sh.ShardedEmbedding(40, 3, scheme="hash", dtype=torch.float64, device=device, seed=1)
        return m

    src = model()
    opt = sh.ShardedAdam(src, lr=0.1)
    src.emb(torch.tensor([1, 5, 5, 39], device=device)).sum().backward()
    opt.step()
    sh.save(str(tmp_path / "ck"), src, opt)
    # Into the same device, and into the CPU (ids, slots and staging rows all explicit).
    for target in (device, "cpu"):
        dst = nn.Module()
        dst.emb = sh.ShardedEmbedding(40, 3, scheme="range", dtype=torch.float64, device=target, seed=2)
        dst_opt = sh.ShardedAdam(dst, lr=0.1)
        sh.load(str(tmp_path / "ck"), dst, dst_opt)
        assert dst.emb.local_weight.device.type == target
        assert torch.equal(dst.emb.full_weight().cpu(), src.emb.full_weight().cpu())
        state = dst_opt.state[dst.emb.local_weight]
        assert state["step"] == 1 and state["exp_avg"].device.type == target


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True])
def test_hot_rows_on_the_tables_device(device, fused):
    """A table replicating its hot rows keeps the replica on its device and trains like the plain table."""
    config = sh.HotRowConfig(budget_bytes=10 * (3 * 8 + 8 + 16), window=2, min_count=1)
    tables = [sh.ShardedEmbeddingBag(40, 3, mode="sum", dtype=torch.float64, device=device, seed=1, padding_idx=0,
                                     hot_rows=hot) for hot in (config, None)]
    opts = [sh.ShardedAdagrad(t, lr=0.1, rowwise=True, fused=fused) for t in tables]
    for step in range(6):
        ids = torch.tensor([1, 5, 5, 39, 0, 7, 5, step], device=device)
        offsets = torch.tensor([0, 3, 3, 6], device=device)
        for t, o in zip(tables, opts):
            t(ids, offsets).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    hot = tables[0].hot
    assert hot.size > 0 and 0 not in hot.ids.tolist()
    assert {x.device.type for x in (hot.ids, hot.weight, hot.owned_slots, *hot.state.values())} == {device}
    assert torch.allclose(tables[0].full_weight(), tables[1].full_weight(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("defer", [False, True])
def test_pooled_fused_deferred_rowwise_on_the_tables_device(device, defer):
    """Owner pooling with a fused row-wise Adagrad (the update deferred or not) trains like the same rule in
    step(), on the table's device."""
    tables = [sh.ShardedEmbeddingBag(40, 3, mode="sum", dtype=torch.float64, device=device, seed=1,
                                     owner_pooling="always", grad_reduction="sum") for _ in range(2)]
    opts = [sh.ShardedAdagrad(tables[0], lr=0.1, rowwise=True, fused=True, defer=defer),
            sh.ShardedAdagrad(tables[1], lr=0.1, rowwise=True)]
    for step in range(4):
        ids = torch.tensor([1, 5, 5, 39, 0, 7, 5, step], device=device)
        offsets = torch.tensor([0, 3, 3, 6], device=device)
        psw = torch.linspace(0.5, 2.0, 8, dtype=torch.float64, device=device)
        for t, o in zip(tables, opts):
            t(ids, offsets, psw).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert tables[0].stats.pooled_lookups == 4
    assert torch.allclose(tables[0].full_weight(), tables[1].full_weight(), rtol=1e-12, atol=1e-12)
