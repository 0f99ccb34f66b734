"""A sharded table as ``torch.distributed.checkpoint`` sees it: the whole table in id order, one chunk a rank.

DCP, and what is built on it (``get_state_dict``/``set_state_dict``,
``full_state_dict=True``, TorchTitan's and Lightning's checkpointing), saves
and reshards a tensor it can describe as boxes of one global tensor: a
``DTensor`` or ``ShardedTensor`` whose local part is a contiguous block. A
hash-sharded shard is no such block (its rows are scattered over the table),
and handing DCP the shard as a plain tensor keeps one rank's copy and loses
the rest. So a table's state dict holds the *table itself*, row ``i`` being
id ``i``, as a DTensor placed ``Shard(0)`` over the table's group: rank ``r``
holds the chunk ``[r c, (r + 1) c)``, ``c = ceil(V / N)`` (the range scheme's
blocks, torch's chunking of ``Shard(0)``). Under ``"range"`` that chunk is
the shard (no copy); under ``"hash"`` one all-to-all moves each row from its
owner to the rank whose chunk holds it (:func:`to_id_order`) and one moves it
back on load (:func:`from_id_order`). Both sides know every count from the two
layouts, so nothing but the rows travels. Row-aligned optimizer state (Adam's
moments, Adagrad's sums, row-wise or not) travels the same way.

Because the global tensor is the table, a checkpoint written from any world
size and scheme loads into any other, into ``nn.Embedding(Bag)`` through
DCP, and ``full_state_dict=True`` gathers exactly the ``weight`` of the
original single-process model.

Loading takes either form of a row tensor (:func:`classify`): the DTensor
chunks above or a full ``(V, ...)`` tensor (a full state dict). Every rank
reports what it got (:class:`Verdict`) and the ranks agree (:func:`agree_on`)
before any row moves, so a bad or mismatched state dict raises on every rank
and changes nothing.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparsecomm.collectives.exchange import exchange_direct
from sparsecomm.collectives.groups import comm_device
from sparsecomm.collectives.objects import all_gather_objects
from sparsecomm.sharded.layout import RowLayout
from sparsecomm.types import PartitionScheme

__all__ = ["chunk_bounds", "to_id_order", "from_id_order", "as_global", "classify", "Verdict", "agree_on",
           "CHUNKS", "FULL", "MISSING", "INVALID"]

# What a rank found in a state dict for one row tensor (Verdict.kind).
CHUNKS, FULL, MISSING, INVALID = "chunks", "full", "missing", "invalid"


class Verdict(NamedTuple):
    """What one rank found for one row tensor: its form (``CHUNKS``, ``FULL``, ``MISSING`` or ``INVALID``),
    the table it was checked against (``(V, row shape, scheme)``, the same on every rank), the problem if invalid."""

    kind: str
    table: Tuple[int, Tuple[int, ...], str]
    problem: Optional[str] = None


class _Routes(NamedTuple):
    """How rows move between the shards and the id-order chunks of one layout (both directions)."""

    to_chunks: List[int]      # rows this rank's shard sends to each rank's chunk
    to_shards: List[int]      # rows of this rank's chunk each rank's shard holds
    order: torch.Tensor       # chunk positions, grouped by the shard that holds them (ids ascending within)


def chunk_bounds(layout: RowLayout) -> Tuple[int, int]:
    """``[lo, hi)``: the ids of this rank's chunk of the table in id order (``Shard(0)``'s chunk)."""
    lo = min(layout.num_embeddings, layout.rank * layout.range_size)
    return lo, min(layout.num_embeddings, lo + layout.range_size)


def _in_place(layout: RowLayout, group: Optional[dist.ProcessGroup]) -> bool:
    """Whether the shard already is this rank's chunk (no peers, or the range scheme's blocks)."""
    return group is None or layout.scheme == PartitionScheme.RANGE


def _routes(layout: RowLayout) -> _Routes:
    n = layout.world_size
    owned = layout.owned_ids().cpu()          # ascending: slot order
    lo, hi = chunk_bounds(layout)
    holders = layout.owners(torch.arange(lo, hi, dtype=torch.int64))
    return _Routes(torch.bincount(owned // layout.range_size, minlength=n).tolist(),
                   torch.bincount(holders, minlength=n).tolist(), torch.argsort(holders, stable=True))


def to_id_order(layout: RowLayout, shards: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]
                ) -> List[torch.Tensor]:
    """This rank's chunk of each row-aligned shard tensor, rows in id order (collective, one all-to-all).

    Args:
        layout: the table's layout.
        shards: tensors with one row per slot (the shard, its optimizer
            state; spread ones give their owned rows); they travel together.
        group: the table's group (None: a world of one).

    Returns:
        Per tensor, the rows ``chunk_bounds(layout)``: the tensor itself
        under the range scheme or without peers, a new tensor otherwise.
    """
    shards = [layout.owned_rows(s) for s in shards]
    if _in_place(layout, group):
        return shards
    r = _routes(layout)
    got = exchange_direct([shards], [r.to_chunks], [r.to_shards], group,
                          comm_device(group, shards[0].device))[0]
    out = []
    for rows, like in zip(got, shards):
        chunk = torch.empty_like(rows)
        chunk[r.order.to(rows.device)] = rows   # rows arrive grouped by holder, ids ascending within
        out.append(chunk.to(like.device))
    return out


def from_id_order(layout: RowLayout, chunks: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]
                  ) -> List[torch.Tensor]:
    """The inverse of :func:`to_id_order`: each shard's owned rows, in id order, from every rank's chunk
    (collective; write them with ``layout.put_owned_rows``).

    Under the range scheme or without peers the chunks are returned as they are.
    """
    if _in_place(layout, group):
        return list(chunks)
    r = _routes(layout)
    send = [c.index_select(0, r.order.to(c.device)) for c in chunks]
    # From chunk j come my ids inside it, ascending: concatenated over j they are my ids in slot order.
    got = exchange_direct([send], [r.to_shards], [r.to_chunks], group, comm_device(group, chunks[0].device))[0]
    return [rows.to(c.device) for rows, c in zip(got, chunks)]


@functools.lru_cache(maxsize=None)
def _mesh(group: dist.ProcessGroup, device_type: str):
    # The DTensor modules load on first use: a training step never needs them.
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def as_global(chunk: torch.Tensor, layout: RowLayout, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The whole table (or a row-aligned state of it) for a state dict: ``chunk`` placed ``Shard(0)`` as a DTensor
    over ``group``; without peers, ``chunk`` itself (it is the whole table)."""
    if group is None:
        return chunk
    from torch.distributed.tensor import DTensor, Shard

    shape = (layout.num_embeddings,) + tuple(chunk.shape[1:])
    stride, step = [], 1
    for size in reversed(shape):  # contiguous, like the local chunk
        stride.insert(0, step)
        step *= size
    return DTensor.from_local(chunk, _mesh(group, chunk.device.type), [Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def _loaded_type(module: str, name: str) -> Optional[type]:
    """A class of a torch module if the module is loaded (a value of that class implies it is), else None."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _dtensor_rows(value: Any, layout: RowLayout, full: Tuple[int, ...]) -> Tuple[str, Any]:
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(value.placements)
    if placements == (Replicate(),):
        return FULL, value.to_local()
    if placements != (Shard(0),) or value.device_mesh.size() != layout.world_size:
        return (f"a DTensor placed {list(placements)} over {value.device_mesh.size()} ranks; expected Shard(0) "
                f"over the table's {layout.world_size} ranks (what the table's state_dict() gives)"), None
    local = value.to_local()
    lo, hi = chunk_bounds(layout)
    if tuple(local.shape) != (hi - lo,) + full[1:]:
        return f"this rank's chunk has shape {tuple(local.shape)}, expected {(hi - lo,) + full[1:]}", None
    return CHUNKS, local


def classify(value: Any, layout: RowLayout, row_shape: Tuple[int, ...]) -> Tuple[Verdict, Optional[torch.Tensor]]:
    """What a state dict holds for one of a table's row tensors, checked on this rank alone.

    Args:
        value: the state dict's entry (None: the key is missing).
        layout: the table's layout.
        row_shape: the shape of one row (``(d,)`` for a weight, ``()`` for a row-wise accumulator).

    Returns:
        ``(verdict, rows)``: for ``CHUNKS`` this rank's chunk (a plain
        tensor), for ``FULL`` the whole table; None otherwise.
    """
    table = (layout.num_embeddings, tuple(int(s) for s in row_shape), layout.scheme)
    full = (layout.num_embeddings,) + tuple(row_shape)
    sharded_tensor = _loaded_type("torch.distributed._shard.sharded_tensor", "ShardedTensor")
    dtensor = _loaded_type("torch.distributed.tensor", "DTensor")
    if value is None:
        return Verdict(MISSING, table), None
    if not isinstance(value, torch.Tensor) or (sharded_tensor is not None and isinstance(value, sharded_tensor)):
        return Verdict(INVALID, table, f"a {type(value).__name__}; expected a DTensor or a full tensor"), None
    if tuple(value.shape) != full:
        return Verdict(INVALID, table, f"shape {tuple(value.shape)}, expected the whole table {full} (a DTensor "
                                       f"from the table's state_dict() or a full tensor)"), None
    if dtensor is not None and isinstance(value, dtensor):
        kind, rows = _dtensor_rows(value, layout, full)
        return (Verdict(kind, table), rows) if rows is not None else (Verdict(INVALID, table, kind), None)
    return Verdict(FULL, table), value


def agree_on(verdicts: Sequence[Verdict], group: Optional[dist.ProcessGroup], what: str) -> List[str]:
    """Agree across ranks on the verdicts of several tables (collective, one all-gather of objects).

    Returns:
        Each table's kind, the same on every rank.

    Raises:
        ValueError: on every rank, when any rank found a problem, or the
            ranks' tables or the forms of their state differ.
    """
    everyone = all_gather_objects(list(verdicts), group)
    for r, mine in enumerate(everyone):
        for v in mine:
            if v.problem:
                who = f"rank {r}: " if len(everyone) > 1 else ""
                raise ValueError(f"{what}: {who}{v.problem}")
    kinds = []
    for t, v in enumerate(everyone[0]):
        seen = [mine[t] for mine in everyone]
        if len({(s.kind, s.table) for s in seen}) > 1:
            raise ValueError(f"{what}: the ranks' state differs: " + ", ".join(
                f"rank {r} has {s.kind} rows for a {s.table[0]}-row {s.table[2]!r} table with rows of shape {s.table[1]}"
                for r, s in enumerate(seen)))
        kinds.append(v.kind)
    return kinds
