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

from typing import Any, List, Optional

import torch
import torch.nn as nn

from sparsecomm.hooks.step import StepWork

__all__ = ["sparse_params", "install_unused_table_hook", "queue_cleanup"]


def sparse_params(module: nn.Module) -> List[nn.Parameter]:
    """Weights of the sparse-gradient embeddings of ``module`` that train."""
    return [m.weight for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]


def install_unused_table_hook(module: nn.Module) -> int:
    """Install the forward hook once per module; return how many sparse tables it covers.

    The caller clears the empty gradients of those tables after each step
    (:func:`queue_cleanup`) when there is at least one.
    """
    params = sparse_params(module)
    if params and getattr(module, "_sparsecomm_unused_hook", None) is None:
        module._sparsecomm_unused_hook = module.register_forward_hook(_touch(params))
    return len(params)


def _touch(params: List[nn.Parameter]):
    def hook(mod: nn.Module, inputs: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        target = _first_grad_tensor(output)
        if target is None:
            return output
        zero = sum(nn.functional.embedding(torch.zeros(0, dtype=torch.long, device=p.device), p, sparse=True).sum()
                   for p in params)
        return _replace_first_grad_tensor(output, target + zero.to(target.dtype))

    return hook


def _first_grad_tensor(obj: Any) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad and obj.is_floating_point() else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for x in items:
        t = _first_grad_tensor(x)
        if t is not None:
            return t
    return None


def _replace_first_grad_tensor(obj: Any, new: torch.Tensor) -> Any:
    done = [False]

    def walk(x: Any) -> Any:
        if done[0]:
            return x
        if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_floating_point():
                done[0] = True
                return new
            return x
        if isinstance(x, dict):
            return type(x)((k, walk(v)) for k, v in x.items())
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)


def queue_cleanup(step: StepWork) -> None:
    """Once per backward: after DDP's finalize, set ``.grad = None`` on the tables ``step`` noted empty."""
    if not step.claim_cleanup():
        return
    # DDP queues its finalize (which waits for our futures and assigns the
    # gradients) after the last bucket's hook, i.e. after this callback.
    # Callbacks queued while the engine runs callbacks run after all those
    # already queued, so re-queue once to run after DDP's finalize.
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(lambda: _clear_empty_grads(step)))


def _clear_empty_grads(step: StepWork) -> None:
    for p in step.end_cleanup():
        g = p.grad
        if g is not None and g.is_sparse and g._nnz() == 0:
            p.grad = None
