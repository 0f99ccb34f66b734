"""The kernels as PyTorch operators (torch.ops.sparsecomm.*) and the fused wire-buffer kernels.

References are torch ops or the unfused sparsecomm kernels (bitwise, where the
fused kernel promises the same result); the compiled function is checked
against its eager run.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsecomm import ops
from test_ops import INDEX_DTYPES, VALUE_DTYPES, row_inputs

# Fewer examples than test_ops: the fused kernels share the grouping and reductions tested there.
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

OPS = ["coalesce", "coalesce_partition", "partition", "gather", "scatter_add_", "pack_rows_", "unpack_rows_",
       "coalesce_segments", "group_by", "unique_inverse", "pooled_request"]


def _opcheck_cases():
    ids = torch.tensor([3, 1, 3, 0])
    v = torch.randn(4, 3, dtype=torch.float64)
    buf = torch.zeros(128, dtype=torch.uint8)
    seg_buf = torch.zeros(96, dtype=torch.uint8)
    seg_buf[:16].view(torch.int32).copy_(torch.tensor([2, 0, 2, 1], dtype=torch.int32))
    seg_buf[16:64].view(torch.float32).copy_(torch.arange(12.0))
    return [
        ("coalesce", (ids, v, 10)),
        ("coalesce", (ids.int(), v.half(), -1)),
        ("coalesce_partition", (ids, v, 10, 2, 0, 1, 1)),
        ("partition", (ids, v, 10, 2, 0, 1, 1)),
        ("partition", (ids, None, 10, 3, 1, 4, 1)),
        ("gather", (torch.randn(5, 3, dtype=torch.float64), ids)),
        ("scatter_add_", (torch.zeros(5, 3), ids, torch.ones(4, 3))),
        ("pack_rows_", (buf, v, ids, [0, 2, 0, 2, 2, 48], 0)),
        ("pack_rows_", (buf, ids, None, [0, 4, 8], 2)),
        ("unpack_rows_", (torch.zeros(4, 3, dtype=torch.float64), buf, [1, 3, 8, 0, 1, 104])),
        ("coalesce_segments", (seg_buf, [2, 0, 16, 2, 8, 40], 4, torch.float32, 3, 5, torch.int64, False)),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_registered_ops_pass_opcheck(name, args):
    # Schema, fake implementation (under FakeTensorMode), autograd registration, AOT dispatch.
    torch.library.opcheck(getattr(torch.ops.sparsecomm, name).default, args)


def test_every_op_has_a_cpu_kernel_a_cuda_kernel_and_a_fake():
    for name in OPS:
        op = getattr(torch.ops.sparsecomm, name).default
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), (name, key)
        # No catch-all: a device without a kernel is refused by the dispatcher, never run as CPU code.
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd"), name


def test_meta_tensors_get_shapes_from_the_fake_implementations():
    # The public wrappers refuse tensors without memory; the ops themselves give shapes (what compile sees).
    ids = torch.empty(5, dtype=torch.int32, device="meta")
    table = torch.empty(7, 3, dtype=torch.float16, device="meta")
    rows = torch.ops.sparsecomm.gather(table, ids)
    assert rows.shape == (5, 3) and rows.dtype == torch.float16 and rows.device.type == "meta"
    counts, pids, pvals, perm = torch.ops.sparsecomm.partition(ids, rows, 7, 4, 0, 1, 1)
    assert counts.shape == (4,) and pids.dtype == torch.int32 and pvals.shape == (5, 3) and perm.dtype == torch.int64


def test_a_device_without_a_kernel_gets_a_clear_error():
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="ids is on meta: sparsecomm kernels take CPU or CUDA tensors"):
        ops.gather_rows(torch.ones(2, 2), ids.to("meta"))


# ------------------------------------------------------------- autograd


def test_gradients_of_gather_coalesce_and_partition():
    ids = torch.tensor([4, 1, 4, 0, 1, 4])
    table = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    values = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops.gather_rows(t, ids), (table,))
    assert torch.autograd.gradcheck(lambda v: ops.coalesce_rows(ids.int(), v, 6)[1], (values,))
    assert torch.autograd.gradcheck(lambda v: ops.partition_rows(ids, v, 3).values, (values,))
    # Against torch's own ops.
    g = torch.randn(6, 3, dtype=torch.float64)
    (ours,) = torch.autograd.grad(ops.gather_rows(table, ids), table, g)
    (ref,) = torch.autograd.grad(table.index_select(0, ids), table, g)
    assert torch.allclose(ours, ref)


# ---------------------------------------------------------- torch.compile


def _coalesce_then_scatter(ids, values, table):
    uniq, sums = ops.coalesce_rows(ids, values, table.shape[0])
    ops.scatter_add_rows(table, uniq, sums * 0.5)
    return ops.gather_rows(table, uniq).sum(0), uniq


def _check_compiled(backend):
    torch._dynamo.reset()
    compiled = torch.compile(_coalesce_then_scatter, fullgraph=True, backend=backend)
    for n, dtype in ((300, torch.int64), (40, torch.int32), (0, torch.int64)):
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, 50, (n,), generator=g).to(dtype)
        values = torch.randn(n, 4, generator=g)
        table = torch.randn(50, 4, generator=g)
        t_eager, t_comp = table.clone(), table.clone()
        ref = _coalesce_then_scatter(ids, values, t_eager)
        got = compiled(ids, values, t_comp)
        assert torch.equal(got[1], ref[1]) and torch.allclose(got[0], ref[0])
        assert torch.equal(t_comp, t_eager)  # the in-place update happened, the same


def test_compile_fullgraph_traces_the_ops():
    # aot_eager: dynamo + fake tensors + functionalization, without inductor's codegen (seconds, not minutes).
    _check_compiled("aot_eager")


@pytest.mark.slow
def test_compile_fullgraph_with_inductor():
    _check_compiled("inductor")


# ---------------------------------------------------- coalesce + partition


@SETTINGS
@given(row_inputs(max_n=1000), st.integers(1, 5), st.sampled_from(["hash", "range"]))
def test_coalesce_partition_equals_partition_of_coalesce(inp, owners, scheme):
    ids, values, num_rows = inp
    fused = ops.coalesce_partition_rows(ids, values, owners, scheme, num_rows)
    u, s = ops.coalesce_rows(ids, values, num_rows)
    ref = ops.partition_rows(u, s, owners, scheme, num_rows)
    assert torch.equal(fused.counts, ref.counts) and torch.equal(fused.ids, ref.ids)
    assert fused.values.dtype == values.dtype and torch.equal(fused.values, ref.values)  # bitwise
    assert fused.perm is None


def test_coalesce_partition_checks_ids():
    with pytest.raises(ValueError, match="outside"):
        ops.coalesce_partition_rows(torch.tensor([0, 9]), torch.ones(2, 2), 2, num_rows=5)


# ------------------------------------------------------------- pack_rows


@SETTINGS
@given(row_inputs(max_n=500), st.integers(1, 4), st.sampled_from([None, torch.int16, torch.int32, torch.int64]))
def test_pack_rows_writes_each_segment_where_asked(inp, peers, wire):
    ids, values, num_rows = inp
    n = ids.shape[0]
    g = torch.Generator().manual_seed(n)
    index = torch.randint(0, max(n, 1), (n,), generator=g).to(ids.dtype) if n else ids[:0]
    cuts = sorted(torch.randint(0, n + 1, (peers - 1,), generator=g).tolist())
    bounds = [0, *cuts, n]
    src = ids if wire is not None else values
    width = (torch.empty(0, dtype=wire).element_size() if wire is not None
             else math.prod(values.shape[1:]) * values.element_size())
    # Gaps between segments, as in a send buffer: they must stay untouched.
    segments, pos = [], 8
    for a, b in zip(bounds, bounds[1:]):
        segments.append((a, b - a, pos))
        pos += (b - a) * width + 8
    buf = torch.full((pos,), 0xAB, dtype=torch.uint8)
    ops.pack_rows(buf, src, index, segments, wire_ids=wire)
    expect = torch.full_like(buf, 0xAB)
    picked = src.index_select(0, index.long()) if n else src[:0]
    for a, c, off in segments:
        if c == 0:  # an empty segment writes nothing (and an empty tensor cannot be viewed as bytes)
            continue
        rows = picked[a:a + c]
        rows = rows.to(wire) if wire is not None else rows
        expect[off:off + c * width] = rows.contiguous().view(-1).view(torch.uint8)
    assert torch.equal(buf, expect)


def test_pack_rows_checks_everything_before_writing():
    src = torch.randn(4, 2)
    buf = torch.zeros(64, dtype=torch.uint8)
    for index, segments, match in ((torch.tensor([0, 4]), [(0, 2, 0)], "index contains id 4"),
                                   (None, [(3, 2, 0)], "reads rows outside"),
                                   (None, [(0, 4, 40)], "writes outside the buffer")):
        with pytest.raises(ValueError, match=match):
            ops.pack_rows(buf, src, index, segments)
        assert not buf.any()
    with pytest.raises(ValueError, match="does not fit in 2 wire bytes"):
        ops.pack_rows(buf, torch.tensor([1, 40000]), None, [(0, 2, 0)], wire_ids=torch.int16)
    with pytest.raises(ValueError, match="buffer must be a contiguous 1-D uint8"):
        ops.pack_rows(torch.zeros(8), src, None, [])


# ------------------------------------------------------------- unpack_rows


@SETTINGS
@given(row_inputs(max_n=500), st.integers(1, 4))
def test_unpack_rows_reads_back_what_pack_rows_wrote(inp, peers):
    ids, values, num_rows = inp
    n = ids.shape[0]
    g = torch.Generator().manual_seed(n + peers)
    cuts = sorted(torch.randint(0, n + 1, (peers - 1,), generator=g).tolist())
    bounds = [0, *cuts, n]
    for src in (values, ids):
        width = math.prod(src.shape[1:]) * src.element_size()
        segments, pos = [], 8
        for a, b in zip(bounds, bounds[1:]):   # 8-aligned regions with gaps, as a receive buffer holds them
            segments.append((a, b - a, pos))
            pos += -(-(b - a) * width // 8) * 8 + 8
        buf = torch.full((pos,), 0xAB, dtype=torch.uint8)
        ops.pack_rows(buf, src, None, segments)
        # Read back in another order: every row lands where its segment says.
        out = torch.full_like(src, 7) if src.is_floating_point() else torch.full_like(src, -1)
        ops.unpack_rows(out, buf, segments[::-1])
        assert torch.equal(out.view(-1).view(torch.uint8) if n else out, src.view(-1).view(torch.uint8) if n else src)


def test_unpack_rows_fills_only_its_segments_and_checks_before_writing():
    buf = torch.arange(64, dtype=torch.uint8)
    out = torch.zeros(4, 2, dtype=torch.int16)
    ops.unpack_rows(out, buf, [(1, 2, 8), (0, 1, 40)])
    assert out[3].tolist() == [0, 0]   # no segment covers row 3
    assert out[:3].reshape(-1).view(torch.uint8).tolist() == list(range(40, 44)) + list(range(8, 16))
    for segments, match in (([(3, 2, 0)], "writes rows outside the output"),
                            ([(0, 2, 60)], "reads outside the buffer"),
                            ([(0, 1, 0), (-1, 1, 0)], "writes rows outside the output")):
        out.zero_()
        with pytest.raises(ValueError, match=match):
            ops.unpack_rows(out, buf, segments)
        assert not out.any()
    with pytest.raises(ValueError, match="out must be contiguous"):
        ops.unpack_rows(torch.zeros(4, 4).t(), buf, [])
    with pytest.raises(ValueError, match="buffer overlaps out's memory"):
        ops.unpack_rows(buf[8:16].view(torch.int16).view(4, 1), buf, [(0, 4, 0)])


# ----------------------------------------------------- coalesce_segments


def _segment_buffer(chunks, wire, dtype, row_shape, gap=8):
    """Lay out (ids, values) chunks in one byte buffer, each region 8-aligned, with gaps."""
    regions, pos = [], 0
    for ids, values in chunks:
        id_off = pos
        pos += -(-ids.shape[0] * torch.empty(0, dtype=wire).element_size() // 8) * 8 + gap
        val_off = pos
        pos += -(-values.numel() * values.element_size() // 8) * 8 + gap
        regions.append((id_off, val_off))
    buf = torch.full((pos,), 0x7F, dtype=torch.uint8)
    segments = []
    for (ids, values), (id_off, val_off) in zip(chunks, regions):
        segments.append((ids.shape[0], id_off, val_off))
        if ids.numel() == 0:
            continue
        w = ids.to(wire).view(torch.uint8)
        buf[id_off:id_off + w.numel()] = w
        v = values.contiguous().view(-1).view(torch.uint8)
        buf[val_off:val_off + v.numel()] = v
    return buf, segments


@SETTINGS
@given(row_inputs(max_n=1000), st.integers(1, 4), st.sampled_from([torch.int16, torch.int32, torch.int64]),
       st.sampled_from(INDEX_DTYPES), st.booleans())
def test_coalesce_segments_equals_coalesce_of_the_concatenation(inp, peers, wire, out_ids, accumulate):
    ids, values, num_rows = inp
    if wire == torch.int16:
        ids = ids % 2**15
    n = ids.shape[0]
    cuts = [0, *sorted(torch.randint(0, n + 1, (peers - 1,), generator=torch.Generator().manual_seed(n)).tolist()), n]
    chunks = [(ids[a:b], values[a:b]) for a, b in zip(cuts, cuts[1:])]
    buf, segments = _segment_buffer(chunks, wire, values.dtype, values.shape[1:])
    got_ids, got = ops.coalesce_segments(buf, segments, wire, values.dtype, values.shape[1:], 2**15 + num_rows,
                                         ids_dtype=out_ids, accumulate_dtype=accumulate)
    acc = torch.float32 if accumulate and values.dtype in (torch.float16, torch.bfloat16) else values.dtype
    ref_ids, ref = ops.coalesce_rows(ids.to(out_ids), values.to(acc))
    assert got_ids.dtype == out_ids and got.dtype == acc
    assert torch.equal(got_ids, ref_ids) and torch.equal(got, ref)  # bitwise: same order of summation


def test_coalesce_segments_refuses_bad_segments_and_ids():
    ids, values = torch.tensor([1, 2, 9]), torch.ones(3, 2)
    buf, segments = _segment_buffer([(ids, values)], torch.int32, torch.float32, (2,))
    with pytest.raises(ValueError, match="contains id 9 outside"):
        ops.coalesce_segments(buf, segments, torch.int32, torch.float32, (2,), 5)
    (count, id_off, val_off), = segments
    with pytest.raises(ValueError, match="not aligned"):
        ops.coalesce_segments(buf, [(count, id_off, val_off + 2)], torch.int32, torch.float32, (2,), 10)
    with pytest.raises(ValueError, match="outside the buffer"):
        ops.coalesce_segments(buf, [(count, id_off, buf.numel() - 8)], torch.int32, torch.float32, (2,), 10)


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_empty_fused_inputs(dtype):
    ids = torch.empty(0, dtype=torch.int64)
    values = torch.empty(0, 3, dtype=dtype)
    part = ops.coalesce_partition_rows(ids, values, 3, num_rows=4)
    assert part.counts.tolist() == [0, 0, 0] and part.values.shape == (0, 3)
    buf = torch.zeros(8, dtype=torch.uint8)
    ops.pack_rows(buf, values, ids, [(0, 0, 8)])
    got_ids, got = ops.coalesce_segments(buf, [(0, 0, 8)], torch.int16, dtype, (3,), 4)
    assert got_ids.shape == (0,) and got.shape == (0, 3) and got.dtype == dtype
