"""Sharded tables when one rank goes wrong: every rank must raise ValueError, none may hang or crash.

One spawn of 3 gloo ranks runs every case. A "malicious" rank corrupts what
it sends (its metadata row: counts and owned rows; or the ids of the request)
by wrapping the all-to-all inside its own process only, as a bug or a version
mismatch on one rank would. Collectives time out after a few seconds, so a
rank left waiting fails with a timeout instead of the expected ValueError.
After each refused lookup the table must still work on every rank.

Also here: one rank's bad bag input (per_sample_weights dtype/device,
offsets), and checkpoint loading that splits the checksums among the ranks.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch

import sparsecomm.sharded as sh
from sparsecomm import ops
from sparsecomm.collectives import groups, sharded_exchange, objects, sharded_request
from sparsecomm.collectives.sharded_wire import FINGERPRINT_LEN
from sparsecomm.sharded import checkpoint as ckpt, files

from distributed import expect_value_error, run_cases, run_ranks

WORLD = 3
BAD = 2            # the rank that corrupts what it sends
V, D = 30, 4
# Columns of a metadata row (sparsecomm.collectives.sharded_wire): status 0, detail 1, round 2, capacity 3,
# tables 4, width 5, looked-up flag 6, owned rows 7, fingerprint 8..13, counts 14..16, path (1: pooled) 17,
# per-sample-weight bytes 18, pooled occurrences 19..21 and bags 22..24 per owner, two byte estimates 25..26, then
# (once the table has a capacity) the ids for the peer, followed by a pooled lookup's positions and bag lengths
# (int32 pairs in int64 words).
META_STATUS, META_CAPACITY, META_NUM_LOCAL = 0, 3, 7
META_COUNTS = 8 + FINGERPRINT_LEN
META_PATH = META_COUNTS + WORLD
META_WEIGHT_BYTES = META_PATH + 1
META_OCC = META_PATH + 2
META_BAGS = META_OCC + WORLD
META_IDS = META_BAGS + WORLD + 2


class Corrupt:
    """Wrap ``sharded_request.all_to_all_rows`` in this process: call ``call`` gets ``edit(tensor, send_counts)``."""

    def __init__(self, call: int, edit) -> None:
        self.call, self.edit, self.seen = call, edit, 0

    def __enter__(self):
        self.real = sharded_request.all_to_all_rows

        def wrapper(tensors, send_counts, recv_counts, *args, **kwargs):
            if self.seen == self.call:
                tensors = [self.edit(tensors[0].clone(), send_counts)] + list(tensors[1:])
            self.seen += 1
            return self.real(tensors, send_counts, recv_counts, *args, **kwargs)

        sharded_request.all_to_all_rows = wrapper
        return self

    def __exit__(self, *exc):
        sharded_request.all_to_all_rows = self.real


def set_column(col, value):
    def edit(meta, _):
        meta[:, col] = value
        return meta
    return edit


def foreign_ids(wrong, padded):
    """Replace the ids meant for owner j by ids owned by another rank (or by ``wrong(j)``).

    ``padded``: the ids ride behind the metadata (row j: the ids for owner j),
    else in their own all-to-all (owner j's ids consecutive).
    """
    owners = ops.row_owners(torch.arange(V), WORLD, "hash", V)

    def edit(ids, send_counts):
        offset = 0
        for j, c in enumerate(send_counts):
            if padded:
                ids[j, META_IDS:META_IDS + int(ids[j, META_COUNTS + j])] = wrong(j, owners)
            else:
                ids[offset:offset + c] = wrong(j, owners)
                offset += c
        return ids
    return edit


def training_step(emb, opt, ids, expected):
    """A step that must look up ``expected(full table)`` and then train (the table is re-read after each step)."""
    full = emb.full_weight()

    def still_works():
        out = emb(ids)
        assert torch.allclose(out, expected(full))
        opt.zero_grad()
        out.sum().backward()
        opt.step()
        full.copy_(emb.full_weight())
    return still_works


def case_malicious_peer(rank, world):
    emb = sh.ShardedEmbedding(V, D, seed=3, dtype=torch.float64)
    opt = sh.ShardedSGD(emb, lr=0.5)
    # The bad rank asks every owner for all of its rows; the others for a few.
    ids = torch.arange(V) if rank == BAD else torch.tensor([1, 2, 29])
    refused = 0
    still_works = training_step(emb, opt, ids, lambda full: full[ids])
    # The group's first rounds: the first message holds only headers until its width fits the padded ids.
    still_works()
    still_works()
    cases = [
        # (call to corrupt, edit, message on every rank): 0 = metadata, 1 = the ids
        (0, set_column(META_COUNTS + 0, -5), f"rank {BAD} announced -5 ids to look up on rank 0"),
        (0, set_column(META_COUNTS + 1, 10**12), f"rank {BAD} announced {10**12} ids to look up on rank 1"),
        # Within the table's rows, but more than the owner has: still impossible for unique ids.
        (0, set_column(META_COUNTS + 0, V), f"rank {BAD} announced {V} ids to look up on rank 0"),
        (0, set_column(META_NUM_LOCAL, V), "do not add up"),
        (0, set_column(META_NUM_LOCAL, -1), f"rank {BAD} announced -1 owned rows"),
        (0, set_column(META_CAPACITY, 99), f"rank {BAD}: 99)"),
        (0, set_column(5, -7), f"rank {BAD} announced a -7-column request"),
        (0, set_column(4, 2), f"rank {BAD} looks up 2"),
    ]
    for call, edit, match in cases:
        if rank == BAD:
            with Corrupt(call, edit):
                expect_value_error(lambda: emb(ids), match)
        else:
            expect_value_error(lambda: emb(ids), match)
        refused += 1
        still_works()
    # Ids with consistent counts but not the owner's: out of the table, or another rank's rows; sent in their
    # own all-to-all (a table's first round) and padded behind the metadata (every later round).
    for padded in (False, True):
        for wrong, owner_match in ((lambda j, owners: -1, "for id -1, outside [0, 30)"),
                                   (lambda j, owners: V + 1, f"for id {V + 1}, outside [0, 30)"),
                                   (lambda j, owners: int((owners != j).nonzero()[0]), "owned by another rank")):
            if not padded:
                emb._set.capacity = 0  # as before the first round: the ids take their own all-to-all
            # Every owner (the bad rank too) was sent bad ids: each names the sender and the id; all raise.
            with Corrupt(0 if padded else 1, foreign_ids(wrong, padded)) if rank == BAD else nullcontext():
                msg = expect_value_error(lambda: emb(ids), f"rank {BAD} asked rank {rank} for id")
            assert owner_match in msg, msg
            refused += 1
            still_works()
    return refused


def pooled_extras(edit_words):
    """Corrupt the pooled extras (padded behind the ids): ``edit_words(words, ids, occurrences)`` per owner row."""
    def edit(meta, _):
        for j in range(meta.shape[0]):
            ids, occ = int(meta[j, META_COUNTS + j]), int(meta[j, META_OCC + j])
            edit_words(meta[j, META_IDS + ids:], ids, occ)
        return meta
    return edit


def case_malicious_pooled_peer(rank, world):
    """A pooled bag lookup (owners pool): lies about occurrences, bags, positions and lengths raise everywhere."""
    emb = sh.ShardedEmbeddingBag(V, D, mode="sum", owner_pooling="always", seed=3, dtype=torch.float64)
    opt = sh.ShardedSGD(emb, lr=0.5)
    # Every rank's bags hit every owner (the bad rank's hold every row, twice).
    ids = torch.cat([torch.arange(V), torch.arange(V)]).view(6, 10) if rank == BAD else \
        torch.tensor([[1, 2, 29, 1], [5, 6, 7, 8]])
    still_works = training_step(emb, opt, ids, lambda full: full[ids].sum(1))
    still_works()
    still_works()
    assert emb.stats.pooled_lookups == 2 and emb.stats.row_lookups == 0

    def huge_position(words, ids, occ):
        words[0] = 1 << 40           # positions 0 and 1 (int32 pair): 0 and 256

    def empty_bag(words, ids, occ):
        words[(occ * 4 + 7) // 8] = 0  # the first two bag lengths: 0

    cases = [
        (set_column(META_PATH, 2), "impossible pooled lookup"),
        (set_column(META_WEIGHT_BYTES, 3), "impossible pooled lookup"),
        (set_column(META_OCC + 0, -1), f"rank {BAD} announced -1 id occurrences"),
        (set_column(META_OCC + 1, 1 << 40), f"rank {BAD} announced {1 << 40} id occurrences"),
        (set_column(META_BAGS + 0, 10**6), f"rank {BAD} announced"),
        (pooled_extras(huge_position), f"rank {BAD} sent rank {rank} an occurrence position outside"),
        (pooled_extras(empty_bag), f"rank {BAD} sent rank {rank} an empty bag"),
    ]
    for edit, match in cases:
        with Corrupt(0, edit) if rank == BAD else nullcontext():
            expect_value_error(lambda: emb(ids), match)
        still_works()
    return len(cases)


def case_full_table_from_bad_shards(rank, world):
    """``full_weight`` assembles the table from every rank's shard: a bad shard is refused everywhere."""
    emb = sh.ShardedEmbedding(V, D, seed=9)
    # The table's group is the library's one twin of the default group for sharded tables.
    assert emb._group is groups.twin_group(None, "sharded") is sharded_exchange.sharded_group(None)
    good = emb.full_weight()
    real = sharded_exchange.allgather_rows
    edits = [(lambda ids, values: (torch.cat([ids[:-1], ids.new_tensor([-1])]), values), "exactly once"),
             (lambda ids, values: (torch.cat([ids, ids[:1]]), torch.cat([values, values[:1]])), "exactly once"),
             (lambda ids, values: (ids[:1].repeat(V + 1), values[:1].repeat(V + 1, 1)), f"outside [0, {V}]")]
    for edit, match in edits:
        if rank == BAD:
            sharded_exchange.allgather_rows = lambda ids, values, *a, **k: real(*edit(ids, values), *a, **k)
        try:
            expect_value_error(emb.full_weight, match)
        finally:
            sharded_exchange.allgather_rows = real
    assert torch.equal(emb.full_weight(), good)


def case_bag_input_on_one_rank(rank, world):
    bag = sh.ShardedEmbeddingBag(V, D, mode="sum", seed=4, dtype=torch.float64)
    ids = torch.tensor([[1, 2], [3, 29]])
    good_psw = torch.rand(2, 2, dtype=torch.float64)
    bad_inputs = [
        (dict(per_sample_weights=good_psw.float()), "per_sample_weights must have the table's dtype"),
        (dict(per_sample_weights=good_psw.to("meta")), "per_sample_weights are on meta"),
    ]
    for kwargs, match in bad_inputs:
        mine = kwargs if rank == 1 else dict(per_sample_weights=good_psw)
        expect_value_error(lambda: bag(ids, **mine), match if rank == 1 else "rank 1 passed an invalid input")
    flat, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    bad_offsets = offsets.to("meta") if rank == 0 else offsets
    expect_value_error(lambda: bag(flat, bad_offsets), "offsets are on meta" if rank == 0 else "rank 0 passed")
    last = sh.ShardedEmbeddingBag(V, D, mode="sum", include_last_offset=True, seed=5)
    empty = torch.empty(0, dtype=torch.int64) if rank == 2 else torch.tensor([0, 3])
    expect_value_error(lambda: last(flat, empty), "at least one offset" if rank == 2 else "rank 2 passed")
    # ids after the last offset: torch's own backward reads out of bounds there, so they are refused.
    short = torch.tensor([0, 2]) if rank == world - 1 else torch.tensor([0, 3])
    expect_value_error(lambda: last(flat, short), "last offset must be len(input) = 3, got 2" if rank == world - 1
                       else f"rank {world - 1} passed")
    emb = sh.ShardedEmbedding(V, D, seed=6)
    meta_ids = ids.to("meta") if rank == 0 else ids
    expect_value_error(lambda: emb(meta_ids), "input is on meta" if rank == 0 else "rank 0 passed")
    # Still usable, with the right inputs everywhere.
    out = bag(ids, per_sample_weights=good_psw)
    assert torch.allclose(out, (bag.full_weight()[ids] * good_psw.unsqueeze(-1)).sum(1))


def case_checkpoint_checksums_split(rank, world, root):
    emb = sh.ShardedEmbedding(V, D, seed=7, dtype=torch.float64)
    model = torch.nn.Module()
    model.emb = emb
    opt = sh.ShardedSGD(model, lr=0.1)
    emb(torch.tensor([rank, 10 + rank])).sum().backward()
    opt.step()
    directory = os.path.join(root, "ck")
    sh.save(directory, model, opt)
    hashed = []
    real = files.sha256

    def counting(path):
        hashed.append(os.path.basename(path))
        return real(path)

    files.sha256 = counting
    try:
        fresh = torch.nn.Module()
        fresh.emb = sh.ShardedEmbedding(V, D, seed=8, dtype=torch.float64)
        fresh_opt = sh.ShardedSGD(fresh, lr=0.1)
        sh.load(directory, fresh, fresh_opt)
        assert torch.equal(fresh.emb.local_weight, emb.local_weight)
        assert fresh_opt.state[fresh.emb.local_weight]["step"] == 1  # SGD's step count is restored too
        mine = list(hashed)
        # One corrupted shard: only one rank hashes it, every rank refuses.
        if rank == 0:
            victim = os.path.join(directory, ckpt._shard_name(world - 1, world))
            with open(victim, "r+b") as f:
                f.seek(os.path.getsize(victim) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
        objects.barrier(fresh.emb._group)
        expect_value_error(lambda: sh.load(directory, fresh, fresh_opt), "sha256")
    finally:
        files.sha256 = real
    return mine


def _worker(rank, world, root):
    return run_cases(rank, world, (("malicious_peer", case_malicious_peer, ()),
                                   ("malicious_pooled_peer", case_malicious_pooled_peer, ()),
                                   ("full_table", case_full_table_from_bad_shards, ()),
                                   ("bag_input", case_bag_input_on_one_rank, ()),
                                   ("checksums", case_checkpoint_checksums_split, (root,))))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # A short collective timeout: a rank left waiting fails fast (and not with a ValueError).
    return run_ranks(WORLD, _worker, str(tmp_path_factory.mktemp("peers")), timeout_s=20, join_timeout_s=180)


def test_bad_counts_and_ids_from_one_peer_raise_on_every_rank(results):
    assert all(results[r]["malicious_peer"] == 14 for r in range(WORLD))


def test_a_lying_peer_of_a_pooled_lookup_raises_on_every_rank(results):
    assert all(results[r]["malicious_pooled_peer"] == 7 for r in range(WORLD))


def test_a_bad_shard_in_the_full_table_raises_on_every_rank(results):
    assert all("full_table" in results[r] for r in range(WORLD))


def test_no_group_for_a_world_of_one():
    assert sharded_exchange.sharded_group(None) is None  # no process group here: a world of one


def test_one_ranks_bad_bag_input_raises_on_every_rank(results):
    assert all("bag_input" in results[r] for r in range(WORLD))


def test_checkpoint_load_hashes_each_file_once_across_ranks(results):
    hashed = [name for r in range(WORLD) for name in results[r]["checksums"]]
    expected = sorted([ckpt._shard_name(r, WORLD) for r in range(WORLD)] + [ckpt.DENSE])
    assert sorted(hashed) == expected
