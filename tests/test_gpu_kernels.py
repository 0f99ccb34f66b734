"""The CUDA row kernels against the CPU kernels, through ``sparsecomm.ops``.

Each op runs on the same inputs on the GPU and on the CPU; results must be
bitwise equal (both sum every group in input order, fp16/bf16 in float32 with
one rounding), for every value and id dtype, d = 1, odd and wide rows, empty
inputs and Zipf-skewed ids with heavy duplication. Long groups (a hot id
with tens of thousands of rows) take the kernels' second, block-staged launch
(csrc/cuda/common.cuh), which must add in the same order as the per-thread
one: they are checked on their own, several side by side, rows wider than a
block, and many long groups of one column.

Skipped without a CUDA device or without CuPy.
"""

from __future__ import annotations

import itertools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cupy", reason="needs CuPy (pip install sparsecomm[gpu])")

from sparsecomm import ops  # noqa: E402
from sparsecomm.synthetic import zipf_ids  # noqa: E402

pytestmark = pytest.mark.gpu

VALUE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
WIDTHS = (1, 7, 128)
KINDS = ("uniform", "zipf", "empty")
NUM_ROWS = 1000
CUDA = torch.device("cuda")

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bit patterns, so that equality means bitwise equality."""
    t = t.detach().cpu().contiguous()
    return t.view(_BITS[t.element_size()]) if t.dtype.is_floating_point else t


def assert_bitwise_equal(actual, expected):
    if expected is None:
        assert actual is None
        return
    assert actual.dtype == expected.dtype
    assert tuple(actual.shape) == tuple(expected.shape)
    assert torch.equal(_bits(actual), _bits(expected))


def make_ids(kind: str, id_dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    if kind == "empty":
        return torch.empty(0, dtype=id_dtype)
    if kind == "zipf":
        # alpha 1.5: the hottest id takes a large share of the rows.
        return zipf_ids(20_000, NUM_ROWS, alpha=1.5, seed=seed, dtype=id_dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, NUM_ROWS, (5_000,), generator=g).to(id_dtype)


def make_values(n: int, d: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * 4).to(dtype)


CASES = list(itertools.product(VALUE_DTYPES, ID_DTYPES, WIDTHS, KINDS))


def _case_id(case) -> str:
    value_dtype, id_dtype, d, kind = case
    return f"{str(value_dtype)[6:]}-{str(id_dtype)[6:]}-d{d}-{kind}"


# ---- coalesce ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_coalesce_matches_cpu(case):
    value_dtype, id_dtype, d, kind = case
    ids = make_ids(kind, id_dtype)
    values = make_values(ids.numel(), d, value_dtype)
    expected_ids, expected_sums = ops.coalesce_rows(ids, values)
    got_ids, got_sums = ops.coalesce_rows(ids.to(CUDA), values.to(CUDA))
    assert got_ids.is_cuda and got_sums.is_cuda
    assert_bitwise_equal(got_ids, expected_ids)
    assert_bitwise_equal(got_sums, expected_sums)


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES, ids=str)
def test_coalesce_is_bitwise_deterministic(value_dtype):
    ids = zipf_ids(50_000, NUM_ROWS, alpha=1.2, seed=3).to(CUDA)
    values = make_values(ids.numel(), 33, value_dtype).to(CUDA)
    first = ops.coalesce_rows(ids, values)
    second = ops.coalesce_rows(ids, values)
    assert_bitwise_equal(second[0], first[0])
    assert_bitwise_equal(second[1], first[1])


def test_coalesce_keeps_row_shape():
    ids = torch.tensor([4, 2, 4, 9])
    values = make_values(4, 6, torch.float32).view(4, 2, 3)
    expected = ops.coalesce_rows(ids, values)
    got = ops.coalesce_rows(ids.to(CUDA), values.to(CUDA))
    assert_bitwise_equal(got[1], expected[1])


# ---- scatter-add -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_scatter_add_matches_cpu(case):
    value_dtype, id_dtype, d, kind = case
    ids = make_ids(kind, id_dtype)
    values = make_values(ids.numel(), d, value_dtype)
    table = make_values(NUM_ROWS, d, value_dtype, seed=2)
    expected = ops.scatter_add_rows(table.clone(), ids, values)
    table_gpu = table.to(CUDA)
    got = ops.scatter_add_rows(table_gpu, ids.to(CUDA), values.to(CUDA))
    assert got is table_gpu, "updates the table in place and returns it"
    assert_bitwise_equal(got, expected)


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES, ids=str)
def test_scatter_add_is_bitwise_deterministic(value_dtype):
    ids = zipf_ids(50_000, NUM_ROWS, alpha=1.2, seed=4).to(CUDA)
    values = make_values(ids.numel(), 33, value_dtype).to(CUDA)
    table = make_values(NUM_ROWS, 33, value_dtype, seed=5).to(CUDA)
    first = ops.scatter_add_rows(table.clone(), ids, values)
    second = ops.scatter_add_rows(table.clone(), ids, values)
    assert_bitwise_equal(second, first)


# ---- long groups: summed by a whole block ------------------------------------------

# (d, ids): a hot id with 40,000 of 60,000 rows amid Zipf ids; hot ids side by
# side (several long groups in one tile of 256 (group, column) pairs); a row
# wider than a block (two column tiles); 64 long groups of d = 1.
LONG_LAYOUTS = {
    "hot-d64": (64, lambda: torch.cat([torch.full((40_000,), 17), zipf_ids(20_000, NUM_ROWS, seed=6)])),
    "adjacent-d7": (7, lambda: torch.arange(6).repeat_interleave(torch.tensor([9000, 300, 257, 5000, 3, 1200]))),
    "wide-d300": (300, lambda: torch.cat([torch.full((3000,), 5), torch.arange(0, 40)])),
    "many-d1": (1, lambda: torch.arange(64).repeat(400)),
}
LONG_CASES = list(itertools.product((torch.float32, torch.float16, torch.bfloat16), ID_DTYPES, LONG_LAYOUTS))


def _long_case(case):
    value_dtype, id_dtype, layout = case
    d, make = LONG_LAYOUTS[layout]
    ids = make().to(id_dtype)
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(7))]
    return ids, make_values(ids.numel(), d, value_dtype), d


@pytest.mark.parametrize("case", LONG_CASES, ids=lambda c: f"{str(c[0])[6:]}-{str(c[1])[6:]}-{c[2]}")
def test_long_groups_match_cpu(case):
    ids, values, d = _long_case(case)
    expected = ops.coalesce_rows(ids, values)
    got = ops.coalesce_rows(ids.to(CUDA), values.to(CUDA))
    assert_bitwise_equal(got[0], expected[0])
    assert_bitwise_equal(got[1], expected[1])
    # Into a table (sums start from its rows) and into zeros with a -0.0 (sums start from 0.0 there).
    zeros = torch.zeros(NUM_ROWS, d, dtype=values.dtype)
    zeros[17] = -0.0
    for table in (make_values(NUM_ROWS, d, values.dtype, seed=2), zeros):
        expected = ops.scatter_add_rows(table.clone(), ids, values)
        got = ops.scatter_add_rows(table.to(CUDA), ids.to(CUDA), values.to(CUDA))
        assert_bitwise_equal(got, expected)


# ---- gather ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gather_matches_cpu(case):
    value_dtype, id_dtype, d, kind = case
    ids = make_ids(kind, id_dtype)
    table = make_values(NUM_ROWS, d, value_dtype, seed=2)
    expected = ops.gather_rows(table, ids)
    assert_bitwise_equal(ops.gather_rows(table.to(CUDA), ids.to(CUDA)), expected)


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES, ids=str)
def test_gather_from_an_offset_view(value_dtype):
    # A view that starts one element in: the copy unit must shrink to stay aligned.
    base = make_values(NUM_ROWS * 8 + 1, 1, value_dtype).to(CUDA).view(-1)
    table = base[1:].view(NUM_ROWS, 8)
    ids = make_ids("zipf", torch.int64).to(CUDA)
    assert_bitwise_equal(ops.gather_rows(table, ids), table.cpu()[ids.cpu()])


# ---- partition ---------------------------------------------------------------------

PARTITION_CASES = list(
    itertools.product(
        ID_DTYPES,
        ("hash", "range"),
        (1, 4, 5000),  # 5000 owners: more bins than the kernel keeps in shared memory
        (1, 3),
        ("uniform", "zipf", "empty"),
    )
)


@pytest.mark.parametrize(
    "case", PARTITION_CASES, ids=lambda c: f"{str(c[0])[6:]}-{c[1]}-owners{c[2]}-stride{c[3]}-{c[4]}"
)
@pytest.mark.parametrize("with_values", (True, False), ids=("values", "ids-only"))
def test_partition_matches_cpu(case, with_values):
    id_dtype, scheme, num_owners, stride, kind = case
    ids = make_ids(kind, id_dtype)
    values = make_values(ids.numel(), 5, torch.bfloat16) if with_values else None
    expected = ops.partition_rows(ids, values, num_owners, scheme, NUM_ROWS, stride=stride)
    got = ops.partition_rows(
        ids.to(CUDA), None if values is None else values.to(CUDA), num_owners, scheme, NUM_ROWS, stride=stride
    )
    assert_bitwise_equal(got.counts, expected.counts)
    assert_bitwise_equal(got.ids, expected.ids)
    assert_bitwise_equal(got.values, expected.values)
    assert_bitwise_equal(got.perm, expected.perm)


def test_partition_hashes_large_ids_like_cpu():
    # Ids past 2**32 exercise the full 64-bit splitmix64 path.
    ids = torch.tensor([0, 1, 2**31 - 1, 2**32 + 5, 2**62 + 3, 2**63 - 1], dtype=torch.int64)
    expected = ops.partition_rows(ids, None, 7)
    got = ops.partition_rows(ids.to(CUDA), None, 7)
    assert_bitwise_equal(got.counts, expected.counts)
    assert_bitwise_equal(got.perm, expected.perm)


# ---- streams, errors, large tables -------------------------------------------------------


def test_runs_on_the_current_stream():
    ids = make_ids("zipf", torch.int64)
    values = make_values(ids.numel(), 64, torch.float32)
    expected = ops.coalesce_rows(ids, values)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ids_gpu, values_gpu = ids.to(CUDA, non_blocking=True), values.to(CUDA, non_blocking=True)
        got = ops.coalesce_rows(ids_gpu, values_gpu)
        gathered = ops.gather_rows(got[1], torch.arange(got[0].numel(), device=CUDA))
    side.synchronize()
    assert_bitwise_equal(got[1], expected[1])
    assert_bitwise_equal(gathered, expected[1])


@pytest.mark.parametrize("bad_id", (-1, NUM_ROWS), ids=("negative", "past-end"))
def test_out_of_range_ids_raise(bad_id):
    table = make_values(NUM_ROWS, 4, torch.float32).to(CUDA)
    ids = torch.tensor([0, bad_id, 3], device=CUDA)
    values = torch.ones(3, 4, device=CUDA)
    with pytest.raises(ValueError):
        ops.gather_rows(table, ids)
    before = table.clone()
    with pytest.raises(ValueError):
        ops.scatter_add_rows(table, ids, values)
    assert torch.equal(table, before), "a rejected scatter-add leaves the table untouched"
    with pytest.raises(ValueError):
        ops.coalesce_rows(ids, values, num_rows=NUM_ROWS)
    with pytest.raises(ValueError):
        ops.partition_rows(ids, values, 4, "range", NUM_ROWS)


def test_offsets_beyond_32_bits():
    # 2**20 rows of 2049 fp16 values: element offsets of the last rows pass 2**31.
    rows, d = 2**20, 2049
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs a GPU with >= 24 GiB")
    table = torch.randn(rows, d, device=CUDA, dtype=torch.float16)
    ids = torch.tensor([rows - 1, 0, rows - 1, rows - 2], device=CUDA)
    assert torch.equal(ops.gather_rows(table, ids), table[ids])
    values = torch.randn(4, d, device=CUDA, dtype=torch.float16)
    old = table[[rows - 2, rows - 1]].float()
    expected_last = ((old[1] + values[0].float()) + values[2].float()).half()
    expected_prev = (old[0] + values[3].float()).half()
    ops.scatter_add_rows(table, ids, values)
    assert torch.equal(table[rows - 1], expected_last)
    assert torch.equal(table[rows - 2], expected_prev)
    del table
    torch.cuda.empty_cache()


def test_scatter_add_contracts_hold_on_the_gpu():
    # The same contracts as on the CPU (tests/test_ops.py): checked before the dispatch, versioned after.
    ids, values = torch.tensor([1, 1], device=CUDA), torch.ones(2, 3, device=CUDA)
    leaf = torch.zeros(4, 3, device=CUDA, requires_grad=True)
    with pytest.raises(RuntimeError, match="table requires grad"):
        ops.scatter_add_rows(leaf, ids, values)
    table = torch.randn(6, 3, device=CUDA)
    with pytest.raises(ValueError, match="values overlaps table's memory"):
        ops.scatter_add_rows(table, ids, table[2:4])
    weight = torch.randn(3, device=CUDA, requires_grad=True)
    loss = (table * weight).sum()  # saves table
    ops.scatter_add_rows(table, ids, values)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(ValueError, match="num_rows must be >= 0"):
        ops.coalesce_rows(ids, values, num_rows=-1)


# ---- the registered operators: fused paths, autograd, torch.compile on CUDA --------


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES, ids=str)
def test_coalesce_partition_matches_cpu(value_dtype):
    ids = make_ids("zipf", torch.int64)
    values = make_values(ids.numel(), 7, value_dtype)
    expected = ops.coalesce_partition_rows(ids, values, 3, num_rows=NUM_ROWS)
    got = ops.coalesce_partition_rows(ids.to(CUDA), values.to(CUDA), 3, num_rows=NUM_ROWS)
    for a, b in zip(got[:3], expected[:3]):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("wire", [None, torch.int16, torch.int64], ids=str)
def test_pack_rows_unpack_rows_and_coalesce_segments_match_cpu(wire):
    ids = make_ids("zipf", torch.int64)
    values = make_values(ids.numel(), 5, torch.float16)
    index = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))
    src = ids if wire is not None else values
    width = (torch.empty(0, dtype=wire).element_size() if wire is not None else 5 * values.element_size())
    half = ids.numel() // 2
    segments = [(0, half, 0), (half, ids.numel() - half, -(-half * width // 8) * 8 + 8)]
    size = segments[1][2] + (ids.numel() - half) * width
    cpu = torch.zeros(size, dtype=torch.uint8)
    gpu = torch.zeros(size, dtype=torch.uint8, device=CUDA)
    ops.pack_rows(cpu, src, index, segments, wire_ids=wire)
    ops.pack_rows(gpu, src.to(CUDA), index.to(CUDA), segments, wire_ids=wire)
    assert torch.equal(gpu.cpu(), cpu)
    if wire is None:  # and read back into one tensor, segments in the other order
        back = torch.zeros_like(src, device=CUDA)
        ops.unpack_rows(back, gpu, segments[::-1])
        assert torch.equal(back.cpu(), src.index_select(0, index))
    # Ids then rows, as a receive buffer holds them; summed straight out of it.
    n = ids.numel()
    buf = torch.zeros(8 * n + 10 * n + 16, dtype=torch.uint8)
    buf[:8 * n].view(torch.int64).copy_(ids)
    buf[8 * n:8 * n + 10 * n].view(torch.float16).copy_(values.view(-1))
    segs = [(n, 0, 8 * n)]
    for acc in (False, True):
        expected = ops.coalesce_segments(buf, segs, torch.int64, torch.float16, (5,), NUM_ROWS, accumulate_dtype=acc)
        got = ops.coalesce_segments(buf.to(CUDA), segs, torch.int64, torch.float16, (5,), NUM_ROWS,
                                    accumulate_dtype=acc)
        assert_bitwise_equal(got[0], expected[0])
        assert_bitwise_equal(got[1], expected[1])


def test_gather_gradient_and_compile_on_cuda():
    ids = make_ids("zipf", torch.int32).to(CUDA)
    table = make_values(NUM_ROWS, 4, torch.float32).to(CUDA).requires_grad_()
    ops.gather_rows(table, ids).sum().backward()
    expected = torch.bincount(ids.long(), minlength=NUM_ROWS).float()[:, None].expand(-1, 4)
    assert torch.equal(table.grad, expected)

    def f(ids, values, table):
        uniq, sums = ops.coalesce_rows(ids, values, table.shape[0])
        ops.scatter_add_rows(table, uniq, sums)
        return uniq

    values = make_values(ids.numel(), 4, torch.float32).to(CUDA)
    t_eager, t_comp = torch.zeros(NUM_ROWS, 4, device=CUDA), torch.zeros(NUM_ROWS, 4, device=CUDA)
    ref = f(ids, values, t_eager)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(ids, values, t_comp)
    assert torch.equal(got, ref) and torch.equal(t_comp, t_eager)


def test_index_ops_match_cpu():
    """group_by, bag_groups, unique_inverse and pooled_request (torch code on CUDA) give the CPU kernels' results."""
    ids = zipf_ids(5000, NUM_ROWS, seed=3)
    uniq, inv = ops.unique_inverse(ids, NUM_ROWS)
    got = ops.unique_inverse(ids.to(CUDA), NUM_ROWS)
    assert torch.equal(got[0].cpu(), uniq) and torch.equal(got[1].cpu(), inv)
    order, offsets = ops.group_by(inv, uniq.numel())
    got = ops.group_by(inv.to(CUDA), uniq.numel())
    assert torch.equal(got[0].cpu(), order) and torch.equal(got[1].cpu(), offsets)
    positions = torch.randint(0, ids.numel(), (3000,), generator=torch.Generator().manual_seed(4))
    lengths = torch.full((150,), 20)
    want = ops.bag_groups(inv, positions, lengths, uniq.numel())
    got = ops.bag_groups(inv.to(CUDA), positions.to(CUDA), lengths.to(CUDA), uniq.numel())
    assert all(b.device.type == "cuda" and torch.equal(b.cpu(), a) for a, b in zip(want, got))
    bag_of = torch.arange(ids.numel()) // 20
    for scheme in ("hash", "range"):
        want = ops.pooled_request(ids, bag_of, 3, scheme, NUM_ROWS, num_bags=250)
        plan = ops.pooled_request(ids.to(CUDA), bag_of.to(CUDA), 3, scheme, NUM_ROWS, num_bags=250)
        for name, a, b in zip(want._fields, want, plan):
            assert b.device.type == "cuda" and b.dtype == a.dtype and torch.equal(b.cpu(), a), (scheme, name)
