"""Argument checks shared by the ops: tensors, sizes, the owner map.

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError``
(shape, contiguity, device, range) naming the argument, before any kernel
runs. Only CPU and CUDA tensors are accepted: a ``meta`` (or any other)
tensor has no memory a kernel could read.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Tuple

import torch

from sparsecomm import ownership

__all__ = ["INDEX_DTYPES", "VALUE_DTYPES", "check_device", "check_ids", "check_values", "check_size",
           "check_num_rows", "row_width", "check_int64_ids", "owner_map"]

INDEX_DTYPES = (torch.int32, torch.int64)
VALUE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

_KERNEL_DEVICES = ("cpu", "cuda")


def check_device(t: torch.Tensor, name: str) -> None:
    """Refuse a tensor on a device without kernels (ValueError naming ``name``)."""
    # The kernels read and write raw pointers: a meta tensor's is null.
    if t.device.type not in _KERNEL_DEVICES:
        raise ValueError(f"{name} is on {t.device}: sparsecomm kernels take CPU or CUDA tensors")


def check_ids(ids, name: str = "ids") -> None:
    """``ids`` must be a contiguous 1-D int32/int64 tensor on a kernel device."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    check_device(ids, name)
    if ids.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if not ids.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_values(values, name: str, rows: Optional[int], device: torch.device) -> None:
    """``values`` must be a contiguous dense float tensor of ``rows`` rows (any, if None) on ``device``."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    check_device(values, name)
    if values.dtype not in VALUE_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {values.dtype}")
    if values.dim() < 1:
        raise ValueError(f"{name} must have a leading row dimension, got a scalar")
    if rows is not None and values.shape[0] != rows:
        raise ValueError(f"{name} has {values.shape[0]} rows but ids has {rows}")
    if values.is_sparse or values.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor")
    if not values.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if values.device != device:
        raise ValueError(f"{name} is on {values.device} but ids is on {device}")


def check_size(value, name: str) -> int:
    """``value`` as an int >= 0 (TypeError / ValueError naming ``name`` otherwise)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def check_num_rows(num_rows) -> int:
    """``num_rows`` as the kernels take it: a bound >= 0, or -1 for "no upper bound" (None)."""
    # The kernels read a negative bound as "none": a negative one must never get there.
    return -1 if num_rows is None else check_size(num_rows, "num_rows")


def row_width(values: torch.Tensor) -> int:
    """Values per row of a ``(n, *row_shape)`` tensor."""
    return math.prod(values.shape[1:])


def check_int64_ids(ids, name: str) -> None:
    """:func:`check_ids`, and int64 only (the pooled kernels' ids, positions and lengths)."""
    check_ids(ids, name)
    if ids.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {ids.dtype}")


def owner_map(num_owners: int, scheme: str, num_rows: Optional[int], range_size: Optional[int],
              stride: int, owner: Optional[int] = None) -> ownership.OwnerMap:
    """The owner map the ops' ``num_owners, scheme, num_rows, range_size, stride, owner`` name (ValueError otherwise)."""
    return ownership.OwnerMap.of(num_owners, scheme, num_rows, range_size, stride, owner)


def _owner_map(num_owners: int, scheme: str, num_rows: Optional[int], range_size: Optional[int],
               stride: int) -> Tuple[int, int]:
    """``(scheme code, range_size)`` of :func:`owner_map` (the benchmarks' spelling)."""
    m = owner_map(num_owners, scheme, num_rows, range_size, stride)
    return m.scheme, m.range_size
