"""Row kernels against plain torch references: random, skewed, empty, every dtype."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsecomm import _C, ops, ownership
from sparsecomm.synthetic import zipf_ids

VALUE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tol(dtype, terms=1):
    # fp16/bf16 results are rounded once from a float32 sum.
    return {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype] * terms


def _ref_coalesce(ids, values):
    uniq, inv = torch.unique(ids.long(), return_inverse=True)
    acc = torch.zeros((len(uniq), *values.shape[1:]), dtype=torch.float64)
    acc.index_add_(0, inv, values.double())
    return uniq, acc


@st.composite
def row_inputs(draw, max_n=300):
    n = draw(st.integers(0, max_n))
    num_rows = draw(st.integers(1, 5000))
    skew = draw(st.sampled_from(["uniform", "zipf", "one_row", "few"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if skew == "zipf":
        ids = zipf_ids(n, num_rows, alpha=1.2, seed=seed)
    elif skew == "one_row":
        ids = torch.full((n,), draw(st.integers(0, num_rows - 1)), dtype=torch.int64)
    elif skew == "few":
        ids = torch.randint(0, min(num_rows, 3), (n,), generator=g)
    else:
        ids = torch.randint(0, num_rows, (n,), generator=g)
    ids = ids.to(draw(st.sampled_from(INDEX_DTYPES)))
    width = draw(st.sampled_from([(1,), (3,), (7,), (16,), (2, 5)]))
    dtype = draw(st.sampled_from(VALUE_DTYPES))
    values = torch.randn((n, *width), generator=g, dtype=torch.float64).to(dtype)
    return ids, values, num_rows


@SETTINGS
@given(row_inputs(max_n=3000))
def test_coalesce_matches_reference(inp):
    ids, values, num_rows = inp
    out_ids, out_values = ops.coalesce_rows(ids, values, num_rows)
    ref_ids, ref_values = _ref_coalesce(ids, values)
    assert out_ids.dtype == ids.dtype and out_values.dtype == values.dtype
    assert out_values.shape == (len(ref_ids), *values.shape[1:])
    assert torch.equal(out_ids.long(), ref_ids)
    # Tolerance scales with the number of terms of the largest group.
    terms = int(torch.bincount(ids.long()).max()) if len(ids) else 1
    err = (out_values.double() - ref_values).abs()
    bound = _tol(values.dtype, terms) * (1 + ref_values.abs())
    assert bool((err <= bound).all()), float((err - bound).max())


@SETTINGS
@given(row_inputs(max_n=2000), st.integers(1, 7), st.sampled_from(["hash", "range"]), st.integers(1, 3))
def test_partition_is_stable_grouping_by_owner(inp, num_owners, scheme, stride):
    ids, values, num_rows = inp
    part = ops.partition_rows(ids, values, num_owners, scheme, num_rows, stride=stride)
    owners = torch.tensor([_C.row_owner(int(i), ownership.scheme_code(scheme), num_owners,
                                        -(-num_rows // num_owners), stride) for i in ids.tolist()],
                          dtype=torch.int64)
    # Independent reference: a stable sort by owner.
    ref_perm = torch.sort(owners, stable=True).indices if len(ids) else torch.empty(0, dtype=torch.int64)
    assert torch.equal(part.perm, ref_perm)
    assert torch.equal(part.ids, ids[ref_perm])
    assert torch.equal(part.values, values[ref_perm])
    assert torch.equal(part.counts, torch.bincount(owners, minlength=num_owners))
    assert torch.equal(ops.row_owners(ids, num_owners, scheme, num_rows, stride=stride), owners)


def test_range_scheme_gives_contiguous_blocks():
    ids = torch.arange(10)
    part = ops.partition_rows(ids, None, 3, "range", num_rows=10)  # blocks of ceil(10/3) = 4
    assert part.counts.tolist() == [4, 4, 2]
    assert part.values is None


def test_hash_scheme_balances_zipf_ids():
    ids = torch.unique(zipf_ids(200_000, 1_000_000, alpha=1.1, seed=3))
    counts = ops.partition_rows(ids, None, 4, "hash").counts.double()
    assert float(counts.max() / counts.mean()) < 1.05


def test_hash_matches_splitmix64_reference():
    def splitmix64(x):
        m = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    for i in [0, 1, 2, 12345, 2**31 - 1, 2**40 + 7]:
        for n, stride in [(2, 1), (3, 1), (5, 2)]:
            assert _C.row_owner(i, 0, n, 1, stride) == (splitmix64(i) // stride) % n


@SETTINGS
@given(row_inputs(max_n=1000))
def test_gather_matches_index_select(inp):
    ids, values, num_rows = inp
    table = torch.randn((num_rows, *values.shape[1:]), dtype=torch.float64).to(values.dtype)
    out = ops.gather_rows(table, ids)
    assert torch.equal(out, table.index_select(0, ids.long()))


@SETTINGS
@given(row_inputs(max_n=2000))
def test_scatter_add_matches_index_add(inp):
    ids, values, num_rows = inp
    table = torch.randn((num_rows, *values.shape[1:]), dtype=torch.float64).to(values.dtype)
    ref = table.double().index_add(0, ids.long(), values.double())
    out = ops.scatter_add_rows(table, ids, values)
    assert out is table
    terms = 1 + (int(torch.bincount(ids.long()).max()) if len(ids) else 0)
    err = (table.double() - ref).abs()
    assert bool((err <= _tol(values.dtype, terms) * (1 + ref.abs())).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_round_once(dtype):
    # 1000 tiny updates to one row: per-update rounding in fp16/bf16 would stall.
    ids = torch.zeros(1000, dtype=torch.int64)
    values = torch.full((1000, 4), 1e-3, dtype=dtype)
    expected = (values.float().sum(0)).to(dtype)
    _, summed = ops.coalesce_rows(ids, values)
    assert torch.equal(summed[0], expected)
    table = torch.ones(1, 4, dtype=dtype)
    ops.scatter_add_rows(table, ids, values)
    assert torch.equal(table[0], (1 + values.float().sum(0)).to(dtype))


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_empty_inputs(value_dtype, index_dtype):
    ids = torch.empty(0, dtype=index_dtype)
    values = torch.empty(0, 5, dtype=value_dtype)
    u, s = ops.coalesce_rows(ids, values)
    assert u.shape == (0,) and s.shape == (0, 5)
    part = ops.partition_rows(ids, values, 3)
    assert part.counts.tolist() == [0, 0, 0] and part.values.shape == (0, 5)
    table = torch.randn(4, 5).to(value_dtype)
    assert ops.gather_rows(table, ids).shape == (0, 5)
    before = table.clone()
    ops.scatter_add_rows(table, ids, values)
    assert torch.equal(table, before)


def test_large_zipf_coalesce_against_reference():
    # Big enough for the radix path and several threads.
    ids = zipf_ids(200_000, 1_000_000, alpha=1.1, seed=1)
    values = torch.randn(200_000, 8)
    u, s = ops.coalesce_rows(ids, values)
    ref_u, ref_s = _ref_coalesce(ids, values)
    assert torch.equal(u, ref_u)
    assert torch.allclose(s.double(), ref_s, atol=1e-3, rtol=1e-4)


def test_wide_ids_take_64_bit_radix_path():
    ids = torch.tensor([2**40, 5, 2**33, 5, 2**40] * 1000, dtype=torch.int64)
    values = torch.ones(5000, 2)
    u, s = ops.coalesce_rows(ids, values)
    assert u.tolist() == [5, 2**33, 2**40]
    assert s[:, 0].tolist() == [2000, 1000, 2000]


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_coalesce_and_scatter_add_are_deterministic_across_thread_counts(dtype):
    ids = zipf_ids(100_000, 5_000, alpha=1.1, seed=7)
    values = torch.randn(100_000, 9).to(dtype)
    table = torch.randn(5_000, 9).to(dtype)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in [1, 2, 3, 4]:
            torch.set_num_threads(threads)
            u, s = ops.coalesce_rows(ids, values)
            t = ops.scatter_add_rows(table.clone(), ids, values)
            results.append((u, s, t))
    finally:
        torch.set_num_threads(old)
    for u, s, t in results[1:]:
        assert torch.equal(u, results[0][0])
        assert torch.equal(s.view(torch.uint8), results[0][1].view(torch.uint8))  # bitwise
        assert torch.equal(t.view(torch.uint8), results[0][2].view(torch.uint8))


def test_nan_and_inf_propagate():
    ids = torch.tensor([1, 1, 2])
    values = torch.tensor([[float("nan")], [1.0], [float("inf")]])
    u, s = ops.coalesce_rows(ids, values)
    assert torch.isnan(s[0]).all() and torch.isinf(s[1]).all()


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("bad", [-1, 10])
def test_out_of_range_ids_raise_and_leave_table_untouched(bad):
    table = torch.randn(10, 3)
    before = table.clone()
    ids = torch.tensor([0, 3, bad])
    values = torch.ones(3, 3)
    with pytest.raises(ValueError, match="outside"):
        ops.scatter_add_rows(table, ids, values)
    assert torch.equal(table, before)
    with pytest.raises(ValueError, match="outside"):
        ops.gather_rows(table, ids)
    with pytest.raises(ValueError, match="outside"):
        ops.coalesce_rows(ids, values, num_rows=10)
    with pytest.raises(ValueError, match="outside"):
        ops.partition_rows(ids, values, 2, "range", num_rows=10)
    half = torch.randn(10, 3).half()
    with pytest.raises(ValueError, match="outside"):
        ops.scatter_add_rows(half, ids, values.half())


def test_negative_ids_rejected_without_bound():
    with pytest.raises(ValueError, match="outside"):
        ops.coalesce_rows(torch.tensor([-5, 1]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="outside"):
        ops.partition_rows(torch.tensor([-5, 1]), None, 2)


def test_type_errors_name_the_argument():
    with pytest.raises(TypeError, match="ids must be int32 or int64"):
        ops.coalesce_rows(torch.tensor([1.0]), torch.ones(1, 1))
    with pytest.raises(TypeError, match="values must be float32"):
        ops.coalesce_rows(torch.tensor([1]), torch.ones(1, 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="ids must be a torch.Tensor"):
        ops.gather_rows(torch.ones(2, 2), [0, 1])
    with pytest.raises(TypeError, match="table dtype"):
        ops.scatter_add_rows(torch.ones(2, 2), torch.tensor([0]), torch.ones(1, 2, dtype=torch.float64))


def test_value_errors_name_the_argument():
    with pytest.raises(ValueError, match="values has 2 rows but ids has 3"):
        ops.coalesce_rows(torch.tensor([1, 2, 3]), torch.ones(2, 4))
    with pytest.raises(ValueError, match="ids must be contiguous"):
        ops.coalesce_rows(torch.arange(6)[::2], torch.ones(3, 1))
    with pytest.raises(ValueError, match="values must be contiguous"):
        ops.coalesce_rows(torch.arange(3), torch.ones(3, 8)[:, ::2])
    with pytest.raises(ValueError, match="ids must be 1-D"):
        ops.gather_rows(torch.ones(2, 2), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="values rows have shape"):
        ops.scatter_add_rows(torch.ones(4, 2), torch.tensor([0]), torch.ones(1, 3))
    with pytest.raises(ValueError, match="num_owners"):
        ops.partition_rows(torch.tensor([1]), None, 0)
    with pytest.raises(ValueError, match="scheme"):
        ops.partition_rows(torch.tensor([1]), None, 2, "modulo")
    with pytest.raises(ValueError, match="needs num_rows"):
        ops.partition_rows(torch.tensor([1]), None, 2, "range")
    with pytest.raises(ValueError, match="dense"):
        ops.gather_rows(torch.ones(2, 2).to_sparse(), torch.tensor([0]))


def test_openmp_is_compiled_in():
    assert _C.openmp_enabled()


def test_smaller_openmp_team_than_requested_gives_the_same_results():
    # OMP_THREAD_LIMIT / OMP_DYNAMIC may start fewer threads than asked for;
    # chunking by the requested count would leave rows unsorted or unmoved.
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from sparsecomm import ops\n"
        "torch.set_num_threads(4)\n"
        "ids = torch.randint(0, 50000, (100000,), generator=torch.Generator().manual_seed(0))\n"
        "v = torch.ones(100000, 3)\n"
        "u, s = ops.coalesce_rows(ids, v)\n"
        "ref = torch.unique(ids)\n"
        "ok = torch.equal(u, ref) and float(s.sum()) == 300000.0\n"
        "p = ops.partition_rows(ids, None, 3)\n"
        "ok = ok and int(p.counts.sum()) == 100000 and torch.equal(ids[p.perm], p.ids)\n"
        "print('OK' if ok else 'WRONG')\n")
    # One interpreter per setting (OpenMP reads them once), both started at once: nearly all of each one's
    # time is importing torch, on one core.
    envs = ({"OMP_THREAD_LIMIT": "1"}, {"OMP_DYNAMIC": "true"})
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**__import__("os").environ, **env}) for env in envs]
    try:
        for env, p in zip(envs, procs):
            stdout, stderr = p.communicate(timeout=120)
            assert stdout.strip() == "OK", (env, stdout, stderr[-2000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_row_owner_rejects_bad_maps_instead_of_crashing():
    for args in [(5, 0, 0, 1, 1), (5, 1, 2, 0, 1), (5, 7, 2, 1, 1), (-1, 0, 2, 1, 1), (5, 0, 2, 1, 0)]:
        with pytest.raises(ValueError):
            _C.row_owner(*args)


# ------------------------------------------------------------ kernel contracts


def test_tensors_without_memory_are_refused_before_any_kernel():
    # A meta tensor's data pointer is null: it must never reach the C++ kernels.
    meta_ids = torch.tensor([0, 1]).to("meta")
    meta_values = torch.ones(2, 3).to("meta")
    for call in (lambda: ops.coalesce_rows(meta_ids, meta_values),
                 lambda: ops.partition_rows(meta_ids, None, 2),
                 lambda: ops.row_owners(meta_ids, 2),
                 lambda: ops.gather_rows(torch.ones(4, 3).to("meta"), meta_ids),
                 lambda: ops.scatter_add_rows(torch.ones(4, 3).to("meta"), meta_ids, meta_values)):
        with pytest.raises(ValueError, match="ids is on meta"):
            call()
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="values is on meta"):
        ops.coalesce_rows(ids, meta_values)
    with pytest.raises(ValueError, match="table is on meta"):
        ops.gather_rows(torch.ones(4, 3).to("meta"), ids)
    with pytest.raises(ValueError, match="values is on meta"):
        ops.scatter_add_rows(torch.ones(4, 3), ids, meta_values)


def test_negative_num_rows_is_an_error_not_an_unbounded_table():
    ids, values = torch.tensor([0, 7]), torch.ones(2, 1)
    with pytest.raises(ValueError, match="num_rows must be >= 0"):
        ops.coalesce_rows(ids, values, num_rows=-3)
    with pytest.raises(ValueError, match="num_rows must be >= 0"):
        ops.partition_rows(ids, values, 2, num_rows=-1)
    with pytest.raises(TypeError, match="num_rows must be an int"):
        ops.coalesce_rows(ids, values, num_rows=2.5)
    # The compiled kernels refuse a negative bound too (-1 would disable their id check).
    table, out = torch.zeros(4, 1), torch.zeros(2, 1)
    with pytest.raises(ValueError, match="num_rows >= 0"):
        _C.gather_rows(table.data_ptr(), -1, 4, ids.data_ptr(), 1, 2, out.data_ptr(), 1)
    with pytest.raises(ValueError, match="num_rows >= 0"):
        _C.scatter_add_rows(table.data_ptr(), -1, 0, 1, ids.data_ptr(), 1, 2, out.data_ptr(), 1)


def test_scatter_add_refuses_what_autograd_would_get_wrong():
    leaf = torch.zeros(4, 2, requires_grad=True)
    ids, values = torch.tensor([1, 1]), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="table requires grad"):
        ops.scatter_add_rows(leaf, ids, values)
    with torch.no_grad():
        view = leaf.view(-1, 1)  # a view made without grad still writes to the leaf
    with pytest.raises(RuntimeError, match="table requires grad"):
        ops.scatter_add_rows(view, torch.tensor([0]), torch.ones(1, 1))
    with pytest.raises(RuntimeError, match="values requires grad"):
        ops.scatter_add_rows(torch.zeros(4, 2), ids, torch.ones(2, 2, requires_grad=True))
    assert torch.equal(leaf, torch.zeros(4, 2))
    # Optimizer-style updates of a leaf under no_grad, as torch's own in-place ops allow.
    with torch.no_grad():
        ops.scatter_add_rows(leaf, ids, values)
    assert leaf[1].tolist() == [2.0, 2.0] and leaf.requires_grad


@pytest.mark.parametrize("update", ["index_add_", "scatter_add_rows"])
def test_scatter_add_bumps_the_version_like_an_in_place_op(update):
    table = torch.randn(4, 3)
    weight = torch.randn(3, requires_grad=True)
    loss = (table * weight).sum()  # saves table for weight's gradient
    version = table._version
    ids, values = torch.tensor([2]), torch.ones(1, 3)
    if update == "index_add_":  # the reference behaviour
        table.index_add_(0, ids, values)
    else:
        ops.scatter_add_rows(table, ids, values)
    assert table._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_scatter_add_refuses_inputs_sharing_the_tables_memory():
    table = torch.randn(6, 2)
    before = table.clone()
    with pytest.raises(ValueError, match="values overlaps table's memory"):
        ops.scatter_add_rows(table, torch.tensor([0, 1]), table[2:4])
    # ids aliasing the table could be rewritten by the kernel after they were bounds-checked.
    alias = torch.zeros(6, 2).view(torch.int32).view(-1)
    with pytest.raises(ValueError, match="ids overlaps table's memory"):
        ops.scatter_add_rows(alias.view(torch.float32).view(6, 2), alias[:2], torch.ones(2, 2))
    assert torch.equal(table, before)
    # Disjoint slices of one buffer are fine.
    buf = torch.zeros(8, 2)
    ops.scatter_add_rows(buf[:4], torch.tensor([3, 3]), buf[4:6] + 1)
    assert buf[3].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_zero_width_rows(index_dtype):
    # Null data pointers with 0-byte rows: nothing to copy (UBSan checks the guard in scripts/sanitize.sh).
    ids = torch.tensor([3, 0, 3], dtype=index_dtype)
    values = torch.empty(3, 0)
    u, s = ops.coalesce_rows(ids, values)
    assert u.tolist() == [0, 3] and s.shape == (2, 0)
    part = ops.partition_rows(ids, values, 2)
    assert part.values.shape == (3, 0) and int(part.counts.sum()) == 3
    table = torch.empty(5, 0)
    assert ops.gather_rows(table, ids).shape == (3, 0)
    assert ops.scatter_add_rows(table, ids, values) is table
    with pytest.raises(ValueError, match="outside"):
        ops.gather_rows(table, torch.tensor([5], dtype=index_dtype))


# ------------------------------------- coalesce: dense slot map vs radix sort


def _coalesce_with(ids, values, num_rows, threads, allow_dense):
    """Coalesce through the kernels directly: (took the dense slot map?, unique ids, sums)."""
    from sparsecomm._library import INDEX_CODE, VALUE_CODE

    flat = values.reshape(ids.shape[0], values[0].numel() if values.shape[0] else math.prod(values.shape[1:]))
    plan = _C.coalesce_plan(ids.data_ptr(), INDEX_CODE[ids.dtype], ids.shape[0], num_rows, threads, allow_dense)
    out_ids = torch.empty(plan.num_unique, dtype=ids.dtype)
    sums = torch.empty((plan.num_unique, flat.shape[1]), dtype=values.dtype)
    _C.coalesce_apply(plan, flat.data_ptr(), VALUE_CODE[values.dtype], flat.shape[1], out_ids.data_ptr(),
                      sums.data_ptr(), threads)
    return plan.dense, out_ids, sums.view((plan.num_unique, *values.shape[1:]))


def _bits(t):
    return t.view(torch.uint8)


@st.composite
def ranged_inputs(draw):
    """Ids over a narrow range (dense slot map) or a wide one (radix sort), at any offset."""
    n = draw(st.integers(2, 3000))  # (one id is a range of one: see the edge cases)
    narrow = draw(st.booleans())
    span = draw(st.integers(1, 4 * n)) if narrow else draw(st.integers(4 * n + 1, 50 * n + 10))
    base = draw(st.sampled_from([0, 1, 12345, 2**31 + 7]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        ids = zipf_ids(n, span, alpha=1.1, seed=seed)
    else:
        ids = torch.randint(0, span, (n,), generator=g)
    ids[0], ids[-1] = 0, span - 1  # the range is exactly `span`
    ids = ids + base
    if base < 2**31 and draw(st.booleans()):
        ids = ids.to(torch.int32)
    dtype = draw(st.sampled_from(VALUE_DTYPES))
    width = draw(st.sampled_from([(1,), (5,), (16,), (2, 3)]))
    values = torch.randn((n, *width), generator=g, dtype=torch.float64).to(dtype)
    return ids, values, narrow


@SETTINGS
@given(ranged_inputs(), st.integers(1, 4))
def test_dense_slot_map_and_radix_sort_give_the_same_bits(inp, threads):
    ids, values, narrow = inp
    dense, d_ids, d_sums = _coalesce_with(ids, values, -1, threads, True)
    assert dense == narrow  # narrow ranges take the slot map, wide ones the radix sort
    radix, r_ids, r_sums = _coalesce_with(ids, values, -1, threads, False)
    assert not radix
    assert torch.equal(d_ids, r_ids) and torch.equal(_bits(d_sums), _bits(r_sums))
    ref_ids, ref = _ref_coalesce(ids, values)
    assert torch.equal(d_ids.long(), ref_ids)
    # The registered op takes the same path and returns the same bits.
    o_ids, o_sums = ops.coalesce_rows(ids, values)
    assert torch.equal(o_ids, d_ids) and torch.equal(_bits(o_sums), _bits(d_sums))


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
@pytest.mark.parametrize("narrow", [True, False])
def test_coalesce_paths_are_bitwise_independent_of_thread_count(dtype, narrow):
    ids = zipf_ids(60_000, 100_000, alpha=1.1, seed=3)
    if not narrow:
        ids = ids * 10_007  # the same groups over a range far wider than 4 ids per row
    values = torch.randn(60_000, 9).to(dtype)
    values[::7] = -0.0  # a lone -0.0 must stay -0.0 on both paths
    results = [_coalesce_with(ids, values, -1, threads, True) for threads in (1, 2, 3, 4)]
    assert all(dense == narrow for dense, _, _ in results)
    for _, u, s in results[1:]:
        assert torch.equal(u, results[0][1]) and torch.equal(_bits(s), _bits(results[0][2]))
    _, u, s = _coalesce_with(ids, values, -1, 2, not narrow)  # the other path
    assert torch.equal(u, results[0][1]) and torch.equal(_bits(s), _bits(results[0][2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_large_outputs_keep_every_sum(dtype, threads):
    # Outputs of 4 MiB and more get huge-page advice before the sum (advise_huge_pages in coalesce.cpp;
    # fp16 also its float32 scratch): each element must still be its sum, the same bits as a coalesce of a
    # subset of the ids, whose output is too small for the advice.
    n = 300_000
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 1_000_000, (n,), generator=g)
    ids[:1000] = ids[1000:2000]  # some ids repeat
    values = torch.randn(n, 16, generator=g).to(dtype)
    dense, u, s = _coalesce_with(ids, values, -1, threads, True)
    radix, r_u, r_s = _coalesce_with(ids, values, -1, threads, False)
    assert dense and not radix and s.numel() * s.element_size() >= 4 << 20
    assert torch.equal(u, r_u) and torch.equal(_bits(s), _bits(r_s))
    small = ids < 100_000
    _, small_u, small_s = _coalesce_with(ids[small], values[small], -1, threads, True)
    assert small_s.numel() * small_s.element_size() < 4 << 20
    k = small_u.numel()
    assert torch.equal(u[:k], small_u) and torch.equal(_bits(s[:k]), _bits(small_s))
    ref_u, ref = _ref_coalesce(ids, values)
    assert torch.equal(u, ref_u) and torch.allclose(s.double(), ref, atol=_tol(dtype, 4), rtol=0)


def test_dense_slot_map_edge_cases():
    values = torch.randn(3, 2)
    # Empty input: no groups, nothing written.
    dense, u, s = _coalesce_with(torch.empty(0, dtype=torch.int64), values[:0], 10, 2, True)
    assert u.numel() == 0 and s.shape == (0, 2)
    # One id repeated: a range of one.
    dense, u, s = _coalesce_with(torch.tensor([7, 7, 7]), values, 10, 2, True)
    assert dense and u.tolist() == [7] and torch.equal(s[0], values[0] + values[1] + values[2])
    # Negative ids and ids past the bound are refused on the dense path too, before any write.
    for bad, bound in (([3, -1, 2], -1), ([3, 10, 2], 10)):
        with pytest.raises(ValueError, match="outside"):
            _coalesce_with(torch.tensor(bad), values, bound, 2, True)
    # NaN and Inf go through the slot map like any value.
    v = torch.tensor([[float("nan")], [1.0], [float("inf")], [2.0]])
    _, u, s = _coalesce_with(torch.tensor([4, 4, 5, 6]), v, -1, 1, True)
    assert u.tolist() == [4, 5, 6] and s[0].isnan().all() and s[1].item() == float("inf") and s[2].item() == 2.0


# ---------------------------------------------------------- row-wise Adagrad


def _rowwise_adagrad_ref(weight, acc, slots, grad, lr, eps):
    """The rule in float64 torch ops on copies: (weight, acc) after one update."""
    w, a, g = weight.double().clone(), acc.double().clone(), grad.double()
    a[slots] += g.pow(2).mean(dim=1)
    w[slots] += g / (a[slots].sqrt() + eps).unsqueeze(1) * -lr
    return w, a


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_rowwise_adagrad_matches_the_float64_rule(dtype, threads):
    g = torch.Generator().manual_seed(3)
    V, d = 5000, 64
    weight = torch.randn(V, d, generator=g).to(dtype)
    acc = torch.rand(V, generator=g).to(dtype)
    slots = torch.unique(torch.randint(0, V, (3000,), generator=g))          # sorted, distinct
    grad = torch.randn(slots.numel(), d, generator=g).to(dtype)
    want_w, want_a = _rowwise_adagrad_ref(weight, acc, slots, grad, 0.05, 1e-8)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, a = weight.clone(), acc.clone()
        ops.rowwise_adagrad_(w, a, slots, grad, 0.05, 1e-8)
    finally:
        torch.set_num_threads(old)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(w.double(), want_w, rtol=tol, atol=tol)
    assert torch.allclose(a.double(), want_a, rtol=tol, atol=tol)
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(w[untouched], weight[untouched]) and torch.equal(a[untouched], acc[untouched])


def test_rowwise_adagrad_refuses_bad_slots_before_writing():
    weight, acc, grad = torch.randn(10, 4), torch.rand(10), torch.randn(3, 4)
    for slots, match in (([1, 10, 2], "outside"), ([-1, 2, 3], "outside"), ([1, 1, 2], "strictly increasing"),
                         ([3, 2, 5], "strictly increasing")):
        w, a = weight.clone(), acc.clone()
        with pytest.raises(ValueError, match=match):
            ops.rowwise_adagrad_(w, a, torch.tensor(slots), grad, 0.1, 1e-8)
        assert torch.equal(w, weight) and torch.equal(a, acc)
    with pytest.raises(TypeError, match="float32/float64"):
        ops.rowwise_adagrad_(weight.half(), acc.half(), torch.tensor([1]), grad[:1].half(), 0.1, 1e-8)
    with pytest.raises(TypeError, match="int64"):
        ops.rowwise_adagrad_(weight, acc, torch.tensor([1], dtype=torch.int32), grad[:1], 0.1, 1e-8)
    ops.rowwise_adagrad_(weight, acc, torch.empty(0, dtype=torch.int64), grad[:0], 0.1, 1e-8)   # nothing to do


def test_take_rows_views_a_run_and_gathers_the_rest():
    table = torch.arange(40.0).view(10, 4)
    run = ops.take_rows(table, torch.tensor([3, 4, 5]))
    assert torch.equal(run, table[3:6]) and run.data_ptr() == table[3].data_ptr()   # a view, no copy
    scattered = torch.tensor([0, 2, 9])
    assert torch.equal(ops.take_rows(table, scattered), table[scattered])
    for ids in (torch.tensor([3, 4, 5]), scattered, torch.zeros(0, dtype=torch.int64)):
        out = torch.full((ids.numel(), 4), -1.0)
        got = ops.take_rows(table, ids, out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, table[ids])
        halves = torch.zeros((ids.numel(), 4), dtype=torch.float64)   # another dtype: converted into out
        assert torch.equal(ops.take_rows(table, ids, out=halves), table[ids].double())
