"""Row-sharded embedding tables: each rank stores the rows it owns, lookups pull rows from their owners.

``ShardedEmbedding`` / ``ShardedEmbeddingBag`` stand in for ``nn.Embedding`` /
``nn.EmbeddingBag`` in a model whose other parameters stay under DDP; what
they share (the shard, its state, its rounds) is
:class:`sparsecomm.sharded.table.ShardedTable`.

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
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F

from sparsecomm.sharded import compiled
from sparsecomm.sharded.bag_pooling import pool_rows
from sparsecomm.sharded.inputs import bad_input, bag_lengths, check_bag_input
from sparsecomm.sharded.pending import Bags, Lookup, Prefetched
from sparsecomm.sharded.table import KIND_BAG, ShardedTable

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "prefetch"]


class ShardedEmbedding(ShardedTable):
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
            default) or ``"range"`` (contiguous blocks), as the sparse path;
            or ``"table"``: the whole table on rank ``owner`` (table-wise: a
            lookup talks to that one rank, which pools whole bags).
        owner: the rank holding the table under ``scheme="table"`` (None otherwise).
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
        weight: a zero-element, frozen Parameter that stands for the table
            where torch looks for ``nn.Embedding``'s: the state dict's
            ``<name>.weight`` is the whole table (collective; see
            :mod:`sparsecomm.sharded.table`), and sharded optimizers list it.
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
        return self.table_set.submit(self._take(input) if isinstance(input, Prefetched) else self.lookup_plan(input))

    def lookup_plan(self, input: torch.Tensor) -> Lookup:
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


class ShardedEmbeddingBag(ShardedTable):
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
        **kwargs: ``scheme``, ``owner``, ``group``, ``grad_reduction``, ``seed``,
            ``dtype``, ``device``, ``hot_rows`` as :class:`ShardedEmbedding`
            (a table with a hot set takes the rows path).
    """

    _kind = KIND_BAG

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
            return self.table_set.submit(self._take(input))
        return self.table_set.submit(self.lookup_plan(input, offsets, per_sample_weights))

    def lookup_plan(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                    per_sample_weights: Optional[torch.Tensor] = None) -> Lookup:
        flat, status = self._check_input(input)
        problem = check_bag_input(input, offsets, per_sample_weights, mode=self.mode,
                                  include_last_offset=self.include_last_offset,
                                  weight=self.local_weight) if status.ok else None
        if problem:
            flat, status = flat.new_empty(0), bad_input(f"{type(self).__name__}: {problem}")
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
            pooling = Bags(bags, self.mode, bag_lengths(input, offsets, flat.numel(), self.include_last_offset,
                                                     self.local_weight.device),
                           per_sample_weights.reshape(-1).detach() if per_sample_weights is not None else None)

        def finish(rows, inverse, pad):
            if pooling is not None:  # sum/mean: the same pooling, with a faster backward (see pool_rows)
                return pool_rows(rows, inverse, pooling, pad)
            return F.embedding_bag(inverse.view(shape), rows, offsets, mode=self.mode,
                                   per_sample_weights=per_sample_weights,
                                   include_last_offset=self.include_last_offset, padding_idx=pad)

        return Lookup(self, flat, status, finish, (bags, self.embedding_dim), pooling)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"


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
        if not isinstance(table, ShardedTable):
            raise TypeError(f"prefetch takes (sharded table, args[, kwargs]) calls, got {type(table).__name__}")
        handles.append(Prefetched(table, table.lookup_plan(*args, **kwargs)))
    table_set = handles[0].table.table_set
    if any(h.table.table_set is not table_set for h in handles):
        raise ValueError("prefetched lookups must share one round: tables of one group_tables set")
    table_set.prefetch([h.lookup for h in handles])
    return handles
