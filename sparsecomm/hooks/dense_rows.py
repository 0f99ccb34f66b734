"""Embeddings trained with dense gradients (``sparse=False``): find them in a bucket, send only their non-zero rows."""

from __future__ import annotations

import logging
from typing import Dict, List, Protocol, Tuple

import torch
import torch.distributed as dist

__all__ = ["NamedParams", "dense_embedding_slices", "nonzero_rows", "write_rows"]

logger = logging.getLogger("sparsecomm")


class NamedParams(Protocol):
    """What this module reads of the hook's state (:class:`~sparsecomm.hooks.state.SparseCommState`)."""

    param_names: Dict[int, str]                       # tensor address -> parameter name
    dense_embedding_names: Dict[str, Tuple[int, int]]  # dense-gradient embedding weight -> its shape

    @property
    def sparse_dense_embeddings(self) -> bool: ...

    def hint_once(self, name: str) -> bool: ...


def param_name(state: NamedParams, p: torch.Tensor, bucket: dist.GradBucket, i: int) -> str:
    """The parameter's name in the model, or a stable stand-in (same on every rank)."""
    return state.param_names.get(p.data_ptr(), f"bucket{bucket.index()}.param{i}")


def dense_embedding_slices(state: NamedParams, bucket: dist.GradBucket, buffer: torch.Tensor
                           ) -> List[Tuple[str, int, int, int]]:
    """(name, offset, rows, dim) of dense-gradient embedding weights in this bucket, by offset.

    Empty unless ``sparse_dense_embeddings``; without it, the first step logs
    a hint for embeddings whose gradient is mostly zero rows.
    """
    if not state.dense_embedding_names:
        return []
    out = []
    base = buffer.data_ptr()
    for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
        name = param_name(state, p, bucket, i)
        if name not in state.dense_embedding_names or p.dim() != 2:
            continue
        offset = (g.data_ptr() - base) // buffer.element_size()
        if not state.sparse_dense_embeddings:
            _suggest_sparse_rows(state, name, buffer[offset:offset + p.numel()].view(p.shape))
            continue
        out.append((name, offset, p.shape[0], p.shape[1]))
    return sorted(out, key=lambda t: t[1])


def nonzero_rows(table: torch.Tensor) -> torch.Tensor:
    """The rows of a dense ``(V, d)`` gradient that are not all zero, as a coalesced sparse tensor (exact)."""
    ids = (table != 0).any(dim=1).nonzero().view(-1)
    return torch.sparse_coo_tensor(ids[None], table.index_select(0, ids), tuple(table.shape), is_coalesced=True,
                                   check_invariants=False)


def write_rows(table: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    """Write the synchronized rows back into the dense gradient (zero elsewhere)."""
    table.zero_()
    table.index_copy_(0, reduced._indices()[0], reduced._values())
    return table


def _suggest_sparse_rows(state: NamedParams, name: str, grad: torch.Tensor) -> None:
    # Detection only (a table's first step): most rows zero means the sparse path would move far fewer bytes.
    if not state.hint_once(name):
        return
    touched = float((grad != 0).any(dim=1).float().mean())
    if touched < 0.1:
        logger.info("sparsecomm: %s has dense gradients but only %.2f%% of its rows are non-zero; "
                    "SparseCommState(sparse_dense_embeddings=True) sends only those rows (exact)",
                    name, 100 * touched)
