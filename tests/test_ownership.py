"""The one ownership map: sparsecomm/ownership.py for Python, csrc/owner_map.h for the C++ and CUDA kernels.

Names, codes, the range scheme's ``ceil(V / N)`` and the validation live in
ownership.py; these tests check that the header's codes are the same numbers,
that the kernels accept exactly the codes Python knows, and that ops,
the CUDA loader and the sharded layout take their map from ownership.py.
"""

import re
from pathlib import Path

import pytest
import torch

from sparsecomm import _C, ops, ownership
from sparsecomm._library._rows import partition_rows_cuda
from sparsecomm.ownership import OwnerMap
from sparsecomm.sharded.layout import RowLayout
from sparsecomm.types import PartitionScheme

OWNER_MAP_H = Path(__file__).resolve().parent.parent / "csrc" / "owner_map.h"


def _header_codes() -> dict:
    defines = re.findall(r"^#define SPARSECOMM_SCHEME_(\w+) (\d+)$", OWNER_MAP_H.read_text(), re.M)
    return {name.lower(): int(code) for name, code in defines}


def test_the_header_gives_every_scheme_the_code_python_gives_it():
    assert _header_codes() == {s.value: ownership.scheme_code(s) for s in PartitionScheme}


def test_names_and_codes_round_trip():
    for scheme in PartitionScheme:
        assert ownership.scheme_of(scheme.value) is scheme
        assert ownership.scheme_from_code(ownership.scheme_code(scheme)) is scheme
        assert ownership.describe_code(ownership.scheme_code(scheme)) == scheme.value
    codes = sorted(ownership.scheme_code(s) for s in PartitionScheme)
    assert codes == list(range(len(codes))), "codes are 0, 1, ... with no gap"
    with pytest.raises(ValueError, match="'hash', 'range'"):
        ownership.scheme_of("modulo")
    with pytest.raises(ValueError, match="no partition scheme has code 7"):
        ownership.scheme_from_code(7)
    assert ownership.describe_code(7) == "7"  # a third code is not labelled "hash"


def test_the_kernels_accept_exactly_the_codes_python_knows():
    known = [ownership.scheme_code(s) for s in PartitionScheme]
    for code in known:
        assert 0 <= _C.row_owner(12345, code, 3, 10, 1) < 3
    for code in (-1, max(known) + 1):
        with pytest.raises(ValueError, match="unknown partition scheme"):
            _C.row_owner(1, code, 3, 10, 1)
        with pytest.raises(ValueError, match="no partition scheme has code"):
            partition_rows_cuda(torch.empty(0, dtype=torch.int64), None, 3, code, 10, 1)


@pytest.mark.parametrize("rows,owners,want", [(10, 4, 3), (12, 4, 3), (1, 8, 1), (0, 3, 1), (2**40 + 1, 2, 2**39 + 1)])
def test_range_size_is_ceil_rows_over_owners_at_least_one(rows, owners, want):
    assert ownership.range_size(rows, owners) == want
    assert ownership.owner_range_size("range", owners, rows) == want
    assert ownership.owner_range_size("hash", owners, rows) == 1


def test_range_size_refuses_what_it_cannot_size():
    with pytest.raises(ValueError, match="num_owners must be >= 1"):
        ownership.range_size(10, 0)
    with pytest.raises(ValueError, match="needs num_rows"):
        ownership.owner_range_size("range", 2, None)
    with pytest.raises(ValueError, match="range_size must be >= 1"):
        ownership.owner_range_size("range", 2, 10, 0)
    assert ownership.owner_range_size("range", 2, None, 5) == 5


def test_owner_map_of_is_what_the_kernels_take():
    assert OwnerMap.of(4, "range", 10) == (4, 1, 3, 1)
    assert OwnerMap.of(4, PartitionScheme.RANGE, 10, 7, stride=2) == (4, 1, 7, 2)
    assert OwnerMap.of(4, "hash", 10, 7) == (4, 0, 1, 1), "the hash scheme has no range size"
    assert OwnerMap.of(3, "hash").check() == (3, 0, 1, 1)
    assert ops._owner_map(4, "range", 10, None, 1) == (1, 3)


@pytest.mark.parametrize("args,match", [
    ((0, "hash"), "num_owners must be a positive int"),
    ((2.0, "hash"), "num_owners must be a positive int"),
    ((2, "modulo"), "scheme must be one of"),
    ((2, "hash", None, None, 0), "stride must be a positive int"),
    ((2, "range"), "needs num_rows"),
    ((2, "range", 10, 0), "range_size must be >= 1"),
])
def test_owner_map_of_names_the_bad_argument(args, match):
    with pytest.raises(ValueError, match=match):
        OwnerMap.of(*args)


@pytest.mark.parametrize("fields,match", [
    ((2, 9, 1, 1), "no partition scheme has code 9"),
    ((0, 0, 1, 1), "num_owners must be >= 1"),
    ((2, 0, 1, 0), "stride must be >= 1"),
    ((2, 1, 0, 1), "range_size must be >= 1"),
])
def test_owner_map_check_refuses_what_the_kernels_refuse(fields, match):
    with pytest.raises(ValueError, match=match):
        OwnerMap(*fields).check()
    num_owners, code, range_size, stride = fields
    with pytest.raises(ValueError):
        _C.row_owner(1, code, num_owners, range_size, stride)


def test_hash_scheme_ignores_range_size_in_every_kernel():
    ids = torch.arange(1000, dtype=torch.int64)
    base = ops.row_owners(ids, 5, "hash")
    assert torch.equal(ops.row_owners(ids, 5, "hash", range_size=3), base)
    assert torch.equal(ops.row_owners(ids, 5, "hash", 1000, range_size=0), base)


@pytest.mark.parametrize("rows,world", [(10, 4), (1000, 7), (5, 8), (2**20 + 3, 3)])
def test_ops_and_the_sharded_layout_use_the_same_range_map(rows, world):
    size = ownership.range_size(rows, world)
    ids = torch.unique(torch.cat([torch.arange(min(rows, 4096)), torch.randint(0, rows, (4096,))]))
    want = (ids // size) % world
    assert torch.equal(ops.row_owners(ids, world, "range", rows), want)
    for rank in range(world):
        layout = RowLayout(rows, world, rank, "range")
        assert layout.range_size == size
        assert torch.equal(layout.owns(ids), want == rank)
    with pytest.raises(ValueError, match="scheme must be one of"):
        RowLayout(rows, world, 0, "modulo")
