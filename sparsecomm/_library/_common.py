"""What every operator's kernels share: dtype codes, thread counts, the CUDA id check, overlap checks."""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

__all__ = ["INDEX_CODE", "VALUE_CODE", "WIRE_ID_DTYPE", "acc_dtype", "threads", "check_cuda_ids", "check_no_overlap",
           "row_bytes", "dynamic_rows"]

# The dtype codes of csrc/common.h (IndexType, ValueType).
INDEX_CODE = {torch.int32: 0, torch.int64: 1}
VALUE_CODE = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
# The dtype of an id on the wire, by its width in bytes.
WIRE_ID_DTYPE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels sum ``dtype`` in: float32 for fp16/bf16."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# Below this many bytes of rows, one thread: starting an OpenMP team costs more than it saves on small
# inputs, and far more when another process holds the other cores.
_PARALLEL_BYTES = 1 << 18


def threads(work_bytes: int) -> int:
    """The threads a CPU kernel gets for ``work_bytes`` of work: torch's thread count, or 1 for small work."""
    return torch.get_num_threads() if work_bytes >= _PARALLEL_BYTES else 1


def check_cuda_ids(ids: Tensor, num_rows: int, name: str = "ids") -> None:
    """Raise ValueError unless every id lies in ``[0, num_rows)`` (``num_rows < 0``: no upper bound).

    The CUDA kernels trust their ids (the C++ kernels check their own): one
    reduction here keeps them in bounds.
    """
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (num_rows >= 0 and hi >= num_rows):
        bad = lo if lo < 0 else hi
        bound = "inf" if num_rows < 0 else str(num_rows)
        raise ValueError(f"sparsecomm: {name} contains id {bad} outside [0, {bound})")


def _byte_span(t: Tensor) -> Tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_no_overlap(table: Tensor, other: Tensor, name: str, written: str = "table") -> None:
    """Raise ValueError if ``other`` shares bytes with ``table`` (both contiguous; ``written``: what the error calls
    ``table``, the tensor the kernel writes)."""
    if table.numel() == 0 or other.numel() == 0:
        return
    (a0, a1), (b0, b1) = _byte_span(table), _byte_span(other)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{name} overlaps {written}'s memory: the kernel would read what it is writing")


def row_bytes(t: Tensor) -> int:
    """Bytes per row of a ``(n, ...)`` tensor."""
    return math.prod(t.shape[1:]) * t.element_size()


def dynamic_rows() -> torch.SymInt:
    """A fake implementation's data-dependent row count (unique ids, say)."""
    return torch.library.get_ctx().new_dynamic_size()
