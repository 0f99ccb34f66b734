"""A model's sharded tables together: find them, group them into shared rounds, settle their updates.

Above the tables (:mod:`sparsecomm.sharded.embedding`) and their rounds
(:mod:`sparsecomm.sharded.lookup`): :func:`group_tables` makes every sharded
table of a model join one lazy :class:`~sparsecomm.sharded.lookup.TableSet`
(one exchange per direction per step for all of them), and :func:`flush`
runs every open round and pushes every pending deferred gradient.
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from sparsecomm.collectives.step_order import anchor
from sparsecomm.sharded.lookup import TableSet
from sparsecomm.sharded.pending import resolve
from sparsecomm.sharded.table import ShardedTable
from sparsecomm.sharded.wire import check_compression

__all__ = ["sharded_modules", "group_tables", "flush", "split_round_message"]


def sharded_modules(model: nn.Module) -> List[Tuple[str, ShardedTable]]:
    """``(name, table)`` for every sharded table in ``model`` (a DDP wrapper is looked through)."""
    inner = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
    return [(name, m) for name, m in inner.named_modules() if isinstance(m, ShardedTable)]


def group_tables(model: nn.Module, tables: Optional[Sequence[ShardedTable]] = None, *,
                 compression: Optional[str] = None) -> TableSet:
    """Make the sharded tables of ``model`` share lookup rounds (lazy): one exchange per direction per step.

    Every rank calls it, on the same model. A forward hook on ``model`` runs
    any round still open when its forward returns, and gives the caller real
    tensors in place of placeholders. It also anchors the forward's rounds to
    the output (an exact zero, no gradient): backward through the output
    then pushes every round on every rank, also where that rank's loss does
    not use a round's results (zero rows).

    Args:
        model: the module whose forward looks the tables up (not a DDP wrapper:
            pass ``ddp.module``, or group before wrapping).
        tables: the tables to group (default: every sharded table of ``model``).
        compression: None (default: exact), ``"bf16"`` or ``"fp16"``: every
            grouped table's rows and gradient rows travel in that dtype
            (:attr:`~sparsecomm.sharded.table.ShardedTable.compression`).

    Returns:
        The :class:`~sparsecomm.sharded.lookup.TableSet` (``flush()`` runs an
        open round by hand; ``stats`` counts the bytes of every round).
    """
    if tables is None:
        tables = [t for _, t in sharded_modules(model)]
    if not tables:
        raise ValueError(f"{type(model).__name__} contains no sharded table to group")
    compression = check_compression(compression)
    table_set = TableSet(tables, lazy=True)
    for t in tables:
        t.table_set.settle()  # a lookup still pending in its old set runs there first, and its gradient is pushed
        t.table_set = table_set
        t.compression = compression

    names = {id(t): n for n, t in sharded_modules(model)}
    labels = [names.get(id(t), type(t).__name__) for t in table_set.tables]
    warned = []

    def finish_forward(module, args, output):
        if torch.compiler.is_compiling():
            return output  # compiled lookups run their rounds at once (sparsecomm.sharded.compiled)
        table_set.flush()
        rounds = table_set.take_forward_rounds()
        if len(rounds) > 1 and not warned:
            warned.append(True)
            warnings.warn(split_round_message(rounds, labels), stacklevel=2)
        return anchor(resolve(output), table_set.take_forward_rows())

    table_set.hook = model.register_forward_hook(finish_forward)
    return table_set


def split_round_message(rounds: Sequence[Sequence[int]], labels: Sequence[str]) -> str:
    """The warning of a forward whose grouped lookups ran in several rounds, naming each round's tables."""
    listed = " then ".join("[" + ", ".join(labels[i] for i in r) + "]" for r in rounds)
    return (f"sparsecomm: one forward looked its grouped sharded tables up in {len(rounds)} rounds ({listed}): "
            f"a lookup's result was used before every table was looked up, so the round split, and each round "
            f"costs its own exchanges (2-3 collectives each way). Look every table up before using any result "
            f"to keep one round per step. (Warned once per model.)")


def flush(model: nn.Module) -> None:
    """Run every open round of ``model``'s sharded tables, and push any gradient a ``defer=True`` optimizer left
    pending (collective): afterwards every shard and its optimizer state hold every update."""
    done = set()
    for _, t in sharded_modules(model):
        if id(t.table_set) not in done:
            done.add(id(t.table_set))
            t.table_set.settle()
