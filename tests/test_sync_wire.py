"""The sync metadata's wire format (collectives/sync_wire.py): sizes as documented, encode/decode, checks.

Single-process: a plan and rows are built by hand for world sizes 1-8, nothing is exchanged.
"""

from __future__ import annotations

import re

import pytest
import torch

from sparsecomm.collectives import methods, sync_wire
from sparsecomm.collectives.sync_plan import SyncPlan, TensorRows
from sparsecomm.types import ReduceOp, SparseSyncStats, SyncMethod, WireStatus


def _plan(world: int, rank: int = 0) -> SyncPlan:
    return SyncPlan(ReduceOp.SUM, "hash", [SyncMethod.PARTITIONED], 1, True, "raise", torch.device("cpu"),
                    world_size=world, rank=rank)


def _rows(k: int, shape=(50, 3), method=SyncMethod.PARTITIONED) -> TensorRows:
    t = torch.sparse_coo_tensor(torch.arange(k)[None], torch.ones(k, shape[1]), shape, check_invariants=False)
    return TensorRows(t, methods.path_for(method), SparseSyncStats(), (shape[0],), shape[0], torch.int16,
                      torch.arange(k), torch.ones(k, shape[1]), input_rows=k, runs_count=min(k, 1))


def _documented_words_per_tensor(world: int) -> int:
    # "a rank's message for T tensors is ``T * (21 + N)`` int64"
    m = re.search(r"message for T tensors is ``T \* \((\d+) \+ N\)``", sync_wire.__doc__)
    assert m, "the module docstring must state the message size"
    return int(m.group(1)) + world


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("tensors", [1, 3])
def test_message_size_is_the_documented_formula(world, tensors):
    plan = _plan(world)
    rows = [_rows(5 + i) for i in range(tensors)]
    for r in rows:
        r.part = None
    words = sync_wire.message(rows, plan)
    assert len(words) == tensors * _documented_words_per_tensor(world) == tensors * sync_wire.record_width(world)
    assert sync_wire.record_width(world) == sync_wire.RECORD_FIXED + world


def test_a_record_decodes_to_what_was_encoded():
    plan = _plan(4)
    t = _rows(7)
    t.status = WireStatus.NONFINITE
    rec = sync_wire.decode(sync_wire.encode(t, plan, [1, 2, 3, 1]))
    assert rec.magic == sync_wire.MAGIC and rec.status == WireStatus.NONFINITE and rec.k == 7
    assert rec.push == (1, 2, 3, 1) and len(rec.header) == sync_wire.HEADER_WORDS
    assert "shape=(50, 3)" in sync_wire.describe(rec.header) and "method=partitioned" in sync_wire.describe(rec.header)


def test_an_unknown_code_is_described_by_its_number_not_misread():
    header = list(sync_wire.decode(sync_wire.encode(_rows(3), _plan(2), [0, 0])).header)
    header[14], header[16] = 7, 99  # a scheme and a method no rank of this version has
    text = sync_wire.describe(header)
    assert "scheme=7" in text and "method=99" in text


def test_check_refuses_what_a_lying_peer_sends_on_every_rank():
    plan = _plan(2)
    t = _rows(4)
    t.part = object()  # the tensor is partitioned: push counts must add up to k
    good = sync_wire.decode(sync_wire.encode(t, plan, [2, 2]))
    sync_wire.check([good, good], t, plan)
    bad_counts = sync_wire.decode(sync_wire.encode(t, plan, [5, -1]))
    with pytest.raises(ValueError, match="rank 1 sent inconsistent row counts"):
        sync_wire.check([good, bad_counts], t, plan)
    other = _rows(4, shape=(60, 3))
    other.part = t.part
    with pytest.raises(ValueError, match="ranks disagree on the tensor"):
        sync_wire.check([good, sync_wire.decode(sync_wire.encode(other, plan, [2, 2]))], t, plan)
    not_in_call = sync_wire.Record((0,) * sync_wire.HEADER_WORDS, 0, 0, 0, 0, (0, 0))
    with pytest.raises(ValueError, match="rank 1 is not in a sparse_allreduce call"):
        sync_wire.check([good, not_in_call], t, plan)
