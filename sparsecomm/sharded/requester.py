"""The requester's half of a lookup round: what each table asks of the owners, and its results from their rows.

For every table of a round (:class:`sparsecomm.sharded.lookup.TableSet`)
the requester builds one :class:`~sparsecomm.collectives.sharded_exchange.TableRequest`:

- rows path (:func:`rows_request`): the unique ids of all the table's
  lookups in the round, the hot ones served by the table's replica, the cold
  ones grouped by owner; each lookup keeps its inverse into the rows, in the
  order they will arrive (by owner, then the hot rows), so they need no
  sorting back;
- pooled path (:func:`pooled_request`): per owner, the distinct ids it
  holds, each occurrence's position among them and each bag's length; the
  owner answers with one partial bag per bag, which :meth:`TableRound.result`
  adds up.

In backward (:func:`gradient_rows`) the gradient of those rows goes back
along the same routes; a table's hot rows' gradient is summed over the
ranks instead.

What the round keeps of each table, as requester and as owner, is a
:class:`TableRound`.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from sparsecomm import ops
from sparsecomm.collectives.sharded_exchange import PooledRequest, TableRequest
from sparsecomm.collectives.sharded_wire import encode_pooled
from sparsecomm.sharded.hot import HotRows
from sparsecomm.sharded.pending import Bags, Lookup
from sparsecomm.sharded.pooling import PoolingChoice, pooled_estimates, rows_estimates
from sparsecomm.sharded.protocol import LookupTable

__all__ = ["TableRound", "rows_request", "pooled_request", "GradientRows", "gradient_rows"]


class TableRound:
    """What a round keeps of one table.

    As requester: its unique ids, their owners (of the cold ones, when the
    table replicates hot rows), each lookup's inverse into the round's rows
    (in the order they arrive: by owner, then the hot rows), and
    for a pooled lookup the bag of every partial row it gets back. As owner:
    the slots whose gradient rows it receives (``grad_slots``, their ids
    ``grad_ids``); when some requester pooled, those are the distinct slots, and
    slot ``u`` gets the sum of gradient rows ``grad_rows[grad_offsets[u]:grad_offsets[u + 1]]``
    (times ``grad_scale``): one bag per slot.
    """

    __slots__ = ("unique", "part", "inverses", "pad", "pooled", "timed", "bag_rows", "bag_counts", "bags",
                 "grad_slots", "grad_ids", "grad_offsets", "grad_rows", "grad_scale", "hot_positions",
                 "finish_seconds", "row_bags")

    def __init__(self) -> None:
        self.unique = self.part = None
        # Replicated hot rows: the positions in the table's hot set of the round's hot ids (their rows follow
        # the cold rows), or None.
        self.hot_positions: Optional[torch.Tensor] = None
        # "auto" timing beyond the round: the requester's work on the rows it got (pooling them, or adding the
        # partial bags), and on the rows path the bags whose pooling backward times itself.
        self.finish_seconds = 0.0
        self.row_bags: Optional[Bags] = None
        self.inverses: List[torch.Tensor] = []
        self.pad: Optional[int] = None
        self.pooled = self.timed = False
        self.bag_rows = self.bag_counts = self.bags = None
        self.grad_slots = self.grad_ids = self.grad_offsets = self.grad_rows = self.grad_scale = None

    def result(self, rows: torch.Tensor, lookup: Lookup, nth: int) -> torch.Tensor:
        """The result of ``lookup``, the table's ``nth`` lookup of the round, from the rows that came back."""
        if not self.pooled:
            return lookup.finish(rows, self.inverses[nth], self.pad)
        # The owners' partial bags added up per bag (divided by the count for "mean").
        bags = self.bags
        out = rows.new_zeros(bags.num_bags, rows.shape[1]).index_add(0, self.bag_rows, rows)
        if bags.mode == "mean":
            out = out / self.bag_counts.clamp(min=1).to(out.dtype).unsqueeze(1)
        return out

    def own_seconds(self) -> float:
        """The requester's own work on this table's rows beyond the round (``owner_pooling="auto"``'s timing)."""
        return self.finish_seconds + (self.row_bags.backward_seconds if self.row_bags is not None else 0.0)


def rows_request(t: LookupTable, info: TableRound, lookups: Sequence[Lookup], ok: bool, me: int,
                 pooling: PoolingChoice) -> TableRequest:
    """The rows-path request of table ``t`` (all its lookups of the round; none: it only serves its rows).

    ``ok``: every lookup of the round passed its input checks (else nothing
    is asked: the round raises on every rank).
    """
    device = t.local_weight.device
    ids = [lk.ids for lk in lookups]
    flat = (ids[0] if len(ids) == 1 else torch.cat(ids)) if ids and ok else \
        torch.empty(0, dtype=torch.int64, device=device)
    info.unique, inverse = ops.unique_inverse(flat, t.num_embeddings)
    info.inverses = ([inverse] if len(ids) == 1 else list(torch.split(inverse, [x.numel() for x in ids]))) \
        if ids and ok else [inverse] * len(ids)
    info.pad = t.padding_position(info.unique)
    hot_mask = _split_hot(t, info, inverse) if ok else None
    cold = info.unique if hot_mask is None else info.unique[~hot_mask]
    info.part = t.layout.partition(cold)
    t.stats.rows_in += int(flat.numel())
    t.stats.row_lookups += len(lookups)
    estimates = (0, 0)
    if ok and len(lookups) == 1 and lookups[0].bags is not None and t.hot is None:
        if t.owner_pooling == "bytes":
            estimates = rows_estimates(t, info.part, info.unique.numel(), inverse, lookups[0].bags, me)
        elif t.owner_pooling == "auto":
            estimates, info.timed = pooling.measured(t), True
            info.row_bags = lookups[0].bags
    # One owner (table-wise): the rows arrive in the order asked, the inverses already point at them.
    if info.unique.numel() and not (hot_mask is None and t.layout.scheme == "table"):
        _point_to_arrival(info, hot_mask)
    return TableRequest(info.part.ids, info.part.counts, t.fingerprint(), t.num_embeddings, t.layout.num_local,
                        bool(lookups), t.layout.owns, weight_dtype=t.local_weight.dtype, estimates=estimates,
                        owned_range=t.layout.owned_range())


def _split_hot(t: LookupTable, info: TableRound, inverse: torch.Tensor) -> Optional[torch.Tensor]:
    """Count the round's ids for the hot set's choice; the mask of the hot ones (served by the replica), or None."""
    hot = t.hot
    if hot is None:
        return None
    hot.count(info.unique, torch.bincount(inverse, minlength=info.unique.numel()))
    split = hot.split(info.unique)
    if split is None:
        return None
    hot_mask, info.hot_positions = split
    return hot_mask


def _point_to_arrival(info: TableRound, hot_mask: Optional[torch.Tensor]) -> None:
    """Point the lookups' inverses (and the padding position) at the rows in the order they arrive.

    The rows arrive by owner, then the hot ones from the replica: pointing
    the lookups there saves sorting the rows back, and backward's gradient
    rows are then in the order they travel.
    """
    arrival = info.part.perm if hot_mask is None else \
        torch.cat([(~hot_mask).nonzero().view(-1)[info.part.perm], hot_mask.nonzero().view(-1)])
    where = torch.empty_like(arrival)
    where[arrival] = torch.arange(where.numel(), device=where.device)
    info.inverses = [where[x] for x in info.inverses]
    info.pad = int(where[info.pad]) if info.pad is not None else None


def pooled_request(t: LookupTable, info: TableRound, lk: Lookup, me: int, n: int, pooling: PoolingChoice
                   ) -> TableRequest:
    """A pooled lookup's request: unique ids by owner, and per owner each occurrence's position and bag."""
    bags = lk.bags
    flat = lk.ids
    bag_of = bags.bag_of(flat.numel())
    weights = bags.weights
    keep = flat != t.padding_idx if t.padding_idx is not None else None
    if keep is not None and not bool(keep.all()):
        flat, bag_of = flat[keep], bag_of[keep]
        weights = weights[keep] if weights is not None else None
    t.stats.rows_in += int(flat.numel())
    info.pooled, info.bags = True, bags
    info.bag_counts = bags.counts(bag_of) if bags.mode == "mean" else None
    # One pass (ops.pooled_request): occurrences grouped by owner, bag order kept inside an owner; per
    # owner its distinct ids (sorted), each occurrence's position among them, and its partial bags' lengths.
    layout = t.layout
    plan = ops.pooled_request(flat, bag_of, n, layout.scheme, t.num_embeddings, num_bags=bags.num_bags,
                              **layout.owner_map)
    occ_counts = plan.occ_counts.tolist()
    counts = plan.unique_counts.cpu()
    info.unique = plan.unique
    info.bag_rows = plan.bag_rows
    w = weights[plan.order] if weights is not None else None
    positions = torch.split(plan.positions, occ_counts)
    len_split = torch.split(plan.lengths, plan.bag_counts.tolist())
    w_split = torch.split(w, occ_counts) if w is not None else [None] * n
    words = [encode_pooled(p, ln, x) for p, ln, x in zip(positions, len_split, w_split)]
    weight_bytes = t.local_weight.element_size() if w is not None else 0
    info.timed = t.owner_pooling == "auto"
    estimates = pooled_estimates(t, counts, plan.occ_counts, plan.bag_counts, weight_bytes, me) \
        if t.owner_pooling == "bytes" else pooling.measured(t) if info.timed else (0, 0)
    t.stats.pooled_lookups += 1
    return TableRequest(info.unique, counts, t.fingerprint(), t.num_embeddings, layout.num_local, True,
                        layout.owns, PooledRequest(plan.occ_counts, plan.bag_counts, words, weight_bytes),
                        t.local_weight.dtype, estimates, layout.owned_range())


class GradientRows(NamedTuple):
    """What a backward pushes, as requester.

    Attributes:
        cold: per table, the gradient rows for the owners, those for each owner consecutive.
        hot: per table with a hot set, its replica and this rank's ``(positions, rows)`` of hot-row gradient.
        hot_tables: those tables.
    """

    cold: List[torch.Tensor]
    hot: List[Tuple[HotRows, torch.Tensor, torch.Tensor]]
    hot_tables: List[LookupTable]


def gradient_rows(tables: Sequence[LookupTable], infos: Sequence[TableRound], grads: Sequence[Optional[torch.Tensor]],
                  pushing: Sequence[bool], send: Sequence[Sequence[int]]) -> GradientRows:
    """Split each pushed table's gradient into the rows for the owners and its hot rows' part.

    ``grads``: per table, the gradient of the rows the round returned (None:
    looked up, but no gradient this time: zeros); ``send``: per table, the
    rows each owner returned (as many gradient rows go back).
    """
    out = GradientRows([], [], [])
    for t, info, g, p, count in zip(tables, infos, grads, pushing, send):
        if not p:
            out.cold.append(t.local_weight.new_empty(0, t.embedding_dim))
            continue
        if g is None:  # looked up, but its result got no gradient this time
            size = sum(count) if info.pooled or info.unique is None else info.unique.numel()
            g = t.local_weight.new_zeros(size, t.embedding_dim)
        if t.hot is not None and t.hot.size:  # every rank takes part in the hot rows' sum, looked up or not
            out.hot_tables.append(t)
            positions = info.hot_positions if info.hot_positions is not None else \
                torch.empty(0, dtype=torch.int64, device=g.device)
            cold = g.shape[0] - positions.numel()   # the hot rows' gradient follows the cold rows'
            out.hot.append((t.hot, positions, g[cold:]))
            g = g[:cold]
        # In the order the rows travel: by owner (rows), or one gradient row per partial bag (pooled).
        out.cold.append(g.contiguous())
    return out
