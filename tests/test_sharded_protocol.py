"""The interface between a lookup round and its tables: the tables implement it, the round uses nothing else.

``LookupTable`` (what the round uses of a table) and ``LookupRounds`` (what
a table uses of its set) are ``typing.Protocol`` classes; here both sides
are checked against them, in one process (a world of one).
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch

import sparsecomm.sharded as sh
from sparsecomm.sharded.lookup import TableSet
from sparsecomm.sharded.protocol import LookupRounds, LookupTable

SHARDED = pathlib.Path(sh.__file__).parent
# The modules on the round's side of the interface.
ROUND_SIDE = ["lookup.py", "requester.py", "owner.py", "pooling.py", "pending.py", "bag_pooling.py", "model.py",
              "compiled.py", "hot.py", "optimizer.py", "checkpoint.py"]
# The members a table keeps to itself.
TABLE_PRIVATE = {"_set", "_group", "_optimizer", "_padding_position", "_owner_gradient", "_hot_gradient",
                 "_lookup", "_drop_hot", "_attach_optimizer", "_kind", "_anchor", "_key"}


def members(protocol) -> set:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


@pytest.mark.parametrize("make", [lambda: sh.ShardedEmbedding(20, 3, padding_idx=2),
                                  lambda: sh.ShardedEmbeddingBag(20, 3, mode="sum")])
def test_the_tables_implement_what_a_round_uses(make):
    table = make()
    assert {"group", "optimizer", "fingerprint", "padding_position", "owner_gradient", "hot_gradient",
            "table_set", "layout", "local_weight"} <= members(LookupTable)
    for name in members(LookupTable):
        assert hasattr(table, name), f"{type(table).__name__} lacks LookupTable.{name}"
    assert table.group is None and table.optimizer is None and table.owner_pooling in ("never", "auto")
    opt = sh.ShardedSGD(table, lr=0.1)
    assert table.optimizer is opt
    unique = torch.tensor([0, 2, 5])
    assert table.padding_position(unique) == (1 if table.padding_idx == 2 else None)


def test_the_set_implements_what_a_table_uses():
    table = sh.ShardedEmbedding(20, 3)
    assert isinstance(table.table_set, TableSet)
    for name in members(LookupRounds):
        assert callable(getattr(table.table_set, name, None)), f"TableSet lacks LookupRounds.{name}"


@pytest.mark.parametrize("module", ROUND_SIDE)
def test_the_round_side_reads_no_private_member_of_a_table(module):
    tree = ast.parse((SHARDED / module).read_text())
    bad = sorted({(node.attr, node.lineno) for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in TABLE_PRIVATE
                  and not (isinstance(node.value, ast.Name) and node.value.id == "self")})
    assert not bad, f"{module} reads a table's private members: {bad}"


def test_protocol_signatures_match_the_tables():
    for name in ("owner_gradient", "hot_gradient", "padding_position", "fingerprint"):
        want = list(inspect.signature(getattr(LookupTable, name)).parameters)
        got = list(inspect.signature(getattr(sh.ShardedEmbedding, name)).parameters)
        assert got == want, f"{name}: {got} != {want}"
