"""Requester-side pooling of a bag lookup's unique rows (sum/mean), with a backward that sums per row.

On the rows path the round returns each unique row once; a sum/mean bag
lookup whose per-sample weights need no gradient pools them here
(:func:`pool_rows`) instead of through ``F.embedding_bag``, for its backward.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

from sparsecomm import ops
from sparsecomm.sharded.pending import Bags

__all__ = ["pool_rows"]


class _PoolRows(torch.autograd.Function):
    """Sum/mean bags of a round's unique rows; backward sums each row's bag gradients as one embedding_bag.

    torch's dense ``embedding_bag`` backward (what the rows would otherwise
    get) sorts and reduces per element; this one sorts the occurrences by
    row and sums each row's bag gradients, which stay in cache, with one
    ``embedding_bag``: the same sums, in less time. The backward times itself
    (``bags.backward_seconds``) for ``owner_pooling="auto"``.
    """
    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor, bags: Bags, pad: Optional[int]) -> torch.Tensor:
        lengths = bags.lengths
        out = F.embedding_bag(inverse, rows, torch.cumsum(lengths, 0) - lengths, mode=bags.mode,
                              per_sample_weights=bags.weights, padding_idx=pad)
        ctx.save_for_backward(inverse)
        ctx.bags, ctx.pad, ctx.num_rows = bags, pad, rows.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = time.perf_counter()
        (inverse,) = ctx.saved_tensors
        bags = ctx.bags
        bag_of = bags.bag_of(inverse.numel())
        keep = inverse != ctx.pad if ctx.pad is not None else None
        weights = bags.weights
        if keep is not None and not bool(keep.all()):
            inverse, bag_of = inverse[keep], bag_of[keep]
            weights = weights[keep] if weights is not None else None
        grad = grad.contiguous()
        if bags.mode == "mean":
            counts = bags.counts(bag_of)
            grad = grad / counts.clamp(min=1).to(grad.dtype).unsqueeze(1)
        # Occurrences sorted by row (stable) and where each row's start: one embedding_bag sums each row's
        # bag gradients in input order.
        order, offsets = ops.group_by(inverse, ctx.num_rows)
        rows_grad = F.embedding_bag(bag_of[order], grad, offsets, mode="sum",
                                    per_sample_weights=weights[order] if weights is not None else None)
        bags.backward_seconds = time.perf_counter() - start
        return rows_grad, None, None, None


def pool_rows(rows: torch.Tensor, inverse: torch.Tensor, bags: Bags, pad: Optional[int]) -> torch.Tensor:
    """``embedding_bag`` (sum/mean, weights without gradient) of the round's unique ``rows`` at ``inverse``."""
    return _PoolRows.apply(rows, inverse.reshape(-1), bags, pad)

