"""The machinery shared by the sharded embedding modules: the shard, its contents, its state, its rounds.

:class:`ShardedTable` is the base of ``ShardedEmbedding`` and
``ShardedEmbeddingBag`` (:mod:`sparsecomm.sharded.embedding`). It stores the
rows this rank owns (``local_weight``, at ``layout.slots(ids)``: in
``layout.owned_ids()`` order, or spread over a kept replica's rows) and
joins its lookups to a :class:`~sparsecomm.sharded.lookup.TableSet`, to
which it offers the small public interface a round needs
(:class:`~sparsecomm.sharded.protocol.LookupTable`: its group, optimizer,
padding position, and where the owner's and the hot rows' gradients go).

Keeping the shard out of DDP: the shard is a plain tensor attribute
(``local_weight``), not an ``nn.Parameter`` or buffer, so DDP never sees it
(no allreduce, no broadcast, no shape check across ranks) and
``model.parameters()`` (what the dense optimizer gets) does not include it.

The state dict holds the whole table under ``<name>.weight``, the key of the
``nn.Embedding(Bag)`` it stands for: a DTensor of the table in id order, one
chunk a rank (:mod:`sparsecomm.sharded.dcp`), so ``torch.distributed.checkpoint``
saves every row and reshards to any world size and scheme, and
``full_state_dict=True`` gathers the single-process model's weight. Building
it is collective: every rank calls ``state_dict()`` and ``load_state_dict()``.
``weight`` itself is a zero-element, frozen ``nn.Parameter`` that names the
table where torch's distributed state dict looks for it: it maps a model's
keys through ``named_parameters()`` (a DDP prefix), and optimizer state
through the optimizer's parameters, so the sharded optimizers list it in
their param groups. Frozen and empty, DDP broadcasts nothing and reduces
nothing for it. :meth:`ShardedTable.local_state_dict` is the per-rank form
(this rank's shard and its layout) that loads back without communication at
the same layout; ``sparsecomm.sharded.save/load`` write their own checked format.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from sparsecomm import ops
from sparsecomm.collectives.sharded_exchange import allgather_table_rows, sharded_group
from sparsecomm.collectives.objects import all_gather_objects, world
from sparsecomm.collectives.sharded_wire import InputStatus
from sparsecomm.sharded import compiled, dcp
from sparsecomm.sharded.hot import HotRowConfig, HotRows
from sparsecomm.sharded.inputs import check_ids
from sparsecomm.sharded.layout import RowLayout
from sparsecomm.sharded.lookup import TableSet
from sparsecomm.sharded.pending import Lookup, Prefetched
from sparsecomm.sharded.row_log import RowLog
from sparsecomm.sharded.wire import WIRE_CODES, WIRE_DTYPES, Compression
from sparsecomm.types import PartitionScheme, SparseSyncStats

__all__ = ["ShardedTable", "STATE_FORMAT", "KIND_EMBEDDING", "KIND_BAG", "left_out_of_state_dicts"]

STATE_FORMAT = "sparsecomm.sharded.table/1"
# Rows are initialized in fixed chunks, each from its own seeded generator, so
# a row's initial value depends on (seed, id) only: the same table at any world size.
_INIT_CHUNK = 1 << 16
# The kind of table in its fingerprint (ranks looking up an embedding and a bag table in its place fail).
KIND_EMBEDDING, KIND_BAG = 0, 1
# Tables are numbered in construction order; the number joins the lookup
# fingerprint so that ranks calling different tables fail loudly.
_table_ids = itertools.count()


class ShardedTable(nn.Module):
    """Shared machinery of the sharded embedding modules (see the module docstring).

    It implements :class:`~sparsecomm.sharded.protocol.LookupTable`, what a
    lookup round uses of a table; the subclasses make the lookups
    (:meth:`lookup_plan`) and their results.
    """

    _kind = KIND_EMBEDDING
    # Who pools a bag lookup (ShardedEmbeddingBag sets it); a table without bags always takes rows.
    owner_pooling = "never"

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, *,
                 scheme: str = "hash", owner: Optional[int] = None, group=None, grad_reduction: str = "mean",
                 seed: Optional[int] = None, dtype: Optional[torch.dtype] = None, device=None,
                 hot_rows: Optional[HotRowConfig] = None, _weight: Optional[torch.Tensor] = None,
                 _freeze: bool = False, _adopt: bool = False, _agreed: bool = False) -> None:
        super().__init__()
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise ValueError(f"num_embeddings must be a positive int, got {num_embeddings!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"grad_reduction must be 'mean' (like DDP) or 'sum', got {grad_reduction!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}), "
                                 f"got {padding_idx}")
            padding_idx = padding_idx % num_embeddings
        if hot_rows is not None and not isinstance(hot_rows, HotRowConfig):
            raise TypeError(f"hot_rows must be a sparsecomm.sharded.HotRowConfig or None, got {type(hot_rows).__name__}")
        dtype = dtype or torch.get_default_dtype()
        if dtype not in ops.VALUE_DTYPES:
            raise TypeError(f"dtype must be one of {ops.VALUE_DTYPES}, got {dtype}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.scheme = PartitionScheme(scheme).value
        self.grad_reduction = grad_reduction
        self.table_id = next(_table_ids)
        # Collective on every rank: the dedicated group, then the shared seed.
        self._group = sharded_group(group)
        rank, size = world(group)
        device = torch.device(device) if device is not None else torch.device("cpu")
        if seed is None:
            # Every rank draws (keeping their RNG streams in step); rank 0's draw wins.
            seed = int(torch.randint(0, 2**62, (1,)).item())
        # _adopt: the shard is _weight's own memory, not a copy of it, where _weight is a whole table that fits:
        # a table-wise owner's shard is all of it; a hash shard spreads over it (sparsecomm.sharded.layout).
        fits = _adopt and _weight is not None and tuple(_weight.shape) == (num_embeddings, embedding_dim) and \
            _weight.is_contiguous() and _weight.dtype == dtype and _weight.device == device
        self.layout, self.seed = self._agree_layout(num_embeddings, rank, size, owner, device, seed, fits, _agreed)
        self.stats = SparseSyncStats(world_size=size)
        # Alone in an eager set until grouped (sparsecomm.sharded.model.group_tables).
        self._set = TableSet([self], lazy=False, stats=self.stats)
        self._optimizer: Optional[weakref.ref] = None
        adopted = fits and self.layout.num_slots == num_embeddings
        self.local_weight = _weight.detach() if adopted else \
            ops.empty_rows((self.layout.num_local, embedding_dim), dtype, device)   # huge pages
        # Rows written since a stale replica's copy was current (sparsecomm.stale sets it), or None.
        self.row_log: Optional[RowLog] = None
        # The table's name in state dicts and optimizers (see the module docstring); never holds rows.
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
        self.weight._sparsecomm_table = weakref.ref(self)
        self._left_out = False  # left out of the model's state dict (left_out_of_state_dicts)
        # Replicated hot rows (sparsecomm.sharded.hot), or None.
        self.hot: Optional[HotRows] = HotRows(hot_rows, embedding_dim, dtype, device) \
            if hot_rows is not None and hot_rows.budget_bytes > 0 else None
        if _weight is not None and not adopted:
            self.load_full_weight(_weight)
        elif _weight is None:
            self.reset_parameters()
        self.local_weight.requires_grad_(not _freeze)
        self.local_weight._sparsecomm_table = weakref.ref(self)
        # Under torch.compile a lookup is one custom op (sparsecomm.sharded.compiled): the table's id names it,
        # and this empty tensor, which requires grad, gives the op its place in autograd.
        compiled.register(self)
        self.compile_anchor = torch.zeros(0, dtype=dtype, device=device, requires_grad=True)

    def _agree_layout(self, num_embeddings: int, rank: int, size: int, owner: Optional[int], device: torch.device,
                      seed: int, spread: bool, agreed: bool) -> Tuple[RowLayout, int]:
        """This rank's layout and rank 0's seed, once every rank has checked the same scheme and owner (collective;
        ``agreed``: the caller, ``replan``, checked them and the seed on every rank: none).

        Raises:
            ValueError: on every rank, when some rank's scheme or owner is invalid or differs from rank 0's.
        """
        if agreed and seed is not None:   # the same arguments on every rank: any error is raised on all alike
            return RowLayout(num_embeddings, size, rank, self.scheme, device, owner, spread=spread), seed
        layout, problem = None, None
        try:
            layout = RowLayout(num_embeddings, size, rank, self.scheme, device, owner, spread=spread)
        except ValueError as exc:  # told to every rank below: none is left waiting
            problem = str(exc)
        gathered = all_gather_objects((seed, self.scheme, owner, problem), self._group)
        who = type(self).__name__
        for r, (_, scheme, their_owner, their_problem) in enumerate(gathered):
            if their_problem:
                raise ValueError(f"{who}: rank {r}: {their_problem}" if size > 1 else f"{who}: {their_problem}")
            if (scheme, their_owner) != gathered[0][1:3]:
                raise ValueError(f"{who}: rank {r} asks for scheme={scheme!r}, owner={their_owner!r} but rank 0 for "
                                 f"scheme={gathered[0][1]!r}, owner={gathered[0][2]!r}: every rank must build the "
                                 f"same table")
        return layout, int(gathered[0][0])

    # ------------------------------------------------------------- contents

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every row from N(0, 1) as ``nn.Embedding`` does, the same values at any world size.

        Row ``i`` depends only on ``seed`` and ``i`` (chunks of 65536 rows,
        one seeded generator each). Under "range" a rank draws only its own
        chunks; under "hash" it draws every chunk once and keeps its rows
        (time ~V, memory one chunk). The padding row is zeroed.
        """
        self.drop_hot()
        ids = self.layout.owned_ids().cpu()
        bounds = torch.searchsorted(ids, torch.arange(0, self.num_embeddings + _INIT_CHUNK, _INIT_CHUNK)).tolist()
        for chunk in range(len(bounds) - 1):
            lo, hi = bounds[chunk], bounds[chunk + 1]
            if lo == hi:
                continue
            first = chunk * _INIT_CHUNK
            g = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + chunk) % 2**63)
            rows = torch.randn(min(_INIT_CHUNK, self.num_embeddings - first), self.embedding_dim, generator=g)
            at = ids[lo:hi].to(self.local_weight.device) if self.layout.spread else slice(lo, hi)
            self.local_weight[at] = rows[ids[lo:hi] - first].to(self.local_weight)
        self._zero_padding_row()

    def _zero_padding_row(self) -> None:
        p = self.padding_idx
        if p is not None:
            pid = torch.tensor([p], device=self.layout.device)
            if bool(self.layout.owns(pid)[0]):
                self.local_weight[self.layout.slots(pid).to(self.local_weight.device)] = 0

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor) -> None:
        """Take this rank's rows from a full ``(num_embeddings, embedding_dim)`` table (no communication).

        Every rank passes the same table (e.g. ``torch.load(path, mmap=True)``
        of an exported one: only the owned rows are read).

        Raises:
            ValueError: the table has the wrong shape.
        """
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"expected a ({self.num_embeddings}, {self.embedding_dim}) table, "
                             f"got {tuple(weight.shape)}")
        self.drop_hot()
        if self.layout.spread:
            self.layout.put_owned_rows(self.local_weight, ops.take_rows(weight.detach(), self.layout.owned_ids()))
        else:
            ops.take_rows(weight.detach(), self.layout.owned_ids(), out=self.local_weight)

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """Gather the whole ``(num_embeddings, embedding_dim)`` table on every rank (collective).

        For exporting to an unsharded model for inference; it takes ``V x d``
        memory on every rank. Offline, ``sparsecomm.sharded.export_full``
        builds the same table from a checkpoint directory without processes.
        A gradient a ``defer=True`` optimizer left pending is applied first.
        """
        self.table_set.push_deferred()
        ids, rows = allgather_table_rows(self.layout.owned_ids(), self.layout.owned_rows(self.local_weight.detach()),
                                         self.num_embeddings, self._group)
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=rows.dtype, device=rows.device)
        full[ids.to(rows.device)] = rows
        return full

    # ------------------------------------------------ what a lookup round uses

    @property
    def owner(self) -> Optional[int]:
        """The rank holding the whole table under ``scheme="table"`` (None under the other schemes)."""
        return self.layout.owner

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The dedicated group the table exchanges over (None: a world of one)."""
        return self._group

    @property
    def table_set(self) -> TableSet:
        """The set whose rounds this table's lookups join (its own until ``group_tables``)."""
        return self._set

    @table_set.setter
    def table_set(self, table_set: TableSet) -> None:
        self._set = table_set

    # None, "bf16" or "fp16": the dtype rows and gradient rows travel in between ranks (sparsecomm.sharded.wire).
    compression = Compression()

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype of this table's rows on the wire (``compression``), or None: the table's own."""
        return WIRE_DTYPES[self.compression]

    @property
    def optimizer(self) -> Optional[Any]:
        """The sharded optimizer updating this table (the last one attached), or None."""
        return self._optimizer() if self._optimizer is not None else None

    @property
    def is_bag(self) -> bool:
        """Whether the table pools its lookups (``ShardedEmbeddingBag``)."""
        return self._kind == KIND_BAG

    def lookup_plan(self, *args: Any, **kwargs: Any) -> Lookup:
        """The :class:`~sparsecomm.sharded.pending.Lookup` that ``forward(*args, **kwargs)`` submits (checked input)."""
        raise NotImplementedError

    def _check_input(self, ids: Any) -> Tuple[torch.Tensor, InputStatus]:
        return check_ids(ids, self.num_embeddings, self.local_weight.device, type(self).__name__)

    def prefetch(self, *args: Any, **kwargs: Any) -> Prefetched:
        """Start the id exchange of this table's next lookup now; returns the handle to call the table with.

        ``table.prefetch(ids, ...)`` takes the arguments of ``forward``. The
        ids travel to their owners in the background (the group's thread)
        while this rank goes on, e.g. with backward and ``step()`` of the
        current batch; ``table(handle)`` later finishes the lookup and pulls
        the rows then, so they include every update made in between.
        Collective, like a lookup: every rank prefetches the same tables in
        the same order. For several tables grouped by ``group_tables`` (one
        round), use ``sparsecomm.sharded.prefetch`` with all of the round's lookups.
        """
        handle = Prefetched(self, self.lookup_plan(*args, **kwargs))
        self.table_set.prefetch([handle.lookup])
        return handle

    def _take(self, handle: Prefetched) -> Lookup:
        if handle.table is not self:
            raise ValueError(f"{type(self).__name__}: this prefetch handle belongs to another table")
        if handle.used:
            raise ValueError(f"{type(self).__name__}: a prefetch handle can be looked up once")
        handle.used = True
        handle.lookup.grad_enabled = torch.is_grad_enabled()
        return handle.lookup

    def fingerprint(self) -> Tuple[int, int, int, int, int, int]:
        """Ints every rank's lookup of this table must agree on: shape, construction order, kind, hot-set version,
        wire dtype (0: the table's own, 1: fp16, 2: bf16)."""
        return (self.num_embeddings, self.embedding_dim, self.table_id, self._kind,
                self.hot.version if self.hot is not None else 0, WIRE_CODES[self.compression])

    def padding_position(self, unique: torch.Tensor) -> Optional[int]:
        """Position of the padding row among a round's sorted unique ids, or None."""
        if self.padding_idx is None or unique.numel() == 0:
            return None
        pos = int(torch.searchsorted(unique, torch.tensor([self.padding_idx], device=unique.device)).item())
        return pos if pos < unique.numel() and int(unique[pos]) == self.padding_idx else None

    def owner_gradient(self, slots: torch.Tensor, requested: torch.Tensor, rows: torch.Tensor,
                       coalesced: bool = False) -> Optional[torch.Tensor]:
        """The sparse gradient of ``local_weight`` from the gradient rows peers pushed for ``requested`` ids.

        ``coalesced``: the slots are distinct and sorted. With a fused
        optimizer attached, the gradient is applied here and now, and None is returned.
        """
        if self.padding_idx is not None:
            # nn.Embedding's sparse gradient leaves the padding row out: it stays untouched by lazy optimizers too.
            keep = requested != self.padding_idx
            slots, rows = slots[keep], rows[keep]
        if self.grad_reduction == "mean" and self.layout.world_size > 1:
            rows = rows / self.layout.world_size
        opt = self.optimizer
        if opt is not None and getattr(opt, "fused", False):
            opt.apply_rows(self.local_weight, slots, rows, coalesced=coalesced)
            return None
        return torch.sparse_coo_tensor(slots.view(1, -1), rows, tuple(self.local_weight.shape),
                                       check_invariants=False, is_coalesced=coalesced or None)

    def hot_gradient(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """The hot rows' gradient, summed over ranks: applied now (fused optimizer) or kept for ``step()``."""
        opt = self.optimizer
        if opt is not None and getattr(opt, "fused", False):
            opt.apply_hot(self, positions, rows)
        else:
            self.hot.add_gradient(positions, rows)

    # ---------------------------------------------------------- bookkeeping

    def drop_hot(self) -> None:
        """Forget the replicated hot rows (their shard rows or optimizer state were replaced)."""
        if self.hot is not None:
            self.hot.drop()

    def attach_optimizer(self, optimizer: Any) -> None:
        """Make ``optimizer`` the one updating this table (held weakly: the optimizer holds the table)."""
        self._optimizer = weakref.ref(optimizer)

    def optimizer_state(self) -> Dict[str, torch.Tensor]:
        """The row-wise optimizer state of this shard (empty without an attached sharded optimizer)."""
        opt = self.optimizer
        if opt is None:
            return {}
        state = opt.state.get(self.local_weight, {})
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() >= 1}

    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes this rank holds for the table: ``weight``, ``ownership_map``, ``optimizer_state``,
        ``hot_rows`` (the replica: rows, their optimizer state, index, the window's counts), ``grad``."""
        w = self.local_weight
        grad = 0
        if w.grad is not None:
            g = w.grad
            grad = (g._values().numel() * g.element_size() + g._indices().numel() * 8) if g.is_sparse else \
                g.numel() * g.element_size()
        return {"weight": w.numel() * w.element_size(),
                "ownership_map": self.layout.nbytes,
                "optimizer_state": sum(t.numel() * t.element_size() for t in self.optimizer_state().values()),
                "hot_rows": self.hot.nbytes() if self.hot is not None else 0,
                "grad": grad}

    def memory_bytes(self, include_grad: bool = False) -> int:
        """Bytes of this rank's rows, ownership map and row-wise optimizer state (~V/N rows' worth).

        Args:
            include_grad: also count the pending sparse gradient (transient:
                from backward until ``zero_grad``).
        """
        parts = self.memory_breakdown()
        return sum(v for k, v in parts.items() if include_grad or k != "grad")

    # ------------------------------------------------------------ state dict

    def local_state_dict(self) -> Dict[str, Any]:
        """This rank's shard and its layout, the per-rank form (``local_weight``, ``_extra_state``).

        ``load_state_dict`` takes it back without communication, on the same
        rank at the same world size and scheme only (other layouts are
        refused, pointing to the resharding forms). ``state_dict()`` gives the
        whole table instead (collective), which loads at any layout.
        """
        return {"local_weight": self.layout.owned_rows(self.local_weight.detach()),
                "_extra_state": self._layout_state()}

    def _layout_state(self) -> Dict[str, Any]:
        return {"format": STATE_FORMAT, "embedding_dim": self.embedding_dim,
                "dtype": str(self.local_weight.dtype).replace("torch.", ""), **self.layout.describe(),
                "ids": self.layout.owned_ids()}

    def _layout_problem(self, state: Any) -> Optional[str]:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            return f"{type(self).__name__}: not a sharded-table state (format {got!r})"
        mine = self._layout_state()
        for key in ("num_embeddings", "embedding_dim", "world_size", "rank", "scheme", "owner", "num_local"):
            if state.get(key) != mine[key]:
                return (f"{type(self).__name__}: the state holds rank {state.get('rank')} of "
                        f"{state.get('world_size')} of a {state.get('num_embeddings')} x {state.get('embedding_dim')} "
                        f"table sharded by {state.get('scheme')!r}, but this table is rank {self.layout.rank} of "
                        f"{self.layout.world_size}, {self.num_embeddings} x {self.embedding_dim}, "
                        f"{self.scheme!r} ({key} differs). To load shards written at another world size or "
                        f"scheme, load the table's state_dict() or use sparsecomm.sharded.load(directory, model)")
        return None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._left_out:
            return
        self.table_set.push_deferred()  # a gradient a defer=True optimizer left pending lands first
        chunk = dcp.to_id_order(self.layout, [self.local_weight.detach()], self._group)[0]
        destination[prefix + "weight"] = dcp.as_global(chunk, self.layout, self._group)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self._left_out:
            return
        wkey, local = prefix + "weight", (prefix + "local_weight", prefix + "_extra_state")
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in (wkey,) + local
                                   and "." not in k[len(prefix):])
        if wkey not in state_dict and all(k in state_dict for k in local):
            self._load_local(state_dict[local[0]], state_dict[local[1]], local[0], error_msgs)
            return
        verdict, rows = dcp.classify(state_dict.get(wkey), self.layout, (self.embedding_dim,))
        kind = dcp.agree_on([verdict], self._group, f"{type(self).__name__}.load_state_dict: {wkey}")[0]
        if kind == dcp.MISSING:
            missing_keys.append(wkey)
            return
        self.table_set.push_deferred()  # a pending gradient must not land on the loaded rows
        with torch.no_grad():
            rows = rows.to(device=self.local_weight.device, dtype=self.local_weight.dtype)
            if kind == dcp.CHUNKS:
                rows = dcp.from_id_order(self.layout, [rows], self._group)[0]
            else:
                rows = rows[self.layout.owned_ids().to(rows.device)]
            self.drop_hot()
            self.layout.put_owned_rows(self.local_weight, rows)

    def _load_local(self, weight: Any, layout_state: Any, key: str, error_msgs) -> None:
        """Load :meth:`local_state_dict`'s form: this rank's shard, same layout (no communication)."""
        problem = self._layout_problem(layout_state)
        want = (self.layout.num_local, self.embedding_dim)
        if problem is None and tuple(weight.shape) != want:
            problem = f"{key}: shape {tuple(weight.shape)} in the state, {want} here"
        if problem:
            error_msgs.append(problem)
            return
        with torch.no_grad():
            self.drop_hot()
            self.layout.put_owned_rows(self.local_weight, weight)

    def extra_repr(self) -> str:
        owner = f", owner={self.owner}" if self.owner is not None else ""
        s = (f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme!r}{owner}, "
             f"rank={self.layout.rank}/{self.layout.world_size}, local_rows={self.layout.num_local}")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s


@contextlib.contextmanager
def left_out_of_state_dicts(tables: Sequence[ShardedTable]) -> Iterator[None]:
    """Leave ``tables`` out of their model's ``state_dict()`` and ``load_state_dict()`` inside the block.

    For the model's other state alone, on some ranks only (``sparsecomm.sharded.save``
    writes the tables itself): a table's own state dict is collective.
    """
    for t in tables:
        t._left_out = True
    try:
        yield
    finally:
        for t in tables:
            t._left_out = False
