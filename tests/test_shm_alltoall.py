"""The shared-memory all-to-all (``sparsecomm.collectives.shm``) against gloo's, and how it fails.

Every all-to-all of the library on a one-host gloo group goes through it, so
the rest of the suite runs on it too; these tests check it byte for byte
against gloo's ``all_to_all_single`` on the same inputs (uneven, empty and
multi-chunk splits, every dtype), that a rank turning it off turns it off on
every rank, and that a stalled, dead or inconsistent peer is an error on the
others, never a hang.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

from sparsecomm.collectives import shm
from sparsecomm.collectives.exchange import all_to_all

from distributed import run_ranks


def _splits(gen: torch.Generator, n: int, slot_rows: int) -> torch.Tensor:
    """[src, dst] rows: uneven, some empty, now and then several slots' worth (chunks: 2.5 slots, or exactly
    one or two slots)."""
    rows = torch.randint(0, 40, (n, n), generator=gen)
    rows[torch.rand(n, n, generator=gen) < 0.25] = 0
    if torch.rand(1, generator=gen).item() < 0.4:
        big = [slot_rows * 5 // 2, slot_rows, 2 * slot_rows][int(torch.randint(0, 3, (1,), generator=gen))]
        rows[torch.randint(0, n, (1,), generator=gen), torch.randint(0, n, (1,), generator=gen)] = big
    return rows


def _against_gloo_worker(rank, world):
    gen = torch.Generator().manual_seed(7)   # the same on every rank: every rank knows every split
    checked = 0
    for call in range(40):
        dtype = [torch.uint8, torch.int64, torch.float32, torch.float16, torch.bfloat16, torch.float64][call % 6]
        width = [1, 2, 4, 8, 16][call % 5]   # row sizes that divide the slot: exact multiples happen
        row_bytes = width * torch.tensor([], dtype=dtype).element_size()
        rows = _splits(gen, world, shm.slot_bytes(world) // row_bytes)
        send_splits, recv_splits = rows[rank].tolist(), rows[:, rank].tolist()
        values = torch.randn(sum(send_splits), width, generator=torch.Generator().manual_seed(call * 10 + rank))
        send = (values * 100).to(dtype)
        got = torch.full((sum(recv_splits), width), -1).to(dtype)
        want = torch.full_like(got, -1)
        all_to_all(got, send, recv_splits, send_splits, group=None)
        dist.all_to_all_single(want, send, recv_splits, send_splits)   # gloo's own
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (call, rows.tolist())
        checked += got.numel()
    # Even splits (no split lists) and a non-contiguous receive buffer.
    send = torch.arange(world * 6, dtype=torch.int64).view(world, 6) + 1000 * rank
    got = torch.empty(6, world, dtype=torch.int64).t()
    all_to_all(got, send, group=None)
    assert torch.equal(got, torch.stack([torch.arange(rank * 6, rank * 6 + 6) + 1000 * r for r in range(world)]))
    assert shm.active(None)
    # Rank 0 named the segment after its pid; it unlinked it once every rank had mapped it.
    mine = glob.glob(f"/dev/shm/sparsecomm-{os.getpid()}-*") if rank == 0 else []
    return checked, mine


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_shared_memory_all_to_all_moves_the_bytes_gloo_moves(world):
    results = run_ranks(world, _against_gloo_worker)
    for rank, (checked, leftovers) in results.items():
        assert checked > 0
        assert leftovers == [], leftovers   # the segment is unlinked once every rank mapped it


def _opt_out_worker(rank, world, off_on=None, broken_on=None):
    if rank == off_on:
        os.environ[shm.ENV_VAR] = "0"
    if rank == broken_on:
        def cannot_map(*args):
            raise OSError("mmap failed (simulated)")
        shm._make = cannot_map
    send = torch.arange(world * 3, dtype=torch.float32) + 100 * rank
    got = torch.empty_like(send)
    all_to_all(got, send, group=None)
    assert torch.equal(got, torch.cat([torch.arange(rank * 3, rank * 3 + 3, dtype=torch.float32) + 100 * r
                                       for r in range(world)]))
    return shm.active(None)


def test_one_rank_turning_it_off_keeps_every_rank_on_gloo():
    assert run_ranks(3, _opt_out_worker, 1) == {0: False, 1: False, 2: False}
    assert run_ranks(2, _opt_out_worker, None, None, env={"SPARSECOMM_SHM": "0"}) == {0: False, 1: False}
    # and on by default:
    assert run_ranks(2, _opt_out_worker) == {0: True, 1: True}


@pytest.mark.parametrize("broken_on", [0, 2])
def test_a_rank_that_cannot_set_it_up_keeps_every_rank_on_gloo(broken_on):
    # Rank 0 failing to create the segment, or another rank failing to map it: all agree on gloo, and the
    # all-to-all's result is still right (checked in the worker).
    assert run_ranks(3, _opt_out_worker, None, broken_on) == {0: False, 1: False, 2: False}


def _misbehaving_worker(rank, world, culprit, how):
    """After a first all-to-all together, rank ``culprit`` stalls 6 s or dies; the others time their next call."""
    send = torch.zeros(world * 4, dtype=torch.int64)
    got = torch.empty_like(send)
    all_to_all(got, send, group=None)   # sets the transport up, with every rank
    if rank == culprit and how == "die":
        os._exit(1)   # dies without a word
    if rank == culprit:
        time.sleep(6)   # a stalled peer: joins long after the others' timeout
    start = time.monotonic()
    try:
        all_to_all(got, send, group=None)
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.slow  # waits out a 3 s timeout and a 6 s stall; the dead-peer test covers failing fast by default
def test_a_stalled_peer_times_out_on_the_waiting_rank_and_breaks_the_group_for_all():
    results = run_ranks(2, _misbehaving_worker, 1, "stall", timeout_s=3, expect_dead=True, join_timeout_s=60)
    message, waited = results[0]
    assert "timeout" in message and "shared-memory all-to-all" in message, message
    assert 2.5 < waited < 5.5, waited     # the group's timeout, not torch's 30 minutes
    late, _ = results[1]
    assert "rank 0 failed" in late, late  # the late rank hears of it as soon as it arrives


def test_a_dead_peer_is_an_error_on_the_others_long_before_the_timeout():
    results = run_ranks(3, _misbehaving_worker, 2, "die", timeout_s=60, expect_dead=True)
    assert set(results) == {0, 1}, results
    for rank, (message, waited) in results.items():
        # Whoever noticed first names the dead rank; the other repeats its reason.
        assert "rank 2 (pid" in message and "exited" in message, (rank, message)
        assert waited < 10, (rank, waited)


def _mismatch_worker(rank, world):
    send = torch.zeros(world * 4, dtype=torch.uint8)
    got = torch.empty_like(send)
    all_to_all(got, send, group=None)
    # Rank 1 sends rank 0 six bytes where rank 0 expects four (a bug in a caller's counts).
    send_splits = [6, 4] if rank == 1 else [4, 4]
    send = torch.zeros(sum(send_splits), dtype=torch.uint8)
    errors = []
    for _ in range(2):   # the second call: whoever got through the first hears of the failure
        try:
            all_to_all(got, send, [4, 4], send_splits, group=None)
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


def test_sizes_that_disagree_fail_the_call_on_every_rank():
    results = run_ranks(2, _mismatch_worker)
    assert "expected 4 bytes from rank 1, which sends 6" in results[0][0], results
    assert any("rank 0 failed" in e for e in results[1]), results


def _leaves_after_last_call_worker(rank, world):
    send = torch.arange(world * 4, dtype=torch.int64) + 100 * rank
    got = torch.empty_like(send)
    all_to_all(got, send, group=None)
    time.sleep(0.5 * rank)   # rank 2 comes late to the last call
    all_to_all(got, send, group=None)
    if rank == 1:
        os._exit(0)   # done with its last call: leaves at once (rank 0 still waits for rank 2)
    return got.tolist()


def test_a_peer_that_leaves_after_its_last_call_is_no_error():
    results = run_ranks(3, _leaves_after_last_call_worker, expect_dead=True)
    assert set(results) == {0, 2}, results
    for rank, got in results.items():
        assert got == [v for r in range(3) for v in range(rank * 4 + 100 * r, rank * 4 + 4 + 100 * r)], got


def _direct_worker(rank, world):
    from sparsecomm.collectives.exchange import exchange_direct, exchange_tables

    calls = [0]
    real = shm.run_segments

    def counting(*args):
        calls[0] += 1
        return real(*args)

    shm.run_segments = counting   # the direct path, not exchange_tables, must carry every call below
    gen = torch.Generator().manual_seed(11)
    slot_rows = shm.slot_bytes(world) // 256
    for call in range(12):
        # Several blocks of different widths and dtypes (1-D int16 ids, odd row sizes, a non-contiguous one);
        # counts uneven, some zero, now and then over a slot.
        specs = [(torch.float32, (64,)), (torch.int16, ()), (torch.float16, (3, 5)), (torch.int64, (1,)),
                 (torch.float64, (7,))]
        blocks, send_counts, recv_counts = [], [], []
        for b, (dtype, shape) in enumerate(specs[:1 + call % 5]):
            counts = _splits(gen, world, slot_rows)   # [src, dst]
            send_counts.append(counts[rank].tolist())
            recv_counts.append(counts[:, rank].tolist())
            n = sum(send_counts[-1])
            rows = (torch.randn(n, *shape, generator=torch.Generator().manual_seed(call * 97 + b * 7 + rank))
                    * 50).to(dtype)
            if dtype == torch.float64:   # a column slice: not contiguous
                rows = torch.cat([rows, rows], dim=1)[:, ::2]
            blocks.append([rows])
        got = exchange_direct(blocks, send_counts, recv_counts, None, torch.device("cpu"))
        want = exchange_tables(blocks, send_counts, recv_counts, [False] * len(blocks), None, torch.device("cpu"))
        for g, w in zip(got, want):
            assert g[0].dtype == w[0].dtype and g[0].shape == w[0].shape, (call, g[0].shape, w[0].shape)
            assert torch.equal(g[0].view(torch.uint8), w[0].view(torch.uint8)), call
    assert calls[0] == 12, calls
    # A caller's counts that do not match its rows are refused before anything is read past them.
    try:
        exchange_direct([[torch.zeros(3, 4)]], [[2] * world], [[2] * world], None, torch.device("cpu"))
    except ValueError as exc:
        assert "sends" in str(exc)
    else:
        raise AssertionError("no ValueError")
    return shm.active(None)


@pytest.mark.parametrize("world", [2, 3])
def test_rows_straight_between_tensors_and_slots_equal_the_packed_exchange(world):
    # exchange_direct (the sharded lookups' exchange: no staging buffers on the shared-memory transport)
    # against exchange_tables (packed send buffer, unpacked receive buffer) on the same blocks.
    assert run_ranks(world, _direct_worker) == {r: True for r in range(world)}


def _released_worker(rank, world):
    import gc
    import weakref

    group = dist.new_group(list(range(world)))
    send = torch.arange(world * 2, dtype=torch.int64)
    got = torch.empty_like(send)
    all_to_all(got, send, group=group)
    used = shm.active(group)
    ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return used, ref() is None


def test_a_destroyed_group_is_not_kept_alive_by_its_transport():
    # A group kept alive past destroy_process_group keeps gloo's threads running into interpreter shutdown,
    # where one releasing a finished collective aborts the process (seen: 3-5 in 12 launches of a benchmark).
    assert run_ranks(2, _released_worker) == {0: (True, True), 1: (True, True)}
