"""A lookup before its round has run: the lookup itself, how its ids form bags, and the placeholder result.

A table's ``forward`` turns its input into a :class:`Lookup` (ids, input
verdict, how to make the result from the round's rows) and hands it to its
set (:class:`sparsecomm.sharded.lookup.TableSet`). A lazy set answers with a
:class:`PendingLookup`: a tensor of the right shape, dtype and device whose
first real use runs the round. :class:`Prefetched` is a lookup whose id
exchange started early (``prefetch``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch.utils._pytree import tree_map

from sparsecomm.collectives.sharded_wire import InputStatus
from sparsecomm.sharded.protocol import LookupTable

__all__ = ["Bags", "Lookup", "PendingLookup", "Prefetched", "resolve"]


class Bags:
    """How a bag lookup's ids form bags, for owner-side pooling (sum or mean).

    Attributes:
        num_bags: bags in the result.
        mode: ``"sum"`` or ``"mean"``.
        lengths: ``(num_bags,)`` int64 ids per bag (consecutive in the flat
            ids, which they cover: the table refuses ids after the last bag).
        weights: ``(n,)`` per-sample weights (not requiring grad), or None.
        backward_seconds: how long the rows path's pooling backward took
            (:func:`sparsecomm.sharded.bag_pooling.pool_rows`), for ``owner_pooling="auto"``'s timing.
    """

    __slots__ = ("num_bags", "mode", "lengths", "weights", "backward_seconds")

    def __init__(self, num_bags: int, mode: str, lengths: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
        self.num_bags, self.mode, self.lengths, self.weights = num_bags, mode, lengths, weights
        self.backward_seconds = 0.0   # the requester's pooling backward on the rows path (owner_pooling="auto")

    def counts(self, bag_of: torch.Tensor) -> torch.Tensor:
        """``(num_bags,)`` int64: how many of the ids with bags ``bag_of`` each bag holds."""
        return torch.bincount(bag_of, minlength=self.num_bags)[:self.num_bags]

    def bag_of(self, n: int) -> torch.Tensor:
        """``(n,)`` int64: each of the ``n`` flat ids' bag."""
        lengths = self.lengths
        return torch.repeat_interleave(torch.arange(self.num_bags, device=lengths.device), lengths, output_size=n)


class Lookup:
    """One call of one table: its ids, how to turn the table's rows into the result, and the result.

    Attributes:
        table: the sharded table.
        ids: ``(n,)`` int64 ids (empty when ``status`` is not OK).
        status: the table's verdict on the input (:class:`~sparsecomm.collectives.sharded_wire.InputStatus`).
        finish: ``finish(rows, inverse, pad) -> result``: ``rows`` are the
            unique rows of the table in this round, ``inverse`` each id's
            position among them, ``pad`` the padding row's position or None.
        shape: the result's shape (known before the round runs).
        bags: for a bag lookup that owners may pool (sum/mean, weights
            without gradient): its :class:`Bags`; else None.
    """

    __slots__ = ("table", "ids", "status", "finish", "shape", "grad_enabled", "result", "bags")

    def __init__(self, table: LookupTable, ids: torch.Tensor, status: InputStatus,
                 finish: Callable[[torch.Tensor, torch.Tensor, Optional[int]], torch.Tensor],
                 shape: Tuple[int, ...], bags: Optional[Bags] = None) -> None:
        self.table, self.ids, self.status, self.finish, self.shape = table, ids, status, finish, tuple(shape)
        self.bags = bags
        self.grad_enabled = torch.is_grad_enabled()
        self.result: Optional[torch.Tensor] = None


# Tensor attributes that a placeholder answers without running its round.
_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
             torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.is_sparse.__get__,
             torch.Tensor.layout.__get__, torch.Tensor.__len__}


class PendingLookup(torch.Tensor):
    """A lazy set's lookup result before its round has run.

    Shape, dtype and device are known; reading anything else runs the round
    and continues with the real tensor (an autograd-tracked plain tensor).
    """

    @staticmethod
    def __new__(cls, lookup: Lookup, dtype: torch.dtype, device: torch.device) -> "PendingLookup":
        t = torch.Tensor._make_wrapper_subclass(cls, lookup.shape, dtype=dtype, device=device)
        t._sharded_lookup = lookup
        return t

    def resolve(self) -> torch.Tensor:
        """The real result (runs the round if it has not run)."""
        lookup = self._sharded_lookup
        if lookup.result is None:
            lookup.table.table_set.flush()
        if lookup.result is None:
            raise RuntimeError("sparsecomm: this lookup's round failed (see the error raised when it ran)")
        return lookup.result

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(lambda x: x.resolve() if isinstance(x, PendingLookup) else x, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Only code that bypasses __torch_function__ gets here, below autograd: a
        # gradient would be lost silently, so refuse instead.
        raise RuntimeError(f"sparsecomm: a pending sharded-table lookup reached {func} below autograd; run "
                           f"sparsecomm.sharded.flush(model) (or pass the result through a torch operation) first")

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D401 - torch's signature
        return repr(self.resolve())


def resolve(tree: Any) -> Any:
    """``tree`` with every pending lookup replaced by its result (runs their rounds)."""
    return tree_map(lambda x: x.resolve() if isinstance(x, PendingLookup) else x, tree)


class Prefetched:
    """A lookup whose id exchange has started (``prefetch``); call its table with it to finish the lookup."""

    __slots__ = ("table", "lookup", "used")

    def __init__(self, table: LookupTable, lookup: Lookup) -> None:
        self.table, self.lookup, self.used = table, lookup, False
