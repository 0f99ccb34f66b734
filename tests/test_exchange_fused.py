"""Row exchanges that copy each row once: packed from a partition's perm, summed out of the receive buffer.

Two real ranks (gloo); every rank builds every rank's input from seeds, so it
can compute the exact expected result locally (bitwise: the same rows in the
same order through the same kernels).
"""

import torch
import torch.distributed as dist

from distributed import run_ranks


def _rank_input(rank, n, num_rows, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, num_rows, (n,), generator=g).unique().to(torch.int32)  # coalesced rows, sorted
    values = torch.randn(ids.shape[0], 2, 3, generator=g).to(dtype)
    return ids, values


def _worker(rank, world):
    from sparsecomm import ops
    from sparsecomm.collectives import exchange
    from sparsecomm.types import SparseSyncStats

    num_rows = 1000  # int16 on the wire
    wire = exchange.wire_index_dtype(num_rows)
    assert wire == torch.int16
    for dtype in (torch.float16, torch.float32):
        sum_dtype = torch.float32
        inputs = [_rank_input(r, 300, num_rows, dtype) for r in range(world)]
        ids, values = inputs[rank]
        stats = SparseSyncStats()
        got_ids, got = exchange.push_to_owners(
            ids, values, None, num_owners=world, stride=1, scheme="hash", num_rows=num_rows, range_size=1,
            wire_ids=wire, sum_dtype=sum_dtype, device=torch.device("cpu"), stats=stats)
        # Expected: every rank's rows that I own, in rank order, summed in that order.
        mine_ids, mine_values = [], []
        for r_ids, r_values in inputs:
            part = ops.partition_rows(r_ids, r_values, world, "hash", num_rows)
            a = int(part.counts[:rank].sum())
            c = int(part.counts[rank])
            mine_ids.append(part.ids[a:a + c])
            mine_values.append(part.values[a:a + c])
        ref_ids, ref = ops.coalesce_rows(torch.cat(mine_ids), torch.cat(mine_values).to(sum_dtype), num_rows)
        assert got.dtype == sum_dtype and torch.equal(got_ids, ref_ids) and torch.equal(got, ref), dtype
        # One copy: every row packed once (the rank's own rows too), nothing copied out of the receive buffer.
        row = 2 + 6 * values.element_size()
        assert stats.bytes_copied == ids.shape[0] * row, (stats.bytes_copied, ids.shape[0] * row)
        # Bytes on the wire count only what goes to the other rank.
        part = ops.partition_rows(ids, None, world, "hash", num_rows)
        sent = int(part.counts.sum() - part.counts[rank])
        assert stats.bytes_sent == 8 * (world - 1) + sent * row

        # allgather: every rank's rows in rank order, copied out (one copy in, one out).
        stats = SparseSyncStats()
        all_ids, all_values = exchange.allgather_rows(ids, values, None, wire_ids=wire, device=torch.device("cpu"),
                                                      stats=stats, max_rows=num_rows)
        assert torch.equal(all_ids, torch.cat([i for i, _ in inputs]))
        assert torch.equal(all_values, torch.cat([v for _, v in inputs]))
        assert stats.bytes_copied == world * ids.shape[0] * row + all_ids.shape[0] * row

    # A lying peer: rank 0 believes the table has 1000 rows and sends an id that rank 1 owns but its
    # table (500 rows) has not; the owner refuses it before it indexes anything.
    big = next(i for i in range(500, 1000) if int(ops.row_owners(torch.tensor([i]), world)[0]) == 1)
    bad = torch.tensor([big if rank == 0 else 1], dtype=torch.int32)
    try:
        exchange.push_to_owners(bad, torch.ones(1, 2), None, num_owners=world, stride=1, scheme="hash",
                                num_rows=1000 if rank == 0 else 500, range_size=1, wire_ids=torch.int16,
                                sum_dtype=torch.float32, device=torch.device("cpu"))
    except ValueError as e:
        assert f"contains id {big} outside [0, 500)" in str(e), e
        return "refused"
    return "accepted"


def test_push_and_allgather_copy_each_row_once_and_match_the_reference():
    results = run_ranks(2, _worker)
    assert results == {0: "accepted", 1: "refused"}
