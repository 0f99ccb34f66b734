"""Sharded lookups inside ``torch.compile``: each lookup is one custom operator, ``sparsecomm::sharded_lookup``.

A lookup is a collective round (Python state, all-to-alls, input checks that
must fail on every rank together), so Dynamo cannot trace into it. When a
sharded table's ``forward`` runs under ``torch.compile``, it calls this
operator instead. The graph sees an opaque op with a fake implementation
(the result's shape, dtype and device are known from the input's shape and
the table), so ``fullgraph=True`` holds; at run time the operator runs the
table's eager lookup, unchanged: the same round, checks, errors on every
rank, owner pooling choice, stats.

Backward: the operator's autograd formula calls
``sparsecomm::sharded_lookup_backward``, which runs the eager round's own
backward (the gradient push to the owners; the owners' gradient lands in
``local_weight.grad``, or a fused optimizer applies it). The shard is not an
input of the graph (it is not a Parameter; see ``embedding.py``): what ties
the op into the compiled autograd graph is a zero-element ``anchor`` tensor of
the table that requires grad, and whose gradient (empty) the backward op
returns. The eager round's autograd graph is kept, between forward and
backward, under a key carried by the op's second output (an int64 ``token``
saved for backward); it is dropped when the token dies, so a forward whose
backward never runs frees its round like eager autograd would.

Both ops are registered as side-effecting, so a compiler never drops or
merges them: every rank must run every round.

Under compile each lookup is its own round (a ``group_tables`` set does not
batch compiled lookups), and prefetch handles are not accepted.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["register", "lookup", "sharded_lookup", "sharded_lookup_backward", "open_rounds"]

# key -> table; the key is a constant of the compiled graph (Dynamo specializes on it).
_TABLES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
# token key -> (the eager result with its autograd graph, the per-sample weights leaf or None)
_ROUNDS: Dict[int, Tuple[Tensor, Optional[Tensor]]] = {}
_keys = itertools.count()


def register(table: Any) -> int:
    """Give ``table`` the key its compiled lookups name it by."""
    key = table.table_id
    _TABLES[key] = table
    return key


def open_rounds() -> int:
    """Compiled lookups whose backward has not run yet and whose graph is alive."""
    return len(_ROUNDS)


def _table(key: int) -> Any:
    table = _TABLES.get(key)
    if table is None:
        raise RuntimeError(f"sparsecomm: the sharded table #{key} of this compiled lookup no longer exists")
    return table


@contextlib.contextmanager
def _autograd(enabled: bool) -> Iterator[None]:
    """Record autograd inside an operator's implementation (the dispatcher runs it below autograd).

    The eager round is an ``autograd.Function`` plus torch's pooling; its
    graph is what the backward op later runs, so it must be recorded here.
    """
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    try:
        for k in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        with torch.set_grad_enabled(enabled):
            yield
    finally:
        for k, was in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


def _shape(table: Any, ids: Tensor, offsets: Optional[Tensor]) -> Tuple[int, ...]:
    """The result's shape, as the eager lookup gives it (for the fake implementation)."""
    d = table.embedding_dim
    if not table.is_bag:  # ShardedEmbedding
        return tuple(ids.shape) + (d,)
    if ids.dim() == 2:
        return (ids.shape[0], d)
    if offsets is None:
        return (0, d)  # refused at run time, on every rank
    return (offsets.shape[0] - int(table.include_last_offset), d)


@torch.library.custom_op("sparsecomm::sharded_lookup", mutates_args=())
def sharded_lookup(anchor: Tensor, ids: Tensor, offsets: Optional[Tensor], per_sample_weights: Optional[Tensor],
                   table: int, grad: bool, weights_grad: bool) -> Tuple[Tensor, Tensor]:
    """One lookup of sharded table ``table`` (collective), as its eager ``forward``; returns (result, token).

    ``grad``: record the round for backward; ``weights_grad``: the
    per-sample weights get a gradient too. ``anchor`` is the table's
    zero-element tensor that carries the op's place in autograd.
    """
    t = _table(table)
    with _autograd(grad):
        weights = None
        if per_sample_weights is not None:
            weights = per_sample_weights.detach().requires_grad_(weights_grad and grad)
        args = (ids,) if not t.is_bag else (ids, offsets, weights)
        result = t.table_set.run(t.lookup_plan(*args))
    key = next(_keys)
    token = torch.tensor([key], dtype=torch.int64)
    if grad and result.requires_grad:
        _ROUNDS[key] = (result, weights if weights_grad else None)
        weakref.finalize(token, _ROUNDS.pop, key, None)
    return result.detach(), token


@sharded_lookup.register_fake
def _sharded_lookup_fake(anchor, ids, offsets, per_sample_weights, table, grad, weights_grad):
    t = _table(table)
    w = t.local_weight
    return torch.empty(_shape(t, ids, offsets), dtype=w.dtype, device=w.device), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("sparsecomm::sharded_lookup_backward", mutates_args=())
def sharded_lookup_backward(grad: Tensor, token: Tensor, anchor: Tensor, per_sample_weights: Optional[Tensor]
                            ) -> Tuple[Tensor, Tensor]:
    """Backward of one compiled lookup (collective): push its gradient to the owners.

    Returns the anchor's gradient (empty) and, when ``per_sample_weights`` is
    given (they need a gradient), theirs; else an empty tensor.
    """
    state = _ROUNDS.pop(int(token[0]), None)
    if state is None:
        raise RuntimeError("sparsecomm: this compiled sharded lookup has no recorded round: its backward already "
                           "ran (backward through a sharded lookup runs once) or it ran without gradients")
    result, weights = state
    with _autograd(True):
        torch.autograd.backward(result, grad.to(result.dtype))
    if per_sample_weights is None:
        weights_out = anchor.new_empty(0)
    elif weights is None or weights.grad is None:
        weights_out = torch.zeros_like(per_sample_weights)
    else:
        weights_out = weights.grad
    return torch.zeros_like(anchor), weights_out


@sharded_lookup_backward.register_fake
def _sharded_lookup_backward_fake(grad, token, anchor, per_sample_weights):
    weights_out = anchor.new_empty(0) if per_sample_weights is None else torch.empty_like(per_sample_weights)
    return torch.empty_like(anchor), weights_out


def _setup(ctx, inputs, output) -> None:
    anchor, _, _, per_sample_weights, _, _, weights_grad = inputs
    ctx.weights_grad = bool(weights_grad and per_sample_weights is not None)
    ctx.save_for_backward(output[1], anchor, per_sample_weights if ctx.weights_grad else None)


def _backward(ctx, grad, _grad_token):
    token, anchor, per_sample_weights = ctx.saved_tensors
    anchor_grad, weights_grad = sharded_lookup_backward(grad, token, anchor, per_sample_weights)
    return anchor_grad, None, None, (weights_grad if ctx.weights_grad else None), None, None, None


sharded_lookup.register_autograd(_backward, setup_context=_setup)
torch.fx.node.has_side_effect(torch.ops.sparsecomm.sharded_lookup.default)
torch.fx.node.has_side_effect(torch.ops.sparsecomm.sharded_lookup_backward.default)


def lookup(table: Any, ids: Tensor, offsets: Optional[Tensor] = None,
           per_sample_weights: Optional[Tensor] = None) -> Tensor:
    """A sharded table's lookup through the operator (what its ``forward`` does under ``torch.compile``)."""
    grad = torch.is_grad_enabled() and table.local_weight.requires_grad
    weights_grad = bool(grad and per_sample_weights is not None and per_sample_weights.requires_grad)
    anchor = table.compile_anchor if grad else table.compile_anchor.detach()
    out, _ = torch.ops.sparsecomm.sharded_lookup(anchor, ids, offsets, per_sample_weights, table.table_id, grad,
                                                 weights_grad)
    return out
