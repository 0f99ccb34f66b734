"""Hot-row replication: a sharded table's most looked-up rows kept on every rank, the rest sharded.

With ``hot_rows=HotRowConfig(budget_bytes=...)`` a table keeps a *replica*
of its hottest rows (and of their optimizer state) on every rank:

- **Lookups.** A round's unique ids that are hot are read from the replica;
  only the cold ones travel to their owners (``sparsecomm.sharded.lookup``).
- **Gradients.** In backward, every rank's hot-row gradient is summed with
  one :func:`~sparsecomm.collectives.sparse.sparse_allreduce_coalesced` per
  round (all tables together, ``method="allgather"``: each rank sums the
  same rows in rank order, so every replica gets bitwise the same sum),
  averaged like the owners average (``grad_reduction``).
- **Updates.** Every rank applies the table's own optimizer rule to the
  replica (fused: at once; else in ``step()``), with the table's step count,
  then the owner of each updated row copies the new row and its optimizer
  state into its shard (*write-through*). So the shard is always current:
  ``state_dict``, ``full_weight``, ``sharded.save`` and resharding need no
  extra step, and a row leaving the hot set needs no transfer.
- **Choosing the hot set.** Each rank counts its lookups (ids and how often
  they occur) over a window of ``window`` rounds. At the window's end (a
  round number, the same on every rank) every rank shares its ``K``
  most-counted ids with their counts (one all-gather); all ranks add them
  up and take the same ``K`` ids with the highest totals (ties: smaller id),
  where ``K = budget_bytes // (bytes of a row + its optimizer state + 16)``.
  Rows entering the set come from their owners, values and optimizer state
  (one all-gather); rows staying keep their replica. Ids counted fewer than
  ``min_count`` times stay sharded. The padding row is never hot.

Training equals the sharded-only table's up to floating-point summation
order (tested): the same rows get the same gradient sums and the same rule
at the same step. Replication does not save bytes over the sharded rows
path, whose rounds already send each rank's unique rows once: per hot row
looked up by ``s`` of the ``N`` ranks, the rows path moves ``2 s (N-1)/N``
rows, the replica's gradient sum at least ``s (N-1)/N + (N-1)`` (at best
equal, when every rank looks it up). What it saves is the hot rows' id
requests and owner gathers, at the price of the optimizer work on the hot
rows on every rank (docs/DESIGN.md, "Hot-row replication").

Limits: the hot set is built only for a table updated by a sharded
optimizer (the replica needs its rule); a table with a hot set takes the
rows path (no owner pooling); the set does not change while a gradient is
held (unfused optimizers, from backward until ``zero_grad()``);
loading a state into the table or its optimizer empties the set on that
rank (every rank must load, as for any sharded state; a rank that did not
makes the next lookup raise on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sparsecomm import ops
from sparsecomm.collectives.sharded_exchange import allgather_table_rows
from sparsecomm.collectives.objects import all_gather_objects
from sparsecomm.collectives.sparse import sparse_allreduce_coalesced
from sparsecomm.types import SparseSyncStats

__all__ = ["HotRowConfig", "HotRows", "sync_hot_gradients"]

# Bytes a hot row costs beyond its values and optimizer state: its id and its slot on its owner.
_INDEX_BYTES = 16


@dataclass(frozen=True)
class _Candidates:
    """What each rank shares at a window's end to choose the next hot set (checked by ``_agreement_problem``)."""

    k: int                  # hot rows the budget affords (the same on every rank)
    version: int            # the rank's current hot set's version (the same on every rank)
    pending: bool           # a hot-row gradient is held on this rank (the set must not change)
    ids: torch.Tensor       # the rank's most-counted ids of the window (int64, distinct, at most k)
    counts: torch.Tensor    # their counts


@dataclass(frozen=True)
class HotRowConfig:
    """How a sharded table replicates its hottest rows (see the module docstring).

    Attributes:
        budget_bytes: memory per rank for the replicated rows: values,
            optimizer state and 16 bytes of index per row. 0: no replication.
        window: rounds (lookups of the table's set) between hot-set choices.
        min_count: a row is replicated only if the ranks looked it up at
            least this many times together during the window.
    """

    budget_bytes: int
    window: int = 64
    min_count: int = 2

    def __post_init__(self) -> None:
        for name, low in (("budget_bytes", 0), ("window", 1), ("min_count", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"HotRowConfig.{name} must be an int >= {low}, got {v!r}")


class HotRows:
    """One table's replica on one rank: the hot ids (sorted), their rows and optimizer state.

    Attributes:
        config: the :class:`HotRowConfig`.
        ids: ``(K,)`` int64 hot ids, sorted, the same on every rank.
        weight: ``(K, d)`` their values (equal to the owners' shard rows).
        state: per optimizer row-state name, ``(K, ...)`` its rows.
        owned_slots: ``(K,)`` int64, each hot row's slot in this rank's
            shard, or -1 where another rank owns it.
        version: bumped whenever the set changes or is emptied; it joins the
            table's lookup fingerprint, so ranks holding different sets raise.
        choices: hot-set choices made (including ones that kept the set).
        hits, misses: this rank's looked-up unique rows read from the
            replica, and sent to their owners, summed over rounds.
    """

    def __init__(self, config: HotRowConfig, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.ids = torch.empty(0, dtype=torch.int64, device=device)
        self.weight = torch.empty(0, dim, dtype=dtype, device=device)
        self.state: Dict[str, torch.Tensor] = {}
        self.owned_slots = torch.empty(0, dtype=torch.int64, device=device)
        self.version = 0
        self.choices = 0
        self.hits = self.misses = 0
        self._seen: List[Tuple[torch.Tensor, torch.Tensor]] = []   # (ids, counts) per round of the window
        self._grad: List[Tuple[torch.Tensor, torch.Tensor]] = []   # reduced (positions, rows) until zero_grad

    @property
    def size(self) -> int:
        """Rows in the hot set (``K``)."""
        return int(self.ids.numel())

    @property
    def pending(self) -> bool:
        """Whether a reduced gradient is held (unfused optimizers: from backward until ``zero_grad``)."""
        return bool(self._grad)

    def nbytes(self) -> int:
        """Bytes of the replica on this rank: rows, optimizer state, index, and the window's counts."""
        tensors = [self.ids, self.weight, self.owned_slots, *self.state.values()]
        tensors += [t for pair in self._seen for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---------------------------------------------------------------- lookups

    def split(self, unique: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(hot, positions)`` for a round's sorted unique ids: which are hot, and where the hot ones are
        in :attr:`ids`; None when nothing is hot."""
        k = self.size
        if k == 0 or unique.numel() == 0:
            self.misses += unique.numel()
            return None
        pos = torch.searchsorted(self.ids, unique).clamp_(max=k - 1)
        hot = self.ids[pos] == unique
        hits = int(hot.sum())
        self.hits += hits
        self.misses += unique.numel() - hits
        if not hits:
            return None
        return hot, pos[hot]

    def count(self, unique: torch.Tensor, counts: torch.Tensor) -> None:
        """Add a round's lookups (its unique ids and how often each occurred) to the window's counts."""
        if unique.numel():
            self._seen.append((unique, counts.to(torch.int64)))

    # -------------------------------------------------------------- updates

    def add_gradient(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep a reduced gradient for ``step()`` (unfused optimizers)."""
        self._grad.append((positions, rows))

    def gradient(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The pending gradient, summed over the backward passes since the last ``zero_grad``.

        Like a parameter's ``.grad`` it stays until :meth:`clear_gradient`
        (the optimizer's ``zero_grad``): a second ``step()`` applies it again.
        """
        if not self._grad:
            return None
        if len(self._grad) > 1:
            pos = torch.cat([p for p, _ in self._grad])
            rows = torch.cat([r for _, r in self._grad])
            self._grad = [ops.coalesce_rows(pos.contiguous(), rows.contiguous(), self.size)]
        return self._grad[0]

    def clear_gradient(self) -> None:
        self._grad = []

    def write_through(self, weight: torch.Tensor, state: Dict[str, Any], positions: torch.Tensor) -> torch.Tensor:
        """Copy updated hot rows (and their optimizer state) into this rank's shard where it owns them; return the
        slots written."""
        slots = self.owned_slots[positions]
        mine = slots >= 0
        if not bool(mine.any()):
            return slots[:0]
        slots, positions = slots[mine], positions[mine]
        weight.index_copy_(0, slots, self.weight.index_select(0, positions))
        for name, rows in self.state.items():
            state[name].index_copy_(0, slots, rows.index_select(0, positions))
        return slots

    def drop(self) -> None:
        """Empty the hot set on this rank (after its shard or optimizer state was replaced)."""
        self.ids = self.ids[:0]
        self.weight = self.weight[:0]
        self.state = {k: v[:0] for k, v in self.state.items()}
        self.owned_slots = self.owned_slots[:0]
        self._grad = []
        self.version += 1

    # ------------------------------------------------------------- choosing

    def _candidates(self, k: int, padding_idx: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``k`` most-counted ids of the window and their counts."""
        device = self.ids.device
        if not self._seen or k == 0:
            return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.int64, device=device)
        unique, total = _sum_counts(torch.cat([i for i, _ in self._seen]), torch.cat([c for _, c in self._seen]))
        if padding_idx is not None:
            total[unique == padding_idx] = 0
        top = torch.topk(total, min(k, unique.numel())).indices
        keep = total[top] > 0
        return unique[top[keep]], total[top[keep]]

    def choose(self, table: Any, group) -> None:
        """Choose the next hot set from every rank's counts and move the rows (collective over ``group``).

        Raises:
            ValueError: on every rank, when the ranks' budgets, hot sets or
                candidates disagree or are malformed (a bug or a peer not
                running the same code).
        """
        opt = table.optimizer
        state = opt.state.get(table.local_weight) if opt is not None else None
        names = tuple(opt.row_state_names) if state is not None else ()
        w = table.local_weight
        per_row = w.shape[1] * w.element_size() + _INDEX_BYTES
        per_row += sum(_width(state[n]) * state[n].element_size() for n in names)
        k = self.config.budget_bytes // per_row if state is not None else 0
        cand, counts = self._candidates(k, table.padding_idx)
        everyone = all_gather_objects(_Candidates(k, self.version, self.pending, cand, counts), group)
        self._seen = []
        self.choices += 1
        problem = _agreement_problem(everyone, table.num_embeddings)
        if problem:
            raise ValueError(f"{type(table).__name__} hot rows: {problem}")
        if any(e.pending for e in everyone):
            return  # a gradient is held somewhere (until zero_grad): keep the set, choose at the next window's end
        unique, total = _sum_counts(torch.cat([e.ids.to(self.ids.device) for e in everyone]),
                                    torch.cat([e.counts.to(self.ids.device) for e in everyone]))
        order = torch.argsort(-total, stable=True)[:k]          # highest totals; ties: the smaller id
        order = order[total[order] >= self.config.min_count]
        new = torch.sort(unique[order]).values
        if torch.equal(new, self.ids):
            return
        self._move(table, new, state, names, group)

    def _move(self, table: Any, new: torch.Tensor, state: Optional[Dict[str, Any]], names: Sequence[str],
              group) -> None:
        """Make ``new`` the hot set: staying rows keep their replica, entering rows come from their owners."""
        w = table.local_weight.detach()
        layout = table.layout
        d = w.shape[1]
        staying = torch.isin(self.ids, new)
        entering = new[~torch.isin(new, self.ids)]
        mine = entering[layout.owns(entering)]
        slots = layout.slots(mine).to(w.device)
        packed = torch.cat([w.index_select(0, slots)] +
                           [state[n].index_select(0, slots).reshape(slots.numel(), _width(state[n])).to(w.dtype)
                            for n in names],
                           dim=1)
        got_ids, got = allgather_table_rows(mine, packed, table.num_embeddings, group, complete=False)
        if got_ids.numel() != entering.numel() or not torch.equal(torch.sort(got_ids).values, entering):
            raise ValueError(f"{type(table).__name__} hot rows: the owners sent {got_ids.numel()} rows for the "
                             f"{entering.numel()} entering the hot set, not each exactly once: a bug or a version "
                             f"mismatch between ranks")
        weight = w.new_empty(new.numel(), d)
        into = torch.searchsorted(new, self.ids[staying])
        weight[into] = self.weight[staying]
        at = torch.searchsorted(new, got_ids)
        weight[at] = got[:, :d]
        new_state: Dict[str, torch.Tensor] = {}
        col = d
        for n in names:
            shard = state[n]
            rows = shard.new_empty((new.numel(),) + tuple(shard.shape[1:]))
            width = _width(shard)
            if n in self.state and self.state[n].numel():
                rows[into] = self.state[n][staying]
            rows[at] = got[:, col:col + width].reshape((-1,) + tuple(shard.shape[1:])).to(shard.dtype)
            new_state[n] = rows
            col += width
        owned = layout.owns(new)
        owned_slots = torch.full_like(new, -1)
        owned_slots[owned] = layout.slots(new[owned])
        self.ids, self.weight, self.state, self.owned_slots = new, weight, new_state, owned_slots
        self._grad = []
        self.version += 1


def _sum_counts(ids: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The distinct ``ids`` (sorted) and the sum of ``counts`` of each."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return unique, torch.zeros(unique.numel(), dtype=torch.int64, device=ids.device).index_add_(0, inverse, counts)


def _width(rows: torch.Tensor) -> int:
    """Values per row of a row-aligned tensor (1 for one value per row)."""
    return math.prod(rows.shape[1:])


def _agreement_problem(everyone: List[Any], num_rows: int) -> Optional[str]:
    """What is wrong with the ranks' shared candidates, or None; every rank reaches the same verdict."""
    first = everyone[0]
    for r, e in enumerate(everyone):
        if not isinstance(e, _Candidates):
            return f"rank {r} sent a malformed candidate list"
        if e.k != first.k:
            return (f"ranks budget different hot-row counts (rank 0: {first.k}, rank {r}: {e.k}): pass the "
                    f"same HotRowConfig and optimizer on every rank")
        if e.version != first.version:
            return (f"ranks hold different hot sets (hot-row version {first.version} on rank 0, {e.version} "
                    f"on rank {r}): load states into the table on every rank")
        ids, counts = e.ids, e.counts
        if not (isinstance(ids, torch.Tensor) and isinstance(counts, torch.Tensor) and ids.dtype == torch.int64
                and counts.dtype == torch.int64 and ids.dim() == 1 and ids.shape == counts.shape
                and ids.numel() <= max(first.k, 0)):
            return f"rank {r} sent a malformed candidate list"
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows or int(counts.min()) < 0
                            or ids.unique().numel() != ids.numel()):
            return f"rank {r} sent candidate ids outside [0, {num_rows}), repeated, or negative counts"
    return None


def sync_hot_gradients(entries: Sequence[Tuple[HotRows, torch.Tensor, torch.Tensor]], group, world_size: int,
                       average: Sequence[bool], stats: Sequence[SparseSyncStats]
                       ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Sum every rank's hot-row gradients, all tables in one call; ``(positions, rows)`` per table, coalesced.

    Args:
        entries: per table, its replica and this rank's ``(positions, rows)``
            (distinct positions; may be empty). The same tables on every rank.
        group: the tables' group (None: one rank).
        average: per table, divide by ``world_size`` (``grad_reduction="mean"``).
        stats: per table, the counters its bytes are added to (the table's ``stats``).
    """
    if not entries:
        return []
    tensors = [torch.sparse_coo_tensor(pos.view(1, -1), rows, (hot.size, rows.shape[1]), check_invariants=False)
               for hot, pos, rows in entries]
    if group is None:
        summed = [t.coalesce() for t in tensors]
    else:
        mine = [SparseSyncStats() for _ in tensors]
        summed = sparse_allreduce_coalesced(tensors, group, "sum", method="allgather", nonfinite="propagate",
                                            stats=mine)
        for total, s in zip(stats, mine):
            total.bytes_sent += s.bytes_sent
            total.bytes_recv += s.bytes_recv
    out = []
    for s, avg in zip(summed, average):
        rows = s._values()
        if avg and world_size > 1:
            rows = rows / world_size
        out.append((s._indices()[0], rows))
    return out
