"""``fully_shard`` (FSDP2) for the dense part of a model whose tables are partly sharded.

``sparsecomm.parallelize(..., dense="fsdp")`` (or a model some of whose
submodules are already ``fully_shard``-ed) puts the model minus its sharded
tables under one ``fully_shard`` at the root, after the user's own
``fully_shard`` calls on submodules, as FSDP2 expects (children first):

- the sharded tables stay outside FSDP: their parameters (``weight``, a
  zero-element frozen name) are ``fully_shard``'s ``ignored_params``, and
  their rows (``local_weight``) are neither parameter nor buffer; they keep
  their own lookup round and owner-side optimizer;
- everything else (dense layers, replicated tables) is FSDP's: each rank
  keeps 1/N of every parameter (a ``DTensor``), all-gathered for forward and
  backward, its gradient reduce-scattered as the ranks' mean, so training
  equals single-process training on the whole batch.

FSDP2 does not broadcast: :func:`shard_dense` first copies rank 0's
parameters and buffers to every rank, as DDP does at construction. The
parameters of a submodule the user already ``fully_shard``-ed are left as
they are: each rank holds one shard of them, so they are one model already
(made of each rank's shard of its own initialization), and rank 0's whole
tensors no longer exist anywhere.

What FSDP cannot hold is refused by :func:`check_fsdp`, before anything
changes, with the table's name and the fix:

- a replicated table with ``sparse=True`` that trains: FSDP's reduce-scatter
  takes dense gradients only (converting it silently would change the
  optimizer's rule for Adam and the module the user wrote);
- a replicated table with ``max_norm``: it renormalizes rows in place in the
  all-gathered copy, which FSDP discards;
- a table the plan shards inside a submodule already ``fully_shard``-ed: its
  weight is FSDP's already.

FSDP2 reduce-scatters the gradients a rank has: every rank must use the same
dense parameters in a step (sharded tables' lookups may differ by rank; a
dense parameter unused on some ranks only makes the reduce-scatter fail).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from sparsecomm.collectives.dense import broadcast_

__all__ = ["DENSE_WRAPPERS", "fsdp_submodules", "check_fsdp", "shard_dense"]

DENSE_WRAPPERS = ("ddp", "fsdp")


def fsdp_submodules(model: nn.Module) -> List[str]:
    """Names of ``model``'s submodules already ``fully_shard``-ed (the root excluded), in module order."""
    return [name for name, m in model.named_modules() if name and isinstance(m, FSDPModule)]


def _owner(name: str, presharded: Sequence[str]) -> Optional[str]:
    """The submodule already ``fully_shard``-ed that holds module ``name``, or None."""
    return next((p for p in presharded if name == p or name.startswith(p + ".")), None)


def check_fsdp(model: nn.Module, sharded: Sequence[str]) -> None:
    """Refuse, before anything changes, the tables ``fully_shard`` cannot hold.

    Args:
        model: the model, not yet changed.
        sharded: the tables the plan shards.

    Raises:
        ValueError: naming the table and the fix.
    """
    presharded = fsdp_submodules(model)
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        owner = _owner(name, presharded)
        if name in sharded:
            if owner is not None:
                raise ValueError(f"sparsecomm.parallelize: table {name!r} is planned sharded but lies in {owner!r}, "
                                 f"already fully_shard-ed (its weight is FSDP's): replicate it "
                                 f"(plan.override({name!r}, 'replicate')) or leave {owner!r} out of fully_shard")
            continue
        fix = ("make it sparse=False or do not fully_shard it (parallelize can shard it)" if owner == name else
               f"shard it (plan.override({name!r}, 'shard')) or make it sparse=False")
        if m.sparse and m.weight.requires_grad:
            raise ValueError(f"sparsecomm.parallelize: table {name!r} is replicated with sparse=True, but "
                             f"fully_shard (dense='fsdp') reduce-scatters dense gradients only: {fix}")
        if m.max_norm is not None:
            raise ValueError(f"sparsecomm.parallelize: table {name!r} is replicated with max_norm={m.max_norm}, "
                             f"which renormalizes rows in place in fully_shard's gathered copy (dense='fsdp' "
                             f"discards it): shard it (plan.override({name!r}, 'shard')), drop max_norm, or use "
                             f"dense='ddp'")


@torch.no_grad()
def _copy_rank0(model: nn.Module, skip: set, src: int, group: Optional[dist.ProcessGroup]) -> None:
    """Every parameter and buffer of ``model`` but ``skip``'s and FSDP's, overwritten with group rank 0's
    (global rank ``src``)."""
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in skip and not isinstance(t, DTensor):   # a DTensor: fully_shard-ed already, one model
            broadcast_(t.data, src, group)


def shard_dense(model: nn.Module, tables: Sequence[nn.Module], process_group: Optional[dist.ProcessGroup],
                src: int) -> bool:
    """Apply ``fully_shard`` to ``model``'s root around its sharded ``tables``, with rank 0's weights; collective.

    Args:
        model: the model, its planned tables already sharded (``tables``).
        tables: its sharded table modules (left out of FSDP).
        process_group: the ranks training together (default: the whole world).
        src: the global rank of ``process_group``'s rank 0.

    Returns:
        Whether ``fully_shard`` was applied (not when no parameter is left
        for it).
    """
    ignored = {p for t in tables for p in t.parameters()}
    skip = {id(p) for p in ignored}
    dense = [p for p in model.parameters() if id(p) not in skip]
    if not dense:
        return False
    group = process_group or dist.group.WORLD
    _copy_rank0(model, skip, src, process_group)
    mesh = DeviceMesh.from_group(group, dense[0].device.type)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    return True
