"""Row-sharded embedding tables: each rank stores the rows it owns, lookups pull rows from their owners.

``ShardedEmbedding`` / ``ShardedEmbeddingBag`` stand in for ``nn.Embedding`` /
``nn.EmbeddingBag`` in a model whose other parameters stay under DDP.

Forward (one lookup, all ranks together): the batch's unique ids are grouped
by owner, sent to their owners (all-to-all), the owners gather the rows
(:func:`sparsecomm.ops.gather_rows`) and send them back (all-to-all); the
unique rows are then expanded to the batch with ``F.embedding`` /
``F.embedding_bag`` so torch does the pooling and its gradient.

Backward: the gradient of the unique rows (already coalesced by that expansion)
travels the same routes back to the owners, which receive it as a sparse COO
gradient of their local shard in ``local_weight.grad``, averaged over ranks
like DDP averages dense gradients (``grad_reduction="mean"``). Nothing is
updated until the owner-side optimizer's ``step()`` (``sparsecomm.sharded.optimizer``).

Keeping the shard out of DDP: the shard is a plain tensor attribute
(``local_weight``), not an ``nn.Parameter`` or buffer, so DDP never sees it
(no allreduce, no broadcast, no shape check across ranks) and
``model.parameters()`` (what the dense optimizer gets) does not include it.
It still travels in ``model.state_dict()`` (``<name>.local_weight`` plus the
ownership map in ``<name>._extra_state``) and through
``sparsecomm.sharded.save/load``.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from sparsecomm import ops
from sparsecomm.collectives.sharded_exchange import allgather_table_rows, sharded_group
from sparsecomm.collectives.sharded_objects import broadcast_int, world
from sparsecomm.collectives.sharded_wire import InputStatus
from sparsecomm.sharded import compiled
from sparsecomm.sharded.hot import HotRowConfig, HotRows
from sparsecomm.sharded.layout import RowLayout
from sparsecomm.sharded.lookup import Bags, Lookup, TableSet, pool_rows
from sparsecomm.types import PartitionScheme, SparseSyncStats, WireStatus

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "Prefetched", "prefetch", "sharded_modules"]

STATE_FORMAT = "sparsecomm.sharded.table/1"
# Rows are initialized in fixed chunks, each from its own seeded generator, so
# a row's initial value depends on (seed, id) only: the same table at any world size.
_INIT_CHUNK = 1 << 16
_KIND_EMBEDDING, _KIND_BAG = 0, 1
# Tables are numbered in construction order; the number joins the lookup
# fingerprint so that ranks calling different tables fail loudly.
_table_ids = itertools.count()


class _ShardedTable(nn.Module):
    """Shared machinery of the sharded embedding modules (see the module docstring)."""

    _kind = _KIND_EMBEDDING

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, *,
                 scheme: str = "hash", group=None, grad_reduction: str = "mean", seed: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device=None, hot_rows: Optional[HotRowConfig] = None,
                 _weight: Optional[torch.Tensor] = None, _freeze: bool = False) -> None:
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
        self.layout = RowLayout(num_embeddings, size, rank, self.scheme, device)
        self.stats = SparseSyncStats(world_size=size)
        # Alone in an eager set until grouped (sparsecomm.sharded.lookup.group_tables).
        self._set = TableSet([self], lazy=False, stats=self.stats)
        if seed is None:
            # Every rank draws (keeping their RNG streams in step); rank 0's draw wins.
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = broadcast_int(seed, self._group)
        self._optimizer: Optional[weakref.ref] = None
        self.local_weight = ops.empty_rows((self.layout.num_local, embedding_dim), dtype, device)   # huge pages
        # Replicated hot rows (sparsecomm.sharded.hot), or None.
        self.hot: Optional[HotRows] = HotRows(hot_rows, embedding_dim, dtype, device) \
            if hot_rows is not None and hot_rows.budget_bytes > 0 else None
        if _weight is not None:
            self.load_full_weight(_weight)
        else:
            self.reset_parameters()
        self.local_weight.requires_grad_(not _freeze)
        self.local_weight._sparsecomm_table = weakref.ref(self)
        # Under torch.compile a lookup is one custom op (sparsecomm.sharded.compiled): the table's key names it,
        # and this empty tensor, which requires grad, gives the op its place in autograd.
        self._key = compiled.register(self)
        self._anchor = torch.zeros(0, dtype=dtype, device=device, requires_grad=True)

    # ------------------------------------------------------------- contents

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every row from N(0, 1) as ``nn.Embedding`` does, the same values at any world size.

        Row ``i`` depends only on ``seed`` and ``i`` (chunks of 65536 rows,
        one seeded generator each). Under "range" a rank draws only its own
        chunks; under "hash" it draws every chunk once and keeps its rows
        (time ~V, memory one chunk). The padding row is zeroed.
        """
        self._drop_hot()
        ids = self.layout.owned_ids().cpu()
        bounds = torch.searchsorted(ids, torch.arange(0, self.num_embeddings + _INIT_CHUNK, _INIT_CHUNK)).tolist()
        for chunk in range(len(bounds) - 1):
            lo, hi = bounds[chunk], bounds[chunk + 1]
            if lo == hi:
                continue
            first = chunk * _INIT_CHUNK
            g = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + chunk) % 2**63)
            rows = torch.randn(min(_INIT_CHUNK, self.num_embeddings - first), self.embedding_dim, generator=g)
            self.local_weight[lo:hi] = rows[ids[lo:hi] - first].to(self.local_weight)
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
        self._drop_hot()
        self.local_weight.copy_(weight[self.layout.owned_ids().to(weight.device)])

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """Gather the whole ``(num_embeddings, embedding_dim)`` table on every rank (collective).

        For exporting to an unsharded model for inference; it takes ``V x d``
        memory on every rank. Offline, ``sparsecomm.sharded.export_full``
        builds the same table from a checkpoint directory without processes.
        A gradient a ``defer=True`` optimizer left pending is applied first.
        """
        self._set.push_deferred()
        ids, rows = allgather_table_rows(self.layout.owned_ids(), self.local_weight.detach(),
                                         self.num_embeddings, self._group)
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=rows.dtype, device=rows.device)
        full[ids.to(rows.device)] = rows
        return full

    # ----------------------------------------------------------- the lookup

    def _check_input(self, ids: Any) -> Tuple[torch.Tensor, InputStatus]:
        # Never raises: a bad input must still reach the collective, which raises on every rank.
        name = type(self).__name__
        device = self.local_weight.device
        none = torch.empty(0, dtype=torch.int64, device=device)
        if not isinstance(ids, torch.Tensor):
            return none, InputStatus(WireStatus.BAD_INPUT, 0, f"{name}: input must be a tensor, got {type(ids).__name__}")
        if ids.dtype not in (torch.int32, torch.int64):
            return none, InputStatus(WireStatus.BAD_INPUT, 0, f"{name}: input must be int32 or int64, got {ids.dtype}")
        if ids.device != device:
            return none, InputStatus(WireStatus.BAD_INPUT, 0, f"{name}: input is on {ids.device} but the table is on {device}")
        flat = ids.reshape(-1)
        if flat.numel():
            lo, hi = torch.aminmax(flat)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                return flat.new_empty(0, dtype=torch.int64), InputStatus(
                    WireStatus.ID_RANGE, bad,
                    f"{name}: input contains id {bad}, outside [0, {self.num_embeddings}); nothing was exchanged")
        return flat.to(torch.int64), InputStatus()

    def prefetch(self, *args: Any, **kwargs: Any) -> "Prefetched":
        """Start the id exchange of this table's next lookup now; returns the handle to call the table with.

        ``table.prefetch(ids, ...)`` takes the arguments of ``forward``. The
        ids travel to their owners in the background (the group's thread)
        while this rank goes on, e.g. with backward and ``step()`` of the
        current batch; ``table(handle)`` later finishes the lookup and pulls
        the rows then, so they include every update made in between.
        Collective, like a lookup: every rank prefetches the same tables in
        the same order. For several tables grouped by ``group_tables`` (one
        round), use :func:`prefetch` with all of the round's lookups.
        """
        return prefetch((self, args, kwargs))[0]

    def _take(self, handle: "Prefetched") -> Lookup:
        if handle.table is not self:
            raise ValueError(f"{type(self).__name__}: this prefetch handle belongs to another table")
        if handle.used:
            raise ValueError(f"{type(self).__name__}: a prefetch handle can be looked up once")
        handle.used = True
        handle.lookup.grad_enabled = torch.is_grad_enabled()
        return handle.lookup

    def fingerprint(self) -> Tuple[int, int, int, int, int]:
        """Ints every rank's lookup of this table must agree on: shape, construction order, kind, hot-set version."""
        return (self.num_embeddings, self.embedding_dim, self.table_id, self._kind,
                self.hot.version if self.hot is not None else 0)

    def _drop_hot(self) -> None:
        """Forget the replicated hot rows (their shard rows or optimizer state were replaced)."""
        if self.hot is not None:
            self.hot.drop()

    def _padding_position(self, unique: torch.Tensor) -> Optional[int]:
        """Position of the padding row among a round's sorted unique ids, or None."""
        if self.padding_idx is None or unique.numel() == 0:
            return None
        pos = int(torch.searchsorted(unique, torch.tensor([self.padding_idx], device=unique.device)).item())
        return pos if pos < unique.numel() and int(unique[pos]) == self.padding_idx else None

    def _owner_gradient(self, slots: torch.Tensor, requested: torch.Tensor, rows: torch.Tensor,
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
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is not None and getattr(opt, "fused", False):
            opt.apply_rows(self.local_weight, slots, rows, coalesced=coalesced)
            return None
        return torch.sparse_coo_tensor(slots.view(1, -1), rows, tuple(self.local_weight.shape),
                                       check_invariants=False, is_coalesced=coalesced or None)

    def _hot_gradient(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """The hot rows' gradient, summed over ranks: applied now (fused optimizer) or kept for ``step()``."""
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is not None and getattr(opt, "fused", False):
            opt.apply_hot(self, positions, rows)
        else:
            self.hot.add_gradient(positions, rows)

    # ---------------------------------------------------------- bookkeeping

    def _attach_optimizer(self, optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def optimizer_state(self) -> Dict[str, torch.Tensor]:
        """The row-wise optimizer state of this shard (empty without an attached sharded optimizer)."""
        opt = self._optimizer() if self._optimizer is not None else None
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

    def get_extra_state(self) -> Dict[str, Any]:
        """The ownership map saved beside ``local_weight`` in ``state_dict()``."""
        return {"format": STATE_FORMAT, "embedding_dim": self.embedding_dim,
                "dtype": str(self.local_weight.dtype).replace("torch.", ""), **self.layout.describe(),
                "ids": self.layout.owned_ids()}

    def set_extra_state(self, state: Any) -> None:
        problem = self._layout_problem(state)
        if problem:
            raise ValueError(problem)

    def _layout_problem(self, state: Any) -> Optional[str]:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            return f"{type(self).__name__}: not a sharded-table state (format {got!r})"
        mine = self.get_extra_state()
        for key in ("num_embeddings", "embedding_dim", "world_size", "rank", "scheme", "num_local"):
            if state.get(key) != mine[key]:
                return (f"{type(self).__name__}: the state holds rank {state.get('rank')} of "
                        f"{state.get('world_size')} of a {state.get('num_embeddings')} x {state.get('embedding_dim')} "
                        f"table sharded by {state.get('scheme')!r}, but this table is rank {self.layout.rank} of "
                        f"{self.layout.world_size}, {self.num_embeddings} x {self.embedding_dim}, "
                        f"{self.scheme!r} ({key} differs). To load shards written at another world size or "
                        f"scheme, use sparsecomm.sharded.load(directory, model)")
        return None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "local_weight"] = self.local_weight if keep_vars else self.local_weight.detach()
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        wkey, ekey = prefix + "local_weight", prefix + "_extra_state"
        missing = [k for k in (wkey, ekey) if k not in state_dict]
        missing_keys.extend(missing)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in (wkey, ekey)
                                   and "." not in k[len(prefix):])
        if missing:
            return
        problem = self._layout_problem(state_dict[ekey])
        weight = state_dict[wkey]
        if problem is None and tuple(weight.shape) != tuple(self.local_weight.shape):
            problem = f"{wkey}: shape {tuple(weight.shape)} in the state, {tuple(self.local_weight.shape)} here"
        if problem:
            error_msgs.append(problem)
            return
        with torch.no_grad():
            self._drop_hot()
            self.local_weight.copy_(weight)

    def extra_repr(self) -> str:
        s = (f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme!r}, "
             f"rank={self.layout.rank}/{self.layout.world_size}, local_rows={self.layout.num_local}")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s


class ShardedEmbedding(_ShardedTable):
    """Row-sharded ``nn.Embedding``: each rank stores ~V/N rows; lookups fetch rows from their owners.

    Construct it on every rank (collective), like the model around it. Every
    forward is collective too: all ranks call the same tables in the same
    order, and every rank runs backward through every lookup it made with
    gradients enabled (as DDP requires of its parameters).

    Args:
        num_embeddings: table rows ``V``.
        embedding_dim: row width ``d``.
        padding_idx: as ``nn.Embedding``: the row starts at zero and never
            receives a gradient (nor an optimizer update).
        scheme: row ownership, ``"hash"`` (balanced under Zipf skew, the
            default) or ``"range"`` (contiguous blocks), as the sparse path.
        group: process group (default: the whole world). Its ranks own the rows.
        grad_reduction: ``"mean"`` (default): owners average the ranks'
            gradients, like DDP does for dense parameters; ``"sum"``: add them.
        seed: initial values are N(0, 1) drawn from ``seed`` per row, the same
            at any world size; default: rank 0 draws one from torch's RNG.
        dtype, device: of the shard (and of the rows a lookup returns).
        hot_rows: a :class:`~sparsecomm.sharded.HotRowConfig` to keep the
            most looked-up rows replicated on every rank within a memory
            budget (``sparsecomm.sharded.hot``); None (default): all sharded.

    Attributes:
        local_weight: ``(num_local, d)`` tensor of the rows this rank owns, in
            ``layout.owned_ids()`` order; its ``.grad`` is the sparse gradient
            the owner received. Not a Parameter: DDP and dense optimizers skip it.
        layout: the :class:`~sparsecomm.sharded.layout.RowLayout` (owners, slots).
        stats: bytes this rank sent/received for the table, accumulated.

    Example::

        >>> emb = ShardedEmbedding(1_000_000, 64)                 # on every rank
        >>> model = DDP(Model(emb, ...))                          # emb stays out of DDP
        >>> dense_opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sparse_opt = sparsecomm.sharded.ShardedAdam(model, lr=1e-3)
        >>> loss = model(batch).mean(); loss.backward(); dense_opt.step(); sparse_opt.step()
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Look up ``input`` (int32/int64 ids of any shape); returns ``input.shape + (d,)``.

        Raises:
            ValueError: on every rank, when any rank passes an id outside
                ``[0, num_embeddings)`` or a non-integer input (no rows move,
                the table stays usable), or ranks call different tables.
        """
        if torch.compiler.is_compiling():
            return compiled.lookup(self, input)
        return self._set.submit(self._take(input) if isinstance(input, Prefetched) else self._lookup(input))

    def _lookup(self, input: torch.Tensor) -> Lookup:
        flat, status = self._check_input(input)
        shape = tuple(input.shape) if isinstance(input, torch.Tensor) else (0,)

        def finish(rows, inverse, pad):
            return F.embedding(inverse.view(shape), rows, padding_idx=pad)

        return Lookup(self, flat, status, finish, shape + (self.embedding_dim,))

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, padding_idx: Optional[int] = None,
                        **kwargs) -> "ShardedEmbedding":
        """Shard a full ``(V, d)`` table (every rank passes the same one), like ``nn.Embedding.from_pretrained``."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D, got shape {tuple(embeddings.shape)}")
        kwargs.setdefault("dtype", embeddings.dtype)
        return cls(embeddings.shape[0], embeddings.shape[1], padding_idx, _weight=embeddings, _freeze=freeze,
                   **kwargs)


class ShardedEmbeddingBag(_ShardedTable):
    """Row-sharded ``nn.EmbeddingBag``: pooled lookups (``"sum"``, ``"mean"`` or ``"max"``) over sharded rows.

    Args:
        num_embeddings, embedding_dim: table shape.
        mode: ``"sum"``, ``"mean"`` (default, as ``nn.EmbeddingBag``) or ``"max"``.
        include_last_offset: as ``nn.EmbeddingBag``.
        padding_idx: as ``nn.EmbeddingBag``: excluded from its bag (and from
            the mean's count); the row never receives a gradient.
        owner_pooling: who pools a ``"sum"``/``"mean"`` lookup.
            ``"always"``: the owners pool the rows they hold and send one
            partial bag per bag back (backward: one gradient row per bag);
            ``"never"``: the owners send the batch's unique rows and the
            requester pools them; ``"auto"`` (default): measure both (each
            rank times its lookups, the exchanges and its own pooling work
            with their backward: three take rows, three are pooled, the
            first of each not counted), then take the one that was faster
            summed over the ranks, re-measuring the other every 64 rounds; ``"bytes"``: take the one
            that moves fewer bytes. Both automatic rules decide from every
            rank's numbers in the last round's metadata, so every rank makes
            the same choice. ``"max"``, per-sample weights that require grad,
            and a table looked up twice in one round always take rows.
            ``stats.pooled_lookups`` / ``stats.row_lookups`` count each path.
        **kwargs: ``scheme``, ``group``, ``grad_reduction``, ``seed``,
            ``dtype``, ``device``, ``hot_rows`` as :class:`ShardedEmbedding`
            (a table with a hot set takes the rows path).
    """

    _kind = _KIND_BAG

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", *,
                 include_last_offset: bool = False, padding_idx: Optional[int] = None, owner_pooling: str = "auto",
                 **kwargs) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if owner_pooling not in ("auto", "bytes", "always", "never"):
            raise ValueError(f"owner_pooling must be 'auto', 'bytes', 'always' or 'never', got {owner_pooling!r}")
        super().__init__(num_embeddings, embedding_dim, padding_idx, **kwargs)
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.owner_pooling = owner_pooling

    def _check_bag_input(self, input, offsets, per_sample_weights) -> Optional[str]:
        # Everything F.embedding_bag would refuse after the exchange (on this
        # rank only) is refused here, before it, through the status round.
        if not isinstance(input, torch.Tensor):
            return None  # reported by _check_input
        device = self.local_weight.device
        if input.dim() == 2:
            if offsets is not None:
                return "offsets must be None when input is 2-D (B, L)"
        elif input.dim() == 1:
            if offsets is None:
                return "offsets are required when input is 1-D"
            if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or \
                    offsets.dtype not in (torch.int32, torch.int64):
                return "offsets must be a 1-D int32/int64 tensor"
            if offsets.device != device:
                return f"offsets are on {offsets.device} but the table is on {device}"
            if self.include_last_offset and offsets.numel() == 0:
                return "include_last_offset=True needs at least one offset"
            if offsets.numel():
                if int(offsets[0]) != 0:
                    return f"offsets[0] must be 0, got {int(offsets[0])}"
                if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > input.numel():
                    return f"offsets must be non-decreasing and at most len(input) = {input.numel()}"
                if self.include_last_offset and int(offsets[-1]) != input.numel():
                    # torch documents this as the input's length; its embedding_bag backward reads out of
                    # bounds when ids follow the last offset (garbage gradients, or an IndexError when sparse).
                    return (f"include_last_offset=True: the last offset must be len(input) = {input.numel()}, "
                            f"got {int(offsets[-1])}")
        else:
            return f"input must be 1-D (with offsets) or 2-D (B, L), got shape {tuple(input.shape)}"
        if per_sample_weights is not None:
            if self.mode != "sum":
                return f"per_sample_weights need mode='sum', not {self.mode!r}"
            if not isinstance(per_sample_weights, torch.Tensor) or per_sample_weights.shape != input.shape:
                return "per_sample_weights must be a tensor of the input's shape"
            if per_sample_weights.dtype != self.local_weight.dtype:
                return (f"per_sample_weights must have the table's dtype {self.local_weight.dtype}, "
                        f"got {per_sample_weights.dtype}")
            if per_sample_weights.device != device:
                return f"per_sample_weights are on {per_sample_weights.device} but the table is on {device}"
        return None

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pool rows per bag, like ``nn.EmbeddingBag.forward``; returns ``(num_bags, d)``.

        Raises:
            ValueError: on every rank, for an id out of range or a malformed
                input/offsets on any rank (nothing moves; the table stays usable).
        """
        if torch.compiler.is_compiling():
            return compiled.lookup(self, input, offsets, per_sample_weights)
        if isinstance(input, Prefetched):
            return self._set.submit(self._take(input))
        return self._set.submit(self._lookup(input, offsets, per_sample_weights))

    def _lookup(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> Lookup:
        flat, status = self._check_input(input)
        problem = self._check_bag_input(input, offsets, per_sample_weights) if status.ok else None
        if problem:
            flat, status = flat.new_empty(0), InputStatus(WireStatus.BAD_INPUT, 0, f"{type(self).__name__}: {problem}")
        shape = tuple(input.shape) if isinstance(input, torch.Tensor) else (0,)
        if not status.ok:
            bags = 0
        elif len(shape) == 2:
            bags = shape[0]
        else:
            bags = offsets.numel() - int(self.include_last_offset)

        pooling = None
        if status.ok and self.mode != "max" and \
                (per_sample_weights is None or not (torch.is_grad_enabled() and per_sample_weights.requires_grad)):
            pooling = Bags(bags, self.mode, self._bag_lengths(input, offsets, flat.numel()),
                           per_sample_weights.reshape(-1).detach() if per_sample_weights is not None else None)

        def finish(rows, inverse, pad):
            if pooling is not None:  # sum/mean: the same pooling, with a faster backward (see pool_rows)
                return pool_rows(rows, inverse, pooling, pad)
            return F.embedding_bag(inverse.view(shape), rows, offsets, mode=self.mode,
                                   per_sample_weights=per_sample_weights,
                                   include_last_offset=self.include_last_offset, padding_idx=pad)

        return Lookup(self, flat, status, finish, (bags, self.embedding_dim), pooling)

    def _bag_lengths(self, input: torch.Tensor, offsets: Optional[torch.Tensor], n: int) -> torch.Tensor:
        """Ids per bag (the flat ids are the bags' ids one bag after the other)."""
        device = self.local_weight.device
        if input.dim() == 2:
            return torch.full((input.shape[0],), input.shape[1], dtype=torch.int64, device=device)
        offsets = offsets.to(torch.int64)
        if self.include_last_offset:
            return offsets[1:] - offsets[:-1]
        return torch.diff(offsets, append=torch.tensor([n], dtype=torch.int64, device=device))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"


class Prefetched:
    """A lookup whose id exchange has started (:func:`prefetch`); call its table with it to finish the lookup."""

    __slots__ = ("table", "lookup", "used")

    def __init__(self, table: "_ShardedTable", lookup: Lookup) -> None:
        self.table, self.lookup, self.used = table, lookup, False


def prefetch(*calls: Tuple[Any, ...]) -> List[Prefetched]:
    """Start one round's id exchange now, for lookups made later (pipelining the next batch's ids).

    Args:
        *calls: ``(table, args)`` or ``(table, args, kwargs)`` per lookup of
            the round, in the order the model will make them; ``args`` and
            ``kwargs`` are what the table's ``forward`` takes. The tables
            share one round: a table alone, or the tables of one
            ``group_tables`` set.

    Returns:
        One handle per call: the model calls each table with its handle
        instead of the ids (``table(handle)``), in the same order. Rows are
        pulled when the round runs then, so they reflect every optimizer
        step taken in between (training stays exact); only the ids moved early.

    Collective: every rank prefetches the same tables in the same order. An
    input error is reported when the round runs, on every rank. A prefetched
    round that is never used is ended (unused) by the next round of its tables.

    Example::

        >>> nxt = emb.prefetch(batches[0])
        >>> for t in range(steps):
        ...     out = emb(nxt)                                   # rows pulled now
        ...     if t + 1 < steps:
        ...         nxt = emb.prefetch(batches[t + 1])           # ids travel during backward and step
        ...     loss_fn(out).backward(); opt.step(); opt.zero_grad()
    """
    if not calls:
        raise ValueError("prefetch needs at least one (table, args) call")
    handles = []
    for call in calls:
        table, args, kwargs = (tuple(call) + ({},))[:3]
        if not isinstance(table, _ShardedTable):
            raise TypeError(f"prefetch takes (sharded table, args[, kwargs]) calls, got {type(table).__name__}")
        handles.append(Prefetched(table, table._lookup(*args, **kwargs)))
    table_set = handles[0].table._set
    if any(h.table._set is not table_set for h in handles):
        raise ValueError("prefetched lookups must share one round: tables of one group_tables set")
    table_set.prefetch([h.lookup for h in handles])
    return handles


def sharded_modules(model: nn.Module) -> List[Tuple[str, _ShardedTable]]:
    """``(name, table)`` for every sharded table in ``model`` (a DDP wrapper is looked through)."""
    inner = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
    return [(name, m) for name, m in inner.named_modules() if isinstance(m, _ShardedTable)]
