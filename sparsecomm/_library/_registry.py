"""Registering an operator with its CPU kernel, and calling an operator (straight into that kernel when it can).

Each op is declared with :func:`custom_op`: torch's ``torch.library.custom_op``
with the CPU kernel as its body, remembered here so that :func:`call` can run
it without the dispatcher when nothing needs the dispatcher.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, NamedTuple, Sequence, Tuple

import torch

__all__ = ["custom_op", "call"]


class _CpuKernel(NamedTuple):
    fn: Callable[..., Any]
    writes: Tuple[int, ...]  # positions of the arguments the op mutates


_CPU_KERNELS: Dict[str, _CpuKernel] = {}


def custom_op(name: str, mutates_args: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Any]:
    """Declare op ``sparsecomm::<name>`` with the decorated function as its CPU kernel.

    The schema comes from the function's annotations, as for
    ``torch.library.custom_op``; the CUDA kernel, the fake and the autograd
    formula are registered on the returned op.

    Args:
        name: the op's name in ``torch.ops.sparsecomm``.
        mutates_args: the names of the arguments the op writes.
    """
    def register(fn: Callable[..., Any]) -> Any:
        params = list(inspect.signature(fn).parameters)
        _CPU_KERNELS[name] = _CpuKernel(fn, tuple(params.index(a) for a in mutates_args))
        return torch.library.custom_op(f"sparsecomm::{name}", mutates_args=tuple(mutates_args),
                                       device_types="cpu")(fn)

    return register


def call(name: str, *args: Any) -> Any:
    """Run op ``name``: straight into its CPU kernel when nothing needs the dispatcher.

    The dispatcher's Python layers cost more than the kernel itself on the small
    inputs a training step passes many times, so plain CPU tensors outside
    ``torch.compile`` and outside autograd call the kernel directly; compiling,
    autograd, CUDA, fake or other tensors go through
    ``torch.ops.sparsecomm.<name>``. An op that writes a tensor bumps its
    version counter either way, as torch's in-place ops do.
    """
    if not torch.compiler.is_compiling():
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        grad = torch.is_grad_enabled()
        if all(type(t) is torch.Tensor and t.device.type == "cpu" and not (grad and t.requires_grad)
               for t in tensors):
            kernel = _CPU_KERNELS[name]
            out = kernel.fn(*args)
            for i in kernel.writes:
                torch.autograd.graph.increment_version(args[i])
            return out
    return getattr(torch.ops.sparsecomm, name)(*args)
