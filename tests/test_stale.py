"""Stale replicas (``sparsecomm.stale``): moves that send only changed rows give the bits of whole-table moves.

The model of tests/test_replan.py goes through a chain of plans that moves
its tables between replicated, hash, range and table-wise (on the last rank,
then on rank 0), one training step between plans, twice in one process: with
stale replicas and without. After every step both equal single-process
training; at the end they are equal bit for bit, and the stale moves sent
fewer rows than whole tables. A row (and a row's optimizer state alone)
edited behind the optimizer's back, as a checkpoint load would, travels too (the shard's row log sees the
write through the tensor's version and gives way to the comparison), and ranks that do not all hold a copy
move whole tables. A table-wise owner's shard is its copy's memory, and a hash shard spreads over it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import sparsecomm
from sparsecomm import stale as stale_module
from sparsecomm.sharded.table import ShardedTable
from sparsecomm.sharded.row_log import RowLog
from sparsecomm.stale import StaleReplicas, changed_rows, same_memory

import test_replan as rp
from distributed import full_weights, spawned_fixture

R, H, G, LAST, FIRST = "replicate", "hash", "range", "table:last", "table:0"
EDIT_AT = (2, 3)   # table a is a spread hash shard, then a table-wise one, when the edits run
# a and b meet every pair of placements with a stale copy in hand; c is sparse=False (replicated under Adam).
PLACES = {"a": [R, H, LAST, G, R, FIRST, H, R],
          "b": [R, LAST, H, R, G, FIRST, R, H],
          "c": [R, R, H, LAST, R, G, R, R]}


def plan_for(p, places, index, world):
    for table, where in places.items():
        at = where[index]
        if at == R:
            p.override(table, R)
        elif at.startswith("table:"):
            p.override(table, "shard", "table", owner=world - 1 if at == LAST else 0)
        else:
            p.override(table, "shard", at)
    return p


def edit_rows(model, opt, ref, index):
    """Set row 5 of table ``a`` and (Adagrad) row 7's sum, on its owner and in the reference: changes no optimizer
    step made, the second in the state only. Table ``a`` is sharded when this runs."""
    value = 0.25 + index
    t = rp.inner_of(model).a
    assert isinstance(t, ShardedTable)
    with torch.no_grad():
        ref.model.a.weight[5] = value
        t.local_weight[owned_slot(t, 5)] = value
        ref_state = ref.opts[0].state.get(ref.model.a.weight, {})
        if "sum" in ref_state:
            ref_state["sum"][7] = 2.0 + index
            opt.sharded.state[t.local_weight]["sum"][owned_slot(t, 7)] = 2.0 + index


def owned_slot(t, row):
    """Row ``row``'s slot in table ``t``'s shard on this rank: one slot, or none where another rank owns it."""
    ids = torch.tensor([row])
    return t.layout.slots(ids[t.layout.owns(ids)])


def run_chain(rank, world, name, replicas):
    cls, kw = rp.OPTIMIZERS[name]
    net = rp.Net(seed=3 if rank == 0 else 40 + rank)
    places = {t: ([R] * len(p) if name in rp.LAZY and t == "c" else p) for t, p in PLACES.items()}
    p0 = sparsecomm.plan(net, small_table_bytes=0)
    model, opt = sparsecomm.parallelize(net, cls, plan=plan_for(p0, places, 0, world), **kw)
    ref, sched = rp.Reference(name), rp.scheduler(name, opt)   # the reference steps its own
    for i in range(len(places["a"])):
        if i:
            if i in EDIT_AT:
                edit_rows(model, opt, ref, i)
            opt.zero_grad()
            new_plan = plan_for(copy.deepcopy(rp.inner_of(model).sparsecomm_plan), places, i, world)
            model, opt = sparsecomm.replan(model, opt, new_plan, stale=replicas)
            t = rp.inner_of(model).a
            if replicas is not None and isinstance(t, ShardedTable) and "a" in replicas:
                spread = t.scheme == "hash" and world > 1
                assert t.layout.spread == spread, (i, t.layout)
                if t.owner == rank or spread:
                    assert same_memory(t.local_weight, replicas.get("a").weight), \
                        "a table-wise owner's shard, and a hash one, are the copy's memory"
        rp.train_step(model, opt, sched, i, rank, world)
        ref.step(i)
        rp.assert_same(model, ref.model, f"{name}, world {world}, stale {replicas is not None}, plan {i}")
    names = {id(p): n for n, p in rp.inner_of(model).named_parameters()}
    state = {f"{names[id(p)]}.{k}": v for part in opt.parts.values() for p, st in part.state.items()
             for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() and id(p) in names}
    assert "a.weight.sum" in state or name != "adagrad"   # a is replicated at the end: its state is whole
    return {**full_weights(model), **state}


def case_same_bits(rank, world, name):
    """With and without stale replicas: the same bits, fewer rows sent with them."""
    replicas = StaleReplicas()
    with_copies = run_chain(rank, world, name, replicas)
    whole = run_chain(rank, world, name, None)
    for k in whole:
        assert torch.equal(with_copies[k], whole[k]), f"{name}: {k} differs between stale and whole moves"
    if world > 1:
        assert 0 < replicas.rows_sent < replicas.rows_total, (replicas.rows_sent, replicas.rows_total)
        # The row logs answered most moves; the edited tables were compared (or, aliased, sent whole).
        assert replicas.rows_compared < replicas.rows_total, (replicas.rows_compared, replicas.rows_total)
    return replicas.rows_sent, replicas.rows_total


def case_not_everyone(rank, world):
    """Only rank 0 holds copies: every rank moves whole tables, and trains exactly."""
    run_chain(rank, world, "adagrad", StaleReplicas() if rank == 0 else None)
    return True


def case_collectives_per_move(rank, world):
    """A move of every table from its copy: one count all-gather and one row exchange for all of them, and no
    collective per new table (replan agreed on the placements); with a bound on an exchange's bytes below one
    table's rows, one exchange a table. Training stays exact."""
    assert collectives_of_moves(rank, world) == {"counts": 1, "shards": [3], "tables": 0}
    bound = stale_module._EXCHANGE_BYTES
    stale_module._EXCHANGE_BYTES = 1
    try:
        assert collectives_of_moves(rank, world) == {"counts": 1, "shards": [1, 1, 1], "tables": 0}
    finally:
        stale_module._EXCHANGE_BYTES = bound
    return True


def collectives_of_moves(rank, world):
    """The collectives of two moves of the three tables (replicas to hash shards, then to table-wise on rank 0),
    training checked against single-process training after every step."""
    from sparsecomm.sharded import table as table_module

    calls = {"counts": 0, "shards": [], "tables": 0}
    originals = (stale_module.all_gather_objects, stale_module.allgather_shards, table_module.all_gather_objects)

    def counts(obj, group):
        calls["counts"] += 1
        return originals[0](obj, group)

    def shards(items, per_table, group):
        calls["shards"].append(len(items))
        return originals[1](items, per_table, group)

    def tables(obj, group):
        calls["tables"] += 1
        return originals[2](obj, group)

    replicas, (cls, kw) = StaleReplicas(), rp.OPTIMIZERS["adagrad"]
    net = rp.Net(seed=3 if rank == 0 else 40 + rank)
    places = {t: [R, H, FIRST] for t in PLACES}
    model, opt = sparsecomm.parallelize(net, cls, plan=plan_for(sparsecomm.plan(net, small_table_bytes=0), places,
                                                                0, world), **kw)
    ref, sched = rp.Reference("adagrad"), rp.scheduler("adagrad", opt)
    for i in range(3):
        if i:
            opt.zero_grad()
            new_plan = plan_for(copy.deepcopy(rp.inner_of(model).sparsecomm_plan), places, i, world)
            stale_module.all_gather_objects, stale_module.allgather_shards = counts, shards
            table_module.all_gather_objects = tables
            try:
                model, opt = sparsecomm.replan(model, opt, new_plan, stale=replicas)
            finally:
                stale_module.all_gather_objects, stale_module.allgather_shards, table_module.all_gather_objects = \
                    originals
        rp.train_step(model, opt, sched, i, rank, world)
        ref.step(i)
        rp.assert_same(model, ref.model, f"collectives, world {world}, plan {i}")
    return calls   # move 1 refreshes nothing (the shards are cut from the replicas); move 2 the three tables


CASES = [(f"same-bits-{n}", case_same_bits, (n,)) for n in ("sgd", "adagrad", "adam")] + \
        [("not-everyone", case_not_everyone, ()), ("collectives-per-move", case_collectives_per_move, ())]
spawned = spawned_fixture(CASES)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_on_ranks(spawned, case):
    world, out = spawned
    assert all(out[r][case] for r in range(world)), f"world {world}, {case}"


def test_one_rank():
    sent, total = case_same_bits(0, 1, "adagrad")
    assert sent <= total


def test_changed_rows_compares_bits(monkeypatch):
    monkeypatch.setattr(stale_module, "_CHUNK_ROWS", 3)   # rows across several chunks
    old = torch.zeros(10, 2)
    old[4, 1] = float("nan")
    ids = torch.tensor([9, 0, 4, 2, 7, 3, 1])
    cur = old[ids].clone()
    assert changed_rows(ids, [cur], [old]).tolist() == []        # a NaN equals its own bits
    cur[1, 0] = -0.0                                             # id 0: 0.0 -> -0.0, equal as numbers
    cur[4, 1] = 1e-45                                            # id 7: a denormal
    cur[6, 0] = 1.0                                              # id 1, in the last chunk
    assert changed_rows(ids, [cur], [old]).tolist() == [1, 4, 6]
    state, old_state = torch.zeros(7, 1, dtype=torch.float64), torch.zeros(10, 1, dtype=torch.float64)
    state[2] = 3.0                                               # id 4's state only
    assert changed_rows(ids, [cur, state], [old, old_state]).tolist() == [1, 2, 4, 6]


def test_row_log_sees_writes_it_is_not_told_of():
    w, s = torch.zeros(6, 2), torch.zeros(6)
    log = RowLog([w, s])
    assert log.complete([w, s]) and log.slots().tolist() == []
    w[3] += 1.0
    assert not log.complete([w, s])                     # a write it was not told of
    log.mark(torch.tensor([3, 1]))
    assert log.complete([w, s]) and log.slots().tolist() == [1, 3]
    s[0] = 2.0                                          # the state alone
    assert not log.complete([w, s])
    log.mark(torch.tensor([0]))
    assert not log.complete([w, s.clone()])             # a replaced state tensor
    assert not log.complete([w])
    assert log.complete([w, s]) and log.slots().tolist() == [0, 1, 3]
