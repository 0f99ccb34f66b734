"""Registering an operator with its CPU and CUDA kernels, and calling an operator (straight into its CPU kernel
when it can).

Each op is declared with :func:`custom_op`: torch's ``torch.library.custom_op``
with the CPU kernel as its body, remembered here so that :func:`call` can run
it without the dispatcher when nothing needs the dispatcher. Its CUDA kernel
is registered with :func:`cuda_kernel`, remembered too, so that tests can run
every CUDA kernel's host code (:func:`cuda_kernels`) on a machine without a GPU.
"""

from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, NamedTuple, Sequence, Tuple, TypeVar

import torch

__all__ = ["custom_op", "cuda_kernel", "call", "op_names", "cuda_kernels"]


class _CpuKernel(NamedTuple):
    fn: Callable[..., Any]
    writes: Tuple[int, ...]  # positions of the arguments the op mutates


_CPU_KERNELS: Dict[str, _CpuKernel] = {}
_CUDA_KERNELS: Dict[str, Callable[..., Any]] = {}

_Kernel = TypeVar("_Kernel", bound=Callable[..., Any])


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


def cuda_kernel(name: str) -> Callable[[_Kernel], _Kernel]:
    """Register the decorated function as the CUDA kernel of op ``sparsecomm::<name>``.

    ``torch.library.register_kernel`` for the ``"cuda"`` device type; the
    function is returned unchanged.

    Args:
        name: the op's name, as given to :func:`custom_op`.
    """
    def register(fn: _Kernel) -> _Kernel:
        torch.library.register_kernel(f"sparsecomm::{name}", "cuda", fn)
        _CUDA_KERNELS[name] = fn
        return fn

    return register


def op_names() -> Tuple[str, ...]:
    """The names of the ops declared so far, in declaration order."""
    return tuple(_CPU_KERNELS)


def cuda_kernels() -> Mapping[str, Callable[..., Any]]:
    """Each op's CUDA kernel (the function :func:`cuda_kernel` registered), by op name; read-only."""
    return MappingProxyType(_CUDA_KERNELS)


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
