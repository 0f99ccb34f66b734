"""Owner pooling's index kernels (ops.group_by, ops.bag_groups, ops.unique_inverse, ops.pooled_request) against torch.

Every output must equal the torch reference exactly (values and dtypes): the references below are the torch
ops the kernels replace, written as sparsecomm/sharded/lookup.py computes them. The registered CUDA kernels
(``_library.*_torch``, torch ops on any device) are checked against the same references on CPU tensors.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsecomm import _library, ops, ownership
from sparsecomm.synthetic import zipf_ids

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- references


def ref_group_by(index, size):
    order = torch.argsort(index, stable=True)
    count = torch.bincount(index, minlength=size)
    return order, torch.cumsum(count, 0) - count


def ref_bag_groups(key, positions, lengths, size):
    group = key[positions]
    order = torch.argsort(group, stable=True)
    bag_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    count = torch.bincount(group, minlength=size)
    return order, bag_of[order], torch.cumsum(count, 0) - count


def ref_unique_inverse(ids):
    return torch.unique(ids, sorted=True, return_inverse=True)


def ref_pooled_request(ids, bag_of, n, scheme, num_rows, range_size, num_bags, stride=1):
    occ = ops.partition_rows(ids, None, n, scheme, num_rows, range_size=range_size, stride=stride)
    order, occ_counts = occ.perm, occ.counts
    uniques, positions = [], []
    for seg in torch.split(occ.ids, occ_counts.tolist()):
        u, pos = torch.unique(seg, sorted=True, return_inverse=True)
        uniques.append(u)
        positions.append(pos.to(torch.int32))
    unique_counts = torch.tensor([u.numel() for u in uniques], dtype=torch.int64)
    unique = torch.cat(uniques)
    bag_occ = bag_of[order]
    owner_occ = torch.repeat_interleave(torch.arange(n), occ.counts)
    nb = max(num_bags, 1)
    keys, lengths = torch.unique_consecutive(owner_occ * nb + bag_occ, return_counts=True)
    return ops.PooledPlan(unique, unique_counts, order, occ_counts, torch.cat(positions), keys % nb,
                          lengths.to(torch.int32), torch.bincount(keys // nb, minlength=n))


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, (i, g.dtype, w.dtype)
        assert torch.equal(g, w), (i, g, w)


class threads:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ group_by


GROUP_CASES = {
    "random": lambda: (torch.randint(0, 300, (5000,), generator=_gen(1)), 300),
    "sparse_groups": lambda: (torch.randint(0, 10_000, (50,), generator=_gen(2)), 10_000),
    "zipf": lambda: (torch.unique(zipf_ids(40_960, 100_000, seed=3), return_inverse=True)[1], 100_000),
    "empty": lambda: (torch.empty(0, dtype=torch.int64), 0),
    "empty_with_groups": lambda: (torch.empty(0, dtype=torch.int64), 7),
    "single": lambda: (torch.tensor([4]), 5),
    "identical": lambda: (torch.full((3000,), 2, dtype=torch.int64), 3),
}


@pytest.mark.parametrize("case", sorted(GROUP_CASES))
@pytest.mark.parametrize("nthreads", [1, 2])
def test_group_by_equals_stable_argsort_and_offsets(case, nthreads):
    index, size = GROUP_CASES[case]()
    with threads(nthreads):
        got = ops.group_by(index, size)
    assert_same(got, ref_group_by(index, size))
    assert_same(_library.group_by_torch(index, size), ref_group_by(index, size))


def test_group_by_refuses_bad_input():
    for index, size, bad in (([0, 3, 1], 3, "3"), ([0, -2, 1], 3, "-2"), ([0], 0, "0")):
        with pytest.raises(ValueError, match=f"index contains id {bad} outside"):
            ops.group_by(torch.tensor(index), size)
    with pytest.raises(ValueError, match="size must be >= 0"):
        ops.group_by(torch.tensor([0]), -1)
    with pytest.raises(TypeError, match="int64"):
        ops.group_by(torch.tensor([0], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="1-D"):
        ops.group_by(torch.zeros(2, 2, dtype=torch.int64), 1)


# ---------------------------------------------------------------- bag_groups


def _lengths(n, bags, seed):
    """``bags`` run lengths (some empty) adding up to ``n``."""
    cuts = torch.sort(torch.randint(0, n + 1, (max(bags - 1, 0),), generator=_gen(seed))).values
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([n])])
    return bounds[1:] - bounds[:-1] if bags else torch.empty(0, dtype=torch.int64)


def _bag_case(r, size, n, bags, seed):
    key = torch.randint(0, size, (r,), generator=_gen(seed)) if r else torch.empty(0, dtype=torch.int64)
    positions = torch.randint(0, r, (n,), generator=_gen(seed + 1)) if n else torch.empty(0, dtype=torch.int64)
    return key, positions, _lengths(n, bags, seed + 2), size


BAG_CASES = {
    "lookup": lambda: _bag_case(12_000, 9_000, 40_960, 2048, 5),   # 2 requesters' bags of 20 at one owner
    "few_groups": lambda: _bag_case(500, 3, 5000, 100, 6),
    "many_groups": lambda: _bag_case(50, 10_000, 60, 7, 7),
    "empty": lambda: _bag_case(0, 0, 0, 0, 8),
    "no_occurrences": lambda: _bag_case(10, 4, 0, 3, 9),
    "one_bag": lambda: _bag_case(30, 30, 100, 1, 10),
}


@pytest.mark.parametrize("case", sorted(BAG_CASES))
@pytest.mark.parametrize("nthreads", [1, 2])
def test_bag_groups_equals_argsort_and_repeat_interleave(case, nthreads):
    key, positions, lengths, size = BAG_CASES[case]()
    with threads(nthreads):
        got = ops.bag_groups(key, positions, lengths, size)
    assert_same(got, ref_bag_groups(key, positions, lengths, size))
    assert_same(_library.bag_groups_torch(key, positions, lengths, size), ref_bag_groups(key, positions, lengths, size))


def test_bag_groups_refuses_bad_input():
    key, one = torch.tensor([0, 2]), torch.tensor([1])
    with pytest.raises(ValueError, match="key contains id 2 outside"):
        ops.bag_groups(key, torch.tensor([0]), one, 2)
    with pytest.raises(ValueError, match="positions contains id 2 outside"):
        ops.bag_groups(key, torch.tensor([2]), one, 3)
    with pytest.raises(ValueError, match="add up to 1, not the 2"):
        ops.bag_groups(key, torch.tensor([0, 1]), one, 3)
    with pytest.raises(ValueError, match="bag 0 has -1"):
        ops.bag_groups(key, torch.tensor([0]), torch.tensor([-1, 2]), 3)
    with pytest.raises(ValueError, match="size must be >= 0"):
        ops.bag_groups(key, torch.tensor([0]), one, -1)
    with pytest.raises(TypeError, match="int64"):
        ops.bag_groups(key, torch.tensor([0], dtype=torch.int32), one, 3)


# ------------------------------------------------------------ unique_inverse


BIG = 1 << 40
UNIQUE_CASES = {
    "random": lambda: (torch.randint(0, 1000, (3000,), generator=_gen(1)), 1000),
    "zipf_1M": lambda: (zipf_ids(40_960, 1_000_000, seed=4), 1_000_000),
    "distinct_12k": lambda: (torch.randperm(1_000_000, generator=_gen(5))[:12_000], 1_000_000),
    "wide_small": lambda: (torch.randint(0, BIG, (500,), generator=_gen(6)), BIG),            # comparison sort
    "wide_radix": lambda: (torch.randint(0, BIG, (5000,), generator=_gen(7)) // 7, BIG),     # 64-bit radix sort
    "wide_radix32": lambda: (torch.randint(0, 1 << 28, (3000,), generator=_gen(8)), 1 << 28),  # 32-bit radix
    "near_num_rows": lambda: (BIG - 1 - torch.randint(0, 5000, (4000,), generator=_gen(9)), BIG),
    "empty": lambda: (torch.empty(0, dtype=torch.int64), 10),
    "single": lambda: (torch.tensor([9]), 10),
    "identical": lambda: (torch.full((1000,), 123_456, dtype=torch.int64), 1_000_000),
    "no_bound": lambda: (torch.tensor([5, 1 << 62, 5, 0]), None),
}


@pytest.mark.parametrize("case", sorted(UNIQUE_CASES))
@pytest.mark.parametrize("nthreads", [1, 2])
def test_unique_inverse_equals_torch_unique(case, nthreads):
    ids, num_rows = UNIQUE_CASES[case]()
    with threads(nthreads):
        got = ops.unique_inverse(ids, num_rows)
    assert_same(got, ref_unique_inverse(ids))
    assert_same(_library.unique_inverse_torch(ids, -1 if num_rows is None else num_rows), ref_unique_inverse(ids))


def test_unique_inverse_refuses_bad_input():
    with pytest.raises(ValueError, match="ids contains id 10 outside"):
        ops.unique_inverse(torch.tensor([1, 10, 2]), 10)
    with pytest.raises(ValueError, match="ids contains id -1 outside"):
        ops.unique_inverse(torch.tensor([1, -1]), None)
    with pytest.raises(TypeError, match="int64"):
        ops.unique_inverse(torch.tensor([1], dtype=torch.int32), 10)
    with pytest.raises(ValueError, match="num_rows must be >= 0"):
        ops.unique_inverse(torch.tensor([1]), -3)


# ------------------------------------------------------------ pooled_request


def _bags(n, bag_size=20, skip_every=0):
    """bag_of for n ids in bags of bag_size; with skip_every, every skip_every-th bag is left empty."""
    bag = torch.arange(n) // bag_size
    if skip_every:
        bag = bag + bag // skip_every  # bag b -> b + b // k: some bag numbers never used
    return bag


def _check_pooled(ids, bag_of, owners, scheme, num_rows, range_size=None, stride=1, num_bags=None):
    nb = int(bag_of.max()) + 1 if bag_of.numel() else 0
    num_bags = nb if num_bags is None else num_bags
    rs = range_size if range_size is not None else max(1, -(-num_rows // owners))
    got = ops.pooled_request(ids, bag_of, owners, scheme, num_rows, range_size, num_bags=num_bags, stride=stride)
    want = ref_pooled_request(ids, bag_of, owners, scheme, num_rows, rs, num_bags, stride)
    assert isinstance(got, ops.PooledPlan)
    assert_same(got, want)
    code = ownership.scheme_code(scheme)
    assert_same(_library.pooled_request_torch(ids, bag_of, num_rows, owners, code, rs, stride, num_bags), want)
    # The invariants the caller relies on.
    assert torch.equal(got.unique[torch.repeat_interleave(torch.cumsum(got.unique_counts, 0) - got.unique_counts,
                                                          got.occ_counts) + got.positions.long()],
                       ids[got.order])
    assert int(got.lengths.sum()) == ids.numel() and int(got.bag_counts.sum()) == got.bag_rows.numel()


@pytest.mark.parametrize("owners", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("scheme", ["hash", "range"])
def test_pooled_request_random_and_zipf(owners, scheme):
    V = 100_000
    _check_pooled(torch.randint(0, V, (4000,), generator=_gen(owners)), _bags(4000, 8), owners, scheme, V)
    _check_pooled(zipf_ids(4000, V, seed=owners), _bags(4000, 20, skip_every=3), owners, scheme, V)


@pytest.mark.parametrize("scheme", ["hash", "range"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_pooled_request_at_lookup_size(scheme, nthreads):
    # The sharded lookup's step: 2048 bags of 20 Zipf ids over 1M rows, 2 owners (2 threads really split it).
    with threads(nthreads):
        _check_pooled(zipf_ids(40_960, 1_000_000, seed=11), _bags(40_960), 2, scheme, 1_000_000)


def test_pooled_request_edge_cases():
    e = torch.empty(0, dtype=torch.int64)
    for owners in (1, 3):
        _check_pooled(e, e, owners, "hash", 10)                                   # nothing
        _check_pooled(e, e, owners, "range", 10, num_bags=4)
        _check_pooled(torch.tensor([7]), torch.tensor([2]), owners, "range", 10)  # one id
        _check_pooled(torch.full((500,), 6, dtype=torch.int64), _bags(500, 7), owners, "hash", 10)  # one id
    # All ids with owner 0 (range): the other owners get nothing.
    _check_pooled(torch.randint(0, 100, (3000,), generator=_gen(3)), _bags(3000, 5), 4, "range", 1000)
    # ... or with the last owner.
    _check_pooled(torch.randint(900, 1000, (3000,), generator=_gen(3)), _bags(3000, 5), 4, "range", 1000)
    # Empty bags anywhere (the first ones too), one bag holding everything, a bound larger than needed.
    ids = torch.randint(0, 1000, (300,), generator=_gen(4))
    _check_pooled(ids, _bags(300, 4, skip_every=2) + 5, 3, "hash", 1000, num_bags=500)
    _check_pooled(ids, torch.zeros(300, dtype=torch.int64), 3, "hash", 1000)
    # Ids near num_rows, explicit range_size and stride, the hash scheme over 64-bit ids.
    big = 1 << 40
    near = big - 1 - torch.randint(0, 5000, (3000,), generator=_gen(5))
    _check_pooled(near, _bags(3000), 3, "range", big)
    _check_pooled(near, _bags(3000), 3, "range", big, range_size=1000, stride=2)
    _check_pooled(near, _bags(3000), 5, "hash", big, stride=3)
    _check_pooled(torch.randint(0, big, (3000,), generator=_gen(6)), _bags(3000), 4, "hash", big)


@SETTINGS
@given(st.data())
def test_pooled_request_property(data):
    n = data.draw(st.integers(0, 300))
    V = data.draw(st.integers(1, 2000))
    owners = data.draw(st.integers(1, 5))
    scheme = data.draw(st.sampled_from(["hash", "range"]))
    ids = torch.tensor(data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n)), dtype=torch.int64)
    steps = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    bag_of = torch.cumsum(torch.tensor(steps, dtype=torch.int64), 0) if n else torch.empty(0, dtype=torch.int64)
    _check_pooled(ids, bag_of, owners, scheme, V)


def test_pooled_request_refuses_bad_input():
    ids, bags = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1])
    cases = [
        (torch.tensor([1, 10, 3]), bags, {}, "ids contains id 10 outside"),
        (torch.tensor([1, -4, 3]), bags, {}, "ids contains id -4 outside"),
        (ids, torch.tensor([0, 1, 0]), {}, r"non-decreasing: bag_of\[2\] = 0 < bag_of\[1\] = 1"),
        (ids, torch.tensor([-1, 0, 1]), {}, "bag_of contains bag -1 outside"),
        (ids, torch.tensor([0, 1, 2]), {"num_bags": 2}, r"bag_of contains bag 2 outside \[0, 2\)"),
        (ids, torch.tensor([0, 1]), {}, "bag_of has 2 entries but ids has 3"),
    ]
    for i, b, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.pooled_request(i, b, 2, "hash", 10, **kw)
        if b.numel() == i.numel():  # the CUDA kernel's data checks (torch ops, here on CPU tensors)
            with pytest.raises(ValueError):
                _library.pooled_request_torch(i, b, 10, 2, 0, 1, 1, kw.get("num_bags", -1))
    with pytest.raises(TypeError, match="bag_of must be int64"):
        ops.pooled_request(ids, bags.int(), 2, "hash", 10)
    with pytest.raises(ValueError, match="num_owners"):
        ops.pooled_request(ids, bags, 0, "hash", 10)
    with pytest.raises(ValueError, match="scheme"):
        ops.pooled_request(ids, bags, 2, "modulo", 10)


# ------------------------------------------------------------------ operators


def _opcheck_cases():
    ids = torch.tensor([3, 1, 3, 0, 7])
    return [
        ("group_by", (torch.tensor([2, 0, 2, 1]), 4)),
        ("bag_groups", (torch.tensor([2, 0, 1]), torch.tensor([0, 2, 1, 0, 2]), torch.tensor([2, 0, 3]), 3)),
        ("unique_inverse", (ids, 10)),
        ("pooled_request", (ids, torch.tensor([0, 0, 1, 3, 3]), 10, 2, 0, 1, 1, 4)),
        ("pooled_request", (ids, torch.tensor([0, 0, 1, 3, 3]), 10, 3, 1, 4, 1, -1)),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_pooled_ops_pass_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.sparsecomm, name).default, args)


def test_pooled_ops_have_a_cpu_kernel_a_cuda_kernel_and_a_fake():
    for name in ("group_by", "bag_groups", "unique_inverse", "pooled_request"):
        op = getattr(torch.ops.sparsecomm, name).default
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), (name, key)
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd"), name


@pytest.mark.slow
def test_pooled_ops_compile_fullgraph():
    ids, bag_of = zipf_ids(2000, 10_000, seed=1), _bags(2000)

    def f(ids, bag_of):
        u, inv = ops.unique_inverse(ids, 10_000)
        order, offsets = ops.group_by(inv, 10_000)
        return (u, inv, order, offsets) + tuple(ops.pooled_request(ids, bag_of, 2, "range", 10_000))

    assert_same(torch.compile(f, fullgraph=True, backend="eager")(ids, bag_of), f(ids, bag_of))
