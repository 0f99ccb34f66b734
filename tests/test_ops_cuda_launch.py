"""Every CUDA kernel registered in sparsecomm._library, run on a machine without a GPU.

The host code of each CUDA kernel (sorting, allocation, grid size, the kernel's
name and argument list) runs on CPU tensors, with CuPy replaced by a stand-in
that resolves the kernel by name through ``sparsecomm._cuda.KERNELS`` (read
from the .cu sources) and the source file that table names, checks each
argument against the parameter the source declares (count, order of kinds,
widths), and runs a Python model of the kernel on the CPU tensors' memory.
The result must equal the CPU operator's, bitwise: the kernels are written to
match the C++ kernels bit for bit, and the models follow the .cu code (sums
left to right in input order from the first row or the table's value, fp16/bf16
in float32 rounded once).

What this cannot see is the device code itself: tests/test_cuda_compile.py
compiles it, tests/test_gpu_kernels.py runs it where there is a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from types import SimpleNamespace

import numpy
import pytest
import torch

from sparsecomm import _C, _cuda
from sparsecomm._library import _rows
from sparsecomm._library._registry import cuda_kernels, op_names

VALUE = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16}
ID = {"i32": torch.int32, "i64": torch.int64}
UNIT = {"u8": 1, "u16": 2, "u32": 4, "u64": 8, "u128": 16}
# Small blocks and a small cap, so that the grid tells the elements a launch covers and some grids are capped.
BLOCK = 4
MAX_BLOCKS = 8
SCALAR = {"long long": numpy.int64, "int": numpy.int32}


def _memory(address, dtype: torch.dtype, count: int) -> torch.Tensor:
    """A CPU tensor over ``count`` elements at ``address`` (a kernel argument)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_byte * (count * size)).from_address(int(address)), dtype=dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _groups(order, seg_start, num_groups):
    seg = _memory(seg_start, torch.int64, int(num_groups) + 1).tolist()
    rows = _memory(order, torch.int64, seg[-1]).tolist()
    return [rows[seg[g]:seg[g + 1]] for g in range(int(num_groups))], (max(rows) + 1 if rows else 0)


# ---- models of the kernels in csrc/cuda/*.cu; each returns the elements its grid covers ----


def _sum_group(tab_or_none, vals, members, dtype):
    """A group's sum as the kernels add it: from the table's value or the first row, left to right."""
    acc = tab_or_none.to(_acc(dtype)) if tab_or_none is not None else vals[members[0]].to(_acc(dtype))
    for i in members if tab_or_none is not None else members[1:]:
        acc = acc + vals[i].to(_acc(dtype))
    return acc.to(dtype)


def _list_long(groups, long_rows, long_groups, num_long, capacity):
    """What the short kernels do with the groups of more than ``long_rows`` rows: list them for the long kernels,
    here last group first (the device's atomics give no fixed order, and none may matter). The rest: {g: rows}."""
    long = [g for g, m in enumerate(groups) if len(m) > int(long_rows)][::-1]
    assert len(long) <= int(capacity), "the host sized the list for every possible long group"
    _memory(long_groups, torch.int64, len(long))[:] = torch.tensor(long, dtype=torch.int64)
    _memory(num_long, torch.int64, 1)[0] = len(long)
    return {g: m for g, m in enumerate(groups) if len(m) <= int(long_rows)}


def _listed(order, seg_start, long_groups, num_long):
    """The listed groups (long_groups[:*num_long]) as {group: its rows}, and the number of value rows they reach."""
    listed = _memory(long_groups, torch.int64, int(_memory(num_long, torch.int64, 1)[0])).tolist()
    if not listed:
        return {}, 0
    seg = _memory(seg_start, torch.int64, max(listed) + 2).tolist()
    rows = _memory(order, torch.int64, seg[-1]).tolist()
    members = {g: rows[seg[g]:seg[g + 1]] for g in listed}
    return members, 1 + max(max(m) for m in members.values())


def _coalesce_rows(suffix, values, order, seg_start, num_groups, d, long_rows, long_groups, num_long, capacity, out):
    dtype, d = VALUE[suffix], int(d)
    groups, rows = _groups(order, seg_start, num_groups)
    vals = _memory(values, dtype, rows * d).view(rows, d)
    sums = _memory(out, dtype, len(groups) * d).view(len(groups), d)
    for g, members in _list_long(groups, long_rows, long_groups, num_long, capacity).items():
        sums[g] = _sum_group(None, vals, members, dtype)
    return len(groups) * d


def _coalesce_rows_long(suffix, values, order, seg_start, long_groups, num_long, capacity, d, out):
    dtype, d = VALUE[suffix], int(d)
    members, rows = _listed(order, seg_start, long_groups, num_long)
    vals = _memory(values, dtype, rows * d).view(rows, d)
    sums = _memory(out, dtype, (max(members, default=-1) + 1) * d).view(-1, d)
    for g, m in members.items():
        sums[g] = _sum_group(None, vals, m, dtype)
    return int(capacity) * -(-d // BLOCK) * BLOCK


def _scatter_add_rows(suffix, table, num_rows, group_id, values, order, seg_start, num_groups, d, long_rows,
                      long_groups, num_long, capacity):
    groups, rows = _groups(order, seg_start, num_groups)
    short = _list_long(groups, long_rows, long_groups, num_long, capacity)
    _scatter_into(suffix, table, num_rows, group_id, values, short, rows, d)
    return len(groups) * int(d)


def _scatter_add_rows_long(suffix, table, num_rows, group_id, values, order, seg_start, long_groups, num_long,
                           capacity, d):
    members, rows = _listed(order, seg_start, long_groups, num_long)
    _scatter_into(suffix, table, num_rows, group_id, values, members, rows, d)
    return int(capacity) * -(-int(d) // BLOCK) * BLOCK


def _scatter_into(suffix, table, num_rows, group_id, values, groups, rows, d):
    value_suffix, id_suffix = suffix.split("_")
    dtype, d, num_rows = VALUE[value_suffix], int(d), int(num_rows)
    vals = _memory(values, dtype, rows * d).view(rows, d)
    tab = _memory(table, dtype, num_rows * d).view(num_rows, d)
    ids = _memory(group_id, ID[id_suffix], max(groups, default=-1) + 1).tolist()
    for g, members in groups.items():
        if 0 <= ids[g] < num_rows:
            tab[ids[g]] = _sum_group(tab[ids[g]], vals, members, dtype)


def _partition_owners(suffix, ids, n, scheme, num_owners, range_size, stride, owners, counts, block_bins,
                      shared_mem):
    n, num_owners = int(n), int(num_owners)
    assert shared_mem == (8 * num_owners if block_bins else 0), "block bins need 8 bytes of shared memory an owner"
    out, hist = _memory(owners, torch.int32, n), _memory(counts, torch.int64, num_owners)
    for i, x in enumerate(_memory(ids, ID[suffix], n).tolist()):
        owner = _C.row_owner(x, int(scheme), num_owners, int(range_size), int(stride))
        out[i] = owner
        hist[owner] += 1
    return n


def _gather_rows(suffix, table, num_rows, ids, n, row_units, out):
    unit_suffix, id_suffix = suffix.split("_")
    unit, num_rows, n, row_units = UNIT[unit_suffix], int(num_rows), int(n), int(row_units)
    assert int(table) % unit == 0 and int(out) % unit == 0, "copy units must be aligned on both sides"
    tab = _memory(table, torch.uint8, num_rows * row_units * unit).view(num_rows, -1)
    dst = _memory(out, torch.uint8, n * row_units * unit).view(n, -1)
    for i, row in enumerate(_memory(ids, ID[id_suffix], n).tolist()):
        dst[i] = tab[row] if 0 <= row < num_rows else 0
    return n * row_units


# Longer prefixes first: a kernel takes the first model whose prefix its name starts with.
MODELS = {"sparsecomm_coalesce_rows_long_": _coalesce_rows_long, "sparsecomm_coalesce_rows_": _coalesce_rows,
          "sparsecomm_scatter_add_rows_long_": _scatter_add_rows_long,
          "sparsecomm_scatter_add_rows_": _scatter_add_rows,
          "sparsecomm_partition_owners_": _partition_owners, "sparsecomm_gather_rows_": _gather_rows}


# ---- CuPy's stand-in ----------------------------------------------------------------


def _check_argument(declaration: str, arg) -> None:
    if "*" in declaration:
        assert type(arg) is numpy.uint64, f"{declaration}: a pointer goes as numpy.uint64, got {type(arg)}"
    else:
        kind = declaration.rsplit(None, 1)[0]
        assert type(arg) is SCALAR[kind], f"{declaration}: expected {SCALAR[kind]}, got {type(arg)}"


class _Kernel:
    def __init__(self, gpu, name, declarations):
        self.gpu, self.name, self.declarations = gpu, name, declarations

    def __call__(self, grid, block, args, shared_mem=0):
        assert len(args) == len(self.declarations), (self.name, len(args), self.declarations)
        for declaration, arg in zip(self.declarations, args):
            _check_argument(declaration, arg)
        prefix = next(p for p in MODELS if self.name.startswith(p))
        extra = (shared_mem,) if prefix == "sparsecomm_partition_owners_" else ()
        if not extra:
            assert shared_mem == 0, self.name
        total = MODELS[prefix](self.name[len(prefix):], *args, *extra)
        assert total > 0, f"{self.name} launched over nothing"
        assert block == (BLOCK,) and grid == (min(-(-total // BLOCK), MAX_BLOCKS),), (self.name, grid, total)
        self.gpu.launched.append(self.name)


class _Module:
    def __init__(self, gpu, code, options):
        assert options == _cuda.NVRTC_OPTIONS
        self.gpu, self.file = gpu, re.match(r'#line 1 "([^"]+)"', code).group(1)
        self.declarations = _cuda.kernel_declarations(code)
        gpu.loaded.append(self.file)

    def get_function(self, name):
        assert name in self.declarations, f"{self.file} defines no kernel {name}"
        assert name in _cuda.KERNELS[self.file], name
        return _Kernel(self.gpu, name, self.declarations[name])


class EmulatedGpu:
    """What CuPy's launch path is asked for: modules by source, kernels by name, launches."""

    def __init__(self):
        self.launched, self.loaded = [], []
        self.cuda = SimpleNamespace(Device=lambda index: contextlib.nullcontext(),
                                    ExternalStream=lambda handle: contextlib.nullcontext())

    def RawModule(self, code, options):  # noqa: N802  (CuPy's name)
        return _Module(self, code, options)


@pytest.fixture
def gpu(monkeypatch) -> EmulatedGpu:
    fake = EmulatedGpu()
    monkeypatch.setattr(_cuda, "_cupy", lambda: fake)
    monkeypatch.setattr(_cuda, "_device_index", lambda device: 0)
    monkeypatch.setattr(_cuda, "BLOCK", BLOCK)
    monkeypatch.setattr(_cuda, "_max_blocks", lambda device: MAX_BLOCKS)
    monkeypatch.setattr(_cuda, "_stream_handle", lambda device: 0)
    monkeypatch.setattr(_rows, "LONG_ROWS", 2)   # the cases' groups of 3+ rows take the long-group kernels
    # The compiled-kernel caches would otherwise keep the stand-in's kernels for the package.
    monkeypatch.setattr(_cuda, "_modules", {})
    monkeypatch.setattr(_cuda, "_functions", {})
    return fake


# ---- the cases: every registered op, every kernel --------------------------------------


def _ids(n, num_rows, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_rows, (n,), generator=g).to(dtype)


def _values(n, d, dtype, seed):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _segment_buffers():
    """Receive buffers and their segments: int32 ids with float32 rows; int16 ids with float16 rows."""
    # Two segments of 2 ids each, their rows of 3 values (test_library's layout).
    wide = torch.zeros(96, dtype=torch.uint8)
    wide[:16].view(torch.int32).copy_(torch.tensor([2, 0, 2, 1], dtype=torch.int32))
    wide[16:64].view(torch.float32).copy_(torch.arange(12.0))
    # Segments of 3 and 2 ids (bytes 0 and 8) and their rows of 2 values (bytes 16 and 32).
    narrow = torch.zeros(48, dtype=torch.uint8)
    narrow[:6].view(torch.int16).copy_(torch.tensor([4, 1, 4], dtype=torch.int16))
    narrow[8:12].view(torch.int16).copy_(torch.tensor([1, 0], dtype=torch.int16))
    narrow[16:28].view(torch.float16).copy_(_values(3, 2, torch.float16, 5).view(-1))
    narrow[32:40].view(torch.float16).copy_(_values(2, 2, torch.float16, 6).view(-1))
    return (wide, [2, 0, 16, 2, 8, 40]), (narrow, [3, 0, 16, 2, 8, 32])


def _cases():
    """(op name, arguments) covering every op and every kernel (dtype, id dtype, copy unit, bin place)."""
    cases = []
    for i, id_dtype in enumerate((torch.int32, torch.int64)):
        ids = _ids(40, 13, id_dtype, i)
        for j, dtype in enumerate(VALUE.values()):
            values = _values(40, 3, dtype, 10 * i + j)
            cases += [("coalesce", (ids, values, 13)), ("coalesce_partition", (ids, values, 13, 3, 0, 1, 1)),
                      ("scatter_add_", (_values(13, 3, dtype, 99), ids, values))]
        # hash, range; 5000 owners: the counts go straight to global memory, not through block bins.
        for scheme, owners, range_size in ((0, 3, 4), (1, 3, 5), (1, 5000, 1)):
            cases += [("partition", (ids, None, 13, owners, scheme, range_size, 2)),
                      ("partition", (ids, _values(40, 2, torch.float64, i), 13, owners, scheme, range_size, 1))]
        # Rows of 1, 2, 4, 8 and 16 bytes reach every copy unit; 6 bytes take 2-byte units.
        for dtype, d in ((torch.uint8, 1), (torch.float16, 1), (torch.float32, 1), (torch.float64, 1),
                         (torch.float32, 4), (torch.float16, 3)):
            cases.append(("gather", (_values(13, d, torch.float64, d).abs().mul(9).to(dtype), ids)))
        # 16-byte rows 4 bytes past a 16-byte boundary: only 4-byte units are aligned.
        cases.append(("gather", (_values(13 * 4 + 1, 1, torch.float32, 4).view(-1)[1:].view(13, 4), ids)))
    ids = _ids(24, 9, torch.int64, 7)
    (wide, wide_segments), (narrow, narrow_segments) = _segment_buffers()
    cases += [
        ("rowwise_adagrad_", (_values(9, 4, torch.float32, 1), torch.rand(9), torch.tensor([0, 2, 3, 8]),
                              _values(4, 4, torch.float32, 2), 0.1, 1e-8)),
        ("group_by", (ids, 9)),
        ("bag_groups", (ids, torch.tensor([3, 0, 23, 5, 5]), torch.tensor([2, 0, 3]), 9)),
        ("unique_inverse", (ids, 9)),
        ("pooled_request", (ids, torch.arange(24) // 5, 9, 2, 1, 5, 1, 5)),
        ("pack_rows_", (torch.zeros(128, dtype=torch.uint8), _values(24, 3, torch.float32, 3), ids,
                        [0, 2, 0, 2, 2, 48], 0)),
        ("pack_rows_", (torch.zeros(64, dtype=torch.uint8), ids, None, [0, 4, 8], 2)),
        ("unpack_rows_", (torch.zeros(5, 3, dtype=torch.float16), torch.arange(64, dtype=torch.uint8),
                          [2, 3, 8, 0, 2, 40], )),
        ("unpack_rows_", (torch.zeros(4, dtype=torch.int64), torch.arange(64, dtype=torch.uint8), [0, 4, 16])),
        ("coalesce_segments", (wide, wide_segments, 4, torch.float32, 3, 5, torch.int64, False)),
        ("coalesce_segments", (narrow, narrow_segments, 2, torch.float16, 2, 5, torch.int32, False)),
        ("coalesce_segments", (narrow, narrow_segments, 2, torch.float16, 2, 5, torch.int64, True)),
    ]
    return cases


def _clone(args):
    """Copies of the tensors (in-place ops write them) at the same offset into their storage (alignment)."""
    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.new_empty(t.storage_offset() + t.numel())[t.storage_offset():].view(t.shape).copy_(t)

    return tuple(clone(a) if isinstance(a, torch.Tensor) else a for a in args)


def _flat(result, args):
    """An op's outputs, with the arguments an in-place op wrote."""
    out = list(result) if isinstance(result, tuple) else [result]
    return [t for t in out + list(args) if isinstance(t, torch.Tensor)]


def _assert_same(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def test_every_op_has_a_cuda_kernel_and_a_case_here():
    assert set(cuda_kernels()) == set(op_names())
    assert {name for name, _ in _cases()} == set(op_names()), "a new op needs its cases in _cases()"


def test_cuda_kernels_on_cpu_tensors_equal_the_cpu_kernels(gpu):
    for name, args in _cases():
        cuda_args, cpu_args = _clone(args), _clone(args)
        got = _flat(cuda_kernels()[name](*cuda_args), cuda_args)
        want = _flat(getattr(torch.ops.sparsecomm, name)(*cpu_args), cpu_args)
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            if name == "rowwise_adagrad_":  # torch's ops on CUDA round differently in the last bit
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
            else:
                _assert_same(g, w, name)
    every = {kernel for names in _cuda.KERNELS.values() for kernel in names}
    assert set(gpu.launched) == every, f"kernels no op launches: {sorted(every - set(gpu.launched))}"
    assert sorted(set(gpu.loaded)) == sorted(gpu.loaded) == sorted(_cuda.KERNELS), "each source compiled once"


def test_empty_inputs_launch_nothing(gpu):
    kernels = cuda_kernels()
    ids = torch.empty(0, dtype=torch.int64)
    values = torch.empty(0, 7, dtype=torch.float16)
    u_ids, sums = kernels["coalesce"](ids, values, 5)
    assert u_ids.shape == (0,) and u_ids.dtype == torch.int64
    assert sums.shape == (0, 7) and sums.dtype == torch.float16
    counts, p_ids, p_values, perm = kernels["partition"](ids, values, 5, 4, 0, 1, 1)
    assert counts.tolist() == [0, 0, 0, 0] and p_ids.numel() == 0
    assert p_values.shape == (0, 7) and perm.dtype == torch.int64 and perm.numel() == 0
    assert kernels["gather"](torch.zeros(3, 7), ids).shape == (0, 7)
    assert kernels["gather"](torch.zeros(3, 0), torch.tensor([1, 2])).shape == (2, 0)
    table = torch.zeros(3, 7)
    kernels["scatter_add_"](table, ids, torch.empty(0, 7))
    assert not table.any()
    assert gpu.launched == [] and gpu.loaded == []


def test_partition_rejects_a_bad_owner_map_before_launching(gpu):
    ids = torch.tensor([1, 2])
    for args in ((0, 0, 1, 1), (2, 9, 1, 1), (2, 0, 1, 0), (2, 1, 0, 1), (2, 2, -1, 1)):
        with pytest.raises(ValueError):
            _rows.partition_rows_cuda(ids, None, *args)
    assert gpu.launched == []


def test_a_kernel_no_source_defines_is_refused_by_name(gpu):
    with pytest.raises(KeyError, match="defines a kernel named 'sparsecomm_no_such_kernel'"):
        _cuda.launch(torch.device("cuda", 0), "sparsecomm_no_such_kernel", 1, ())
    assert gpu.loaded == []
