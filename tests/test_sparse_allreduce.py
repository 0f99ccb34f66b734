"""sparse_allreduce on real gloo process groups against dist.all_reduce and a dense float64 sum.

Ranks are spawned once per world size; each runs every case and reports back.
"""

import hashlib
import os
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import sparsecomm
from sparsecomm.collectives import groups, sync_wire
from sparsecomm.cost_model import partitioned_floor_bytes
from sparsecomm.synthetic import zipf_ids
from sparsecomm.types import SparseSyncStats

from distributed import run_ranks

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_input(case, rank, world):
    """The tensor rank `rank` passes in `case`; every rank can rebuild every other rank's input."""
    kind, num_rows, dim, dtype, seed = case["kind"], case["rows"], case["dim"], case["dtype"], case["seed"]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = case.get("n", 40)
    if kind == "empty_rank" and rank == world - 1:
        n = 0
    if kind == "zipf":
        ids = zipf_ids(n, num_rows, alpha=1.1, seed=seed * 1000 + rank)
    elif kind == "same_row":
        ids = torch.full((n,), num_rows // 2, dtype=torch.int64)
    elif kind == "all_empty":
        ids = torch.empty(0, dtype=torch.int64)
    else:
        ids = torch.randint(0, num_rows, (n,), generator=g)
    shape = (num_rows, *dim)
    vals = torch.randn((ids.shape[0], *dim), generator=g, dtype=torch.float64).to(dtype)
    return torch.sparse_coo_tensor(ids[None], vals, shape, check_invariants=False)


def dense_reference(case, world):
    # Sum in float64 of every rank's input; only touched rows, never the table.
    parts = [make_input(case, r, world).coalesce() for r in range(world)]
    ids = torch.cat([p.indices()[0] for p in parts])
    vals = torch.cat([p.values().double() for p in parts])
    uniq, inv = torch.unique(ids, return_inverse=True)
    acc = torch.zeros((len(uniq), *vals.shape[1:]), dtype=torch.float64).index_add_(0, inv, vals)
    return uniq, acc


CASES = []
for i, (kind, dtype, dim, rows) in enumerate([
    ("uniform", torch.float32, (8,), 100),
    ("zipf", torch.float32, (16,), 1000),
    ("zipf", torch.float64, (3,), 50_000),          # int32 ids on the wire
    ("uniform", torch.bfloat16, (8,), 200),
    ("uniform", torch.float16, (5,), 200),
    ("empty_rank", torch.float32, (4,), 60),
    ("all_empty", torch.float32, (4,), 60),
    ("same_row", torch.float32, (2,), 10),
    ("same_row", torch.bfloat16, (2,), 10),
    ("uniform", torch.float32, (1,), 30),            # narrow rows
    ("zipf", torch.float32, (257,), 500),            # wide rows
    ("uniform", torch.float32, (2, 3), 40),          # trailing dims
    ("uniform", torch.float32, (4,), 2**33),         # int64 ids on the wire, table never allocated
]):
    for scheme in ("hash", "range"):
        for op in ("sum", "avg"):
            CASES.append(dict(kind=kind, dtype=dtype, dim=dim, rows=rows, seed=i, scheme=scheme, op=op,
                              method="partitioned"))
    if rows <= 50_000:  # the densify path allocates the table
        for method in ("allgather", "densify"):
            CASES.append(dict(kind=kind, dtype=dtype, dim=dim, rows=rows, seed=i, scheme="hash", op="avg",
                              method=method))


def _check_result(case, out, world):
    assert out.is_coalesced() and out.dtype == case["dtype"]
    assert tuple(out.shape) == (case["rows"], *case["dim"])
    ref_ids, ref_vals = dense_reference(case, world)
    if case["op"] == "avg":
        ref_vals = ref_vals / world
    assert torch.equal(out.indices()[0], ref_ids), case
    err = (out.values().double() - ref_vals).abs()
    bound = TOL[case["dtype"]] * world * (1 + ref_vals.abs())
    assert bool((err <= bound).all()), (case, float(err.max()))


def _equivalence_worker(rank, world, lws):
    digests = []
    for case in CASES:
        t = make_input(case, rank, world)
        out = sparsecomm.sparse_allreduce(t, op=case["op"], scheme=case["scheme"], local_world_size=lws,
                                          method=case["method"])
        _check_result(case, out, world)
        if case["rows"] <= 50_000 and case["dtype"] in (torch.float32, torch.float64):
            # DDP's own reference: gloo's sparse all_reduce.
            ref = t.clone()
            dist.all_reduce(ref)
            ref = ref.coalesce()
            if case["op"] == "avg":
                ref = ref / world
            assert torch.equal(ref.indices(), out.indices())
            assert torch.allclose(ref.values(), out.values(), rtol=1e-5, atol=1e-6)
        digests.append(hashlib.sha256(out.values().double().numpy().tobytes() + out.indices().numpy().tobytes()).hexdigest())
    # Every case again, fused: one call per (op, scheme) carrying all its tensors,
    # whatever their shapes, dtypes and methods (plus gloo's own path for float32/64).
    groups = {}
    for i, case in enumerate(CASES):
        groups.setdefault((case["op"], case["scheme"]), []).append((i, case["method"]))
        if case["dtype"] in (torch.float32, torch.float64) and case["rows"] <= 50_000 and case["scheme"] == "hash":
            groups[(case["op"], case["scheme"])].append((i, "torch"))
    for (op, scheme), members in groups.items():
        tensors = [make_input(CASES[i], rank, world) for i, _ in members]
        outs = sparsecomm.sparse_allreduce_coalesced(tensors, op=op, scheme=scheme, local_world_size=lws,
                                                     method=[m for _, m in members])
        for (i, method), out in zip(members, outs):
            _check_result(CASES[i], out, world)
    return digests


@pytest.mark.parametrize("world,lws", [(1, 1), (2, 1), (3, 1), pytest.param(4, 1, marks=pytest.mark.slow),
                                       pytest.param(4, 2, marks=pytest.mark.slow)])
def test_matches_all_reduce_and_dense_sum(world, lws):
    results = run_ranks(world, _equivalence_worker, lws)
    # Bitwise the same result on every rank.
    assert all(results[r] == results[0] for r in range(world))


def _bytes_worker(rank, world):
    # Every rank touches every row of a V = 6N table: k = U = V, and under the
    # range scheme each owner receives exactly V/N rows from each rank.
    num_rows, dim = 6 * world, 4
    t = torch.sparse_coo_tensor(torch.arange(num_rows)[None], torch.ones(num_rows, dim), (num_rows, dim))
    stats = SparseSyncStats()
    sparsecomm.sparse_allreduce(t, scheme="range", local_world_size=1, stats=stats)
    return stats.bytes_sent, stats.bytes_recv, stats.row_bytes, stats.index_bytes, stats.rows_out


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_on_the_wire_match_the_floor(world):
    results = run_ranks(world, _bytes_worker)
    for sent, recv, row_bytes, index_bytes, union in results.values():
        payload = partitioned_floor_bytes(world, union, union, row_bytes + index_bytes)
        # Metadata: one all-to-all of 21 + N int64 (header, k, n, m, the sender's push counts to every rank),
        # one pull-count all-to-all.
        overhead = (world - 1) * 8 * (sync_wire.RECORD_FIXED + world + 1)
        assert sent == recv == payload + overhead
        assert index_bytes == 2  # 6N rows fit int16 ids


def _hier_bytes_worker(rank, world):
    # 4 ranks as 2 nodes x 2, the same 32 rows everywhere.
    t = torch.sparse_coo_tensor(torch.arange(32)[None], torch.ones(32, 8), (32, 8))
    flat, hier = SparseSyncStats(), SparseSyncStats()
    a = sparsecomm.sparse_allreduce(t, local_world_size=2, local_aggregation=False, stats=flat)
    b = sparsecomm.sparse_allreduce(t, local_world_size=2, stats=hier)
    assert torch.equal(a.values(), b.values()) and torch.equal(a.indices(), b.indices())
    assert hier.hierarchical and not flat.hierarchical
    return flat.bytes_sent_inter_node, hier.bytes_sent_inter_node


def test_local_aggregation_sends_each_row_across_nodes_once():
    results = run_ranks(4, _hier_bytes_worker)
    flat = sum(r[0] for r in results.values())
    hier = sum(r[1] for r in results.values())
    row = 8 * 4 + 2  # values + int16 id
    # Two-level: each row crosses once to its owner node and once back: 2 * 32 rows,
    # plus the cross-node count/metadata messages (2 per rank of 8 bytes).
    assert hier == 2 * 32 * row + 4 * 2 * 8
    # Flat: every rank pushes its rows owned on the other node (~half) and each
    # owner sends its rows to both ranks there: about twice as much.
    assert flat > 1.8 * hier


def _async_worker(rank, world):
    t = torch.sparse_coo_tensor(torch.tensor([[rank, 5]]), torch.ones(2, 3), (8, 3))
    futs = [sparsecomm.sparse_allreduce(t * (i + 1), async_op=True) for i in range(3)]
    chained = futs[0].then(lambda f: f.value().to_dense().sum())
    # A collective on the default group while async work is in flight must not interleave with it.
    x = torch.ones(1)
    dist.all_reduce(x)
    dense = [f.wait().to_dense() for f in futs]
    for i, d in enumerate(dense):
        assert d[5].tolist() == [world * (i + 1)] * 3
        for r in range(world):
            assert d[r].tolist() == [float(i + 1)] * 3
    assert float(chained.wait()) == 3 * world + 3 * world
    return float(x)


class _Held:
    """Stands for what a job's closure holds (a hook step's gradients, views of DDP's buckets)."""


def _released(ref: weakref.ref) -> bool:
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None


def test_the_worker_thread_lets_a_finished_job_go():
    """What a finished job held is released when it ends, not when the group's next job comes (none here)."""
    held = _Held()
    ref = weakref.ref(held)
    fut = groups.run_async(lambda h=held: 7, group=object())   # a group of its own: its own worker thread
    del held
    assert fut.wait() == 7
    assert _released(ref)


@pytest.mark.parametrize("world", [2, 3])
def test_async_futures_chain(world):
    results = run_ranks(world, _async_worker)
    assert all(v == world for v in results.values())


def _errors_worker(rank, world):
    good = torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.ones(2, 4), (10, 4))
    seen = []

    def expect(tensor, match, **kw):
        try:
            sparsecomm.sparse_allreduce(tensor, **kw)
        except ValueError as e:
            assert match in str(e), str(e)
            seen.append(match)
        else:
            raise AssertionError(f"no error for {match}")
        # The group is still usable: nothing was lost.
        out = sparsecomm.sparse_allreduce(good)
        assert out.to_dense()[1].tolist() == [float(world)] * 4

    other_shape = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 5 if rank == 1 else 4),
                                          (10, 5 if rank == 1 else 4))
    expect(other_shape, "ranks disagree")
    other_dtype = good.to(torch.float64) if rank == 1 else good
    expect(other_dtype, "ranks disagree")
    bad_ids = torch.sparse_coo_tensor(torch.tensor([[1, 10 + rank]]), torch.ones(2, 4), (10, 4),
                                      check_invariants=False) if rank == world - 1 else good
    expect(bad_ids, f"rank {world - 1} passed row ids outside [0, 10)")
    # Two sparse dims: (0, 5) in a (4, 3) table would linearize to the valid id 5.
    grid = torch.sparse_coo_tensor(torch.tensor([[0, 1], [5 if rank == 0 else 1, 1]]), torch.ones(2, 4), (4, 3, 4),
                                   check_invariants=False)
    try:
        sparsecomm.sparse_allreduce(grid)
    except ValueError as e:
        assert "rank 0 passed row ids outside" in str(e), str(e)
        seen.append("inner index")
    nan = torch.sparse_coo_tensor(torch.tensor([[3]]), torch.full((1, 4), float("nan")), (10, 4))
    expect(nan if rank == 0 else good, "rank 0 passed NaN")
    # nonfinite="propagate" sums NaN like all_reduce does.
    out = sparsecomm.sparse_allreduce(nan if rank == 0 else good, nonfinite="propagate")
    assert torch.isnan(out.to_dense()[3]).all()
    try:
        sparsecomm.sparse_allreduce(torch.ones(3))
    except TypeError as e:
        seen.append("TypeError" if "sparse COO" in str(e) else str(e))
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_raises_on_every_rank(world):
    results = run_ranks(world, _errors_worker)
    for seen in results.values():
        assert len(seen) == 6 and seen[-1] == "TypeError" and "inner index" in seen


def _capacity_worker(rank, world):
    # Allgather tensors with capacities that fit, and one that rank 0 overflows: same results as without.
    cases = [c for c in CASES if c["method"] == "allgather" and c["op"] == "avg"][:4]
    tensors = [make_input(c, rank, world) for c in cases]
    plain = sparsecomm.sparse_allreduce_coalesced(tensors, op="avg", method="allgather")
    k = [t.coalesce()._nnz() for t in tensors]
    fits = [max(1, x) * 2 for x in k]
    too_small = [0] + fits[1:]  # rank 0's first tensor has rows: every rank falls back
    stats = [SparseSyncStats() for _ in tensors]
    for caps in (fits, too_small):
        caps = [int(c) for c in torch.tensor(caps).view(1, -1).repeat(world, 1).max(0).values]
        dist.all_reduce(t := torch.tensor(caps), op=dist.ReduceOp.MAX)
        outs = sparsecomm.sparse_allreduce_coalesced(tensors, op="avg", method="allgather", capacity=t.tolist(),
                                                     stats=stats)
        for case, a, b in zip(cases, outs, plain):
            _check_result(case, a, world)
            assert torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())
    return [s.bytes_sent for s in stats]


@pytest.mark.parametrize("world", [1, 3])
def test_allgather_with_capacity_is_one_collective_and_falls_back_when_rows_overflow(world):
    run_ranks(world, _capacity_worker)


def _malicious_worker(rank, world, attack):
    """Rank 1 corrupts what it tells its peers; every rank must raise ValueError, nothing crashes."""
    import sparsecomm.collectives.sync_plan as sparse_mod
    from sparsecomm.collectives import shm

    t = torch.sparse_coo_tensor(torch.arange(12)[None] * (rank + 1), torch.ones(12, 4), (100, 4))
    if rank == 1:
        calls = [0]

        def lie(input):
            calls[0] += 1
            if attack == "negative-count" and calls[0] == 1:
                # Metadata: the push count for owner 0 becomes negative, the total unchanged.
                input.view(world, -1)[:, sync_wire.PUSH_WORD] -= 1000
                input.view(world, -1)[:, sync_wire.PUSH_WORD + 1] += 1000
            if attack == "huge-k" and calls[0] == 1:
                input.view(world, -1)[:, sync_wire.K_WORD] = 2**40
            if attack == "pull-count" and calls[0] == 3:
                input.fill_(10**9)  # an owner announces more rows than were pushed to it

        # Whichever transport carries the all-to-all (gloo, or shared memory on one host) sends the lie.
        real_gloo, real_shm = dist.all_to_all_single, shm.run

        def lying_gloo(output, input, *args, **kwargs):
            lie(input)
            return real_gloo(output, input, *args, **kwargs)

        def lying_shm(transport, recv, send, *args):
            lie(send)
            return real_shm(transport, recv, send, *args)

        dist.all_to_all_single, shm.run = lying_gloo, lying_shm
    if rank == 1 and attack == "bad-ids":
        real_partition = sparse_mod.ops.partition_rows

        def lying_partition(ids, *args, **kwargs):
            part = real_partition(ids, *args, **kwargs)
            return part._replace(ids=part.ids - 1000)  # ids the owners must refuse

        sparse_mod.ops.partition_rows = lying_partition
    try:
        sparsecomm.sparse_allreduce(t, method="partitioned")
    except ValueError as e:
        return str(e), shm.active(None)
    return "no error", shm.active(None)


# gloo's run is slow-marked: the default suite keeps the transport every one-host run now takes.
@pytest.mark.parametrize("transport", ["shm", pytest.param("gloo", marks=pytest.mark.slow)])
@pytest.mark.parametrize("attack,match", [("negative-count", "inconsistent row counts"),
                                          ("huge-k", "inconsistent row counts"),
                                          ("pull-count", "announced"),
                                          ("bad-ids", "received row ids outside")])
def test_a_lying_peer_makes_every_rank_raise(attack, match, transport):
    results = run_ranks(3, _malicious_worker, attack, timeout_s=20,
                        env={"SPARSECOMM_SHM": "1" if transport == "shm" else "0"})
    for rank, (message, shared) in results.items():
        assert match in message, (rank, message)
        assert shared == (transport == "shm"), (rank, shared)


def _timeout_worker(rank, world, done_flag):
    from sparsecomm.collectives.groups import group_timeout, twin_group

    twin = twin_group(None)  # created together (collective)
    assert group_timeout(twin) == group_timeout(None)
    if rank == 1:
        # A stalled peer: never joins the async call, and stays until rank 0 is through with it (10 s at
        # most, well past the 6 s rank 0 has to fail in), so that rank 0 cannot fail for its leaving.
        deadline = time.monotonic() + 10
        while not os.path.exists(done_flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return ("stalled", 0.0)
    t = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 4), (10, 4))
    start = time.monotonic()
    try:
        sparsecomm.sparse_allreduce(t, async_op=True).wait()
    except RuntimeError:
        return ("raised", time.monotonic() - start)
    finally:
        open(done_flag, "w").close()
    return ("returned", time.monotonic() - start)


def test_groups_the_library_creates_keep_the_users_timeout(tmp_path):
    # The default group's timeout is 3 s: the twin the async call runs on must fail as soon, not in 30 min.
    results = run_ranks(2, _timeout_worker, str(tmp_path / "rank0-done"), timeout_s=3, expect_dead=True,
                        join_timeout_s=60)
    status, elapsed = results[0]
    assert status == "raised" and elapsed < 6, (status, elapsed)


def _dead_rank_worker(rank, world):
    dist.barrier()   # every pair connected: dying earlier breaks the others' process group setup, not the sync
    if rank == 1:
        os._exit(0)  # dies without a word
    t = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 4), (10, 4))
    start = time.monotonic()
    try:
        sparsecomm.sparse_allreduce(t)
    except RuntimeError as e:
        return ("raised", time.monotonic() - start, str(e)[:200])
    return ("returned", time.monotonic() - start, "")


def test_dead_rank_raises_within_timeout_on_the_others():
    results = run_ranks(3, _dead_rank_worker, timeout_s=10, expect_dead=True, join_timeout_s=120)
    assert set(results) == {0, 2}
    for status, elapsed, msg in results.values():
        assert status == "raised", msg
        assert elapsed < 30


def test_world_size_one_without_exchange_partners():
    # Covered in the equivalence test too; here: the stats of a lone rank.
    dense_row, sent, rows_in, rows_local, rows_out = run_ranks(1, _one_module_level)[0]
    assert dense_row == [2.0, 2.0] and sent == 0 and (rows_in, rows_local, rows_out) == (3, 2, 2)


def _one_module_level(rank, world):
    s = SparseSyncStats()
    t = torch.sparse_coo_tensor(torch.tensor([[2, 2, 7]]), torch.ones(3, 2), (9, 2))
    out = sparsecomm.sparse_allreduce(t, stats=s)
    assert sparsecomm.last_stats() is s
    return out.to_dense()[2].tolist(), s.bytes_sent, s.rows_in, s.rows_local, s.rows_out


def test_non_sparse_input_is_a_type_error_without_a_group():
    with pytest.raises(TypeError, match="sparse COO"):
        sparsecomm.sparse_allreduce(torch.ones(3))
    with pytest.raises(TypeError, match="float32"):
        sparsecomm.sparse_allreduce(torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, dtype=torch.int64), (2,)))
