"""Sparse tables a step does not use: keep them in DDP's graph, and leave their ``.grad`` None afterwards.

DDP fails ("Expected sparse gradient to be defined") when a sparse embedding
gets no gradient in a step, even with ``find_unused_parameters=True``. A
forward hook adds an empty lookup of every sparse table to the output
(exactly 0.0), so every table gets an empty sparse gradient and every rank
takes part in its exchange; after DDP has assigned the synchronized
gradients, tables that no rank touched get ``.grad = None`` again, as in
single-process training (optimizers such as SparseAdam and Adagrad count a
step for an empty gradient but not for none).
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch
import torch.nn as nn

from sparsecomm.collectives.step_order import add_to_output

__all__ = ["sparse_params", "install_unused_table_hook", "clear_empty_grads"]


def sparse_params(module: nn.Module) -> List[nn.Parameter]:
    """Weights of the sparse-gradient embeddings of ``module`` that train."""
    return [m.weight for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]


def install_unused_table_hook(module: nn.Module) -> int:
    """Install the forward hook once per module; return how many sparse tables it covers.

    The caller clears the empty gradients of those tables after each step
    (:func:`clear_empty_grads`) when there is at least one.
    """
    params = sparse_params(module)
    if params and getattr(module, "_sparsecomm_unused_hook", None) is None:
        module._sparsecomm_unused_hook = module.register_forward_hook(_touch(params))
    return len(params)


def _touch(params: List[nn.Parameter]):
    def hook(mod: nn.Module, inputs: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        zero = sum(nn.functional.embedding(torch.zeros(0, dtype=torch.long, device=p.device), p, sparse=True).sum()
                   for p in params)
        return add_to_output(output, zero)

    return hook


def clear_empty_grads(params: Sequence[nn.Parameter]) -> None:
    """After DDP's finalize: ``.grad = None`` on the tables of ``params`` whose synchronized gradient has no row."""
    for p in params:
        g = p.grad
        if g is not None and g.is_sparse and g._nnz() == 0:
            p.grad = None
