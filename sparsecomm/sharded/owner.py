"""The owner's half of a lookup round: the rows it serves each requester, and the gradient pushed back to it.

An owner gathers the rows its peers asked for (:func:`serve`), or, for a
requester that looked a bag table up pooled, pools them into one partial
bag per bag it sent. In backward it turns the gradient rows that arrive
along the same routes into its shard's gradient (:func:`owner_gradients`):
a sparse COO gradient of ``local_weight``, or an update applied at once by
a fused optimizer (the table's :meth:`owner_gradient`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from sparsecomm import ops
from sparsecomm.collectives.sharded_exchange import Routes
from sparsecomm.collectives.sharded_wire import PooledPart
from sparsecomm.sharded.protocol import LookupTable
from sparsecomm.sharded.requester import TableRound

__all__ = ["serve", "owner_gradients"]


def serve(t: LookupTable, info: TableRound, routes: Routes, i: int) -> torch.Tensor:
    """The rows (or partial pooled bags) this owner sends back for table ``i``, grouped by requester."""
    weight = t.local_weight.detach()
    if routes.problem is not None:  # a peer sent ids this rank does not own: serve nothing, all raise in pull
        return weight.new_zeros(sum(routes.rows_recv[i]), t.embedding_dim)
    requested, parts = routes.requested[i], routes.pooled[i]
    if requested.numel() == 0 and not any(routes.rows_recv[i]):
        # Asked nothing (a table-wise table this rank does not hold): no rows, no slots to compute.
        info.grad_slots, info.grad_ids = requested.to(weight.device), requested
        return weight.new_empty(0, t.embedding_dim)
    slots = t.layout.slots(requested).to(weight.device)
    info.grad_slots, info.grad_ids = slots, requested
    if all(p is None for p in parts):
        return ops.gather_rows(weight, slots)
    return _serve_pooled(t, info, weight, slots, requested, parts, routes.recv[i])


def _serve_pooled(t: LookupTable, info: TableRound, weight: torch.Tensor, slots: torch.Tensor,
                  requested: torch.Tensor, parts: Sequence[Optional[PooledPart]], recv: Sequence[int]
                  ) -> torch.Tensor:
    """Some requesters pool: per requester, one partial bag per bag it sent, or (rows path) each id as a bag
    of its own; all of them in one embedding_bag.

    Backward adds each gradient row (times the weight) into the coalesced
    gradient of the distinct slots asked for (``info.grad_*``).
    """
    info.grad_slots, where = ops.unique_inverse(slots, max(t.layout.num_slots, 1))
    info.grad_ids = torch.empty_like(info.grad_slots).index_copy_(0, where, requested)
    dev = weight.device
    any_weights = any(p is not None and p.weights is not None for p in parts)
    positions, lengths, scales = [], [], []
    start = 0
    for p, count in zip(parts, recv):
        if p is None:
            positions.append(torch.arange(start, start + count, device=dev))
            lengths.append(torch.ones(count, dtype=torch.int64, device=dev))
        else:
            positions.append(p.positions + start)
            lengths.append(p.lengths)
        if any_weights:
            scales.append(p.weights if p is not None and p.weights is not None else
                          weight.new_ones(positions[-1].numel()))
        start += count
    positions, lengths = torch.cat(positions), torch.cat(lengths)
    scale = torch.cat(scales) if any_weights else None
    # Backward sums, per distinct slot, its occurrences' gradient rows in input order (one embedding_bag
    # over the few gradient rows): ops.bag_groups sorts the occurrences by slot and names their bags.
    order, info.grad_rows, info.grad_offsets = ops.bag_groups(where, positions, lengths, info.grad_slots.numel())
    info.grad_scale = scale[order] if any_weights else None
    if lengths.numel() == 0:
        return weight.new_zeros(0, t.embedding_dim)
    return F.embedding_bag(slots[positions], weight, torch.cumsum(lengths, 0) - lengths, mode="sum",
                           per_sample_weights=scale)


def owner_gradients(tables: Sequence[LookupTable], infos: Sequence[TableRound], pushing: Sequence[bool],
                    got: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """Each table's gradient from the rows pushed to this owner (None: not pushed, or applied by a fused
    optimizer)."""
    out = []
    for t, info, g, p in zip(tables, infos, got, pushing):
        if not p:
            out.append(None)
            continue
        coalesced = info.grad_rows is not None
        if coalesced:  # pooled requesters: each occurrence adds its bag's gradient (times its weight) to its row's
            g = F.embedding_bag(info.grad_rows, g, info.grad_offsets, mode="sum",
                                per_sample_weights=info.grad_scale)
        out.append(t.owner_gradient(info.grad_slots, info.grad_ids, g, coalesced=coalesced))
    return out
