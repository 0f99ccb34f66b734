"""The wire-buffer ops: pack rows into a send buffer, unpack or coalesce rows out of a receive buffer.

A buffer is a flat ``uint8`` tensor laid out in segments (one per peer);
these ops read and write the segments in place, so a message is packed and
read without staging copies.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from sparsecomm import _library
from sparsecomm.ops._validate import INDEX_DTYPES, VALUE_DTYPES, check_device, check_ids, check_num_rows, row_width

__all__ = ["pack_rows", "unpack_rows", "coalesce_segments"]

# Bytes of an id on the wire, by its dtype.
_WIRE_ID_BYTES = {torch.int16: 2, torch.int32: 4, torch.int64: 8}


def _check_buffer(buffer, name: str) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buffer).__name__}")
    check_device(buffer, name)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")


def _check_rows(rows, buffer: torch.Tensor, name: str) -> None:
    """``rows`` (what is packed into or unpacked out of ``buffer``): a contiguous tensor of rows beside it."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(rows).__name__}")
    check_device(rows, name)
    if rows.device != buffer.device:
        raise ValueError(f"{name} is on {rows.device} but buffer is on {buffer.device}")
    if not rows.is_contiguous() or rows.dim() < 1:
        raise ValueError(f"{name} must be contiguous with a leading row dimension")


def _triples(segments: Sequence[Tuple[int, int, int]]) -> List[int]:
    """``(start, count, byte_offset)`` segments as the flat list the ops take."""
    flat = [int(v) for seg in segments for v in seg]
    if len(flat) != 3 * len(segments):
        raise ValueError("segments must be (start, count, byte_offset) triples")
    return flat


def _wire_id_bytes(dtype: torch.dtype, name: str) -> int:
    if dtype not in _WIRE_ID_BYTES:
        raise TypeError(f"{name} must be int16, int32 or int64, got {dtype}")
    return _WIRE_ID_BYTES[dtype]


def pack_rows(buffer: torch.Tensor, src: torch.Tensor, index: Optional[torch.Tensor],
              segments: Sequence[Tuple[int, int, int]], wire_ids: Optional[torch.dtype] = None) -> None:
    """Copy rows of ``src`` straight into their places in a byte buffer (one copy, no staging).

    Segment ``(start, count, offset)`` copies rows ``index[start:start+count]``
    of ``src`` (rows ``start:start+count`` when ``index`` is None) back to back
    to ``buffer[offset:]``. This is how a send buffer is packed: a partition's
    ``perm`` as ``index`` and one segment per peer packs partitioned rows
    without materializing them first.

    Args:
        buffer: 1-D uint8 destination, same device as ``src``.
        src: ``(n, *row_shape)`` rows of any dtype, or ``(n,)`` int32/int64 ids
            when ``wire_ids`` is given.
        index: optional ``(m,)`` int32/int64 rows of ``src`` in ``[0, n)``.
        segments: ``(start, count, byte_offset)`` triples.
        wire_ids: write ids as this dtype (int16/int32/int64); each must fit.

    Raises:
        TypeError, ValueError: bad arguments, an index or id out of range, or a
            segment outside ``src``/``index`` or ``buffer`` (nothing is written).
    """
    _check_buffer(buffer, "buffer")
    _check_rows(src, buffer, "src")
    if index is not None:
        check_ids(index, "index")
        if index.device != buffer.device:
            raise ValueError(f"index is on {index.device} but buffer is on {buffer.device}")
    wire = 0
    if wire_ids is not None:
        if src.dtype not in INDEX_DTYPES or src.dim() != 1:
            raise TypeError(f"with wire_ids, src must be 1-D int32/int64 ids, got {src.dtype} {tuple(src.shape)}")
        wire = _wire_id_bytes(wire_ids, "wire_ids")
    flat = _triples(segments)
    rows = src if src.dim() == 1 else src.reshape(src.shape[0], row_width(src))
    _library.call("pack_rows_", buffer, rows, index, flat, wire)


def unpack_rows(out: torch.Tensor, buffer: torch.Tensor, segments: Sequence[Tuple[int, int, int]]) -> None:
    """Copy rows out of their places in a byte buffer into ``out`` (the inverse of :func:`pack_rows`).

    Segment ``(start, count, offset)`` copies ``count`` rows, back to back at
    ``buffer[offset:]``, into ``out[start:start+count]``. This is how a
    receive buffer is read: one segment per peer fills one tensor with every
    peer's rows in one call, where slicing and copying per peer costs several
    torch calls each.

    Args:
        out: ``(n, *row_shape)`` contiguous rows of any dtype (a row of a 1-D
            ``out`` is one element), same device as ``buffer``.
        buffer: 1-D uint8 source; it must not overlap ``out``.
        segments: ``(start, count, byte_offset)`` triples.

    Raises:
        TypeError, ValueError: bad arguments, or a segment outside ``out`` or
            ``buffer`` (nothing is written).
    """
    _check_buffer(buffer, "buffer")
    _check_rows(out, buffer, "out")
    _library.call("unpack_rows_", out, buffer, _triples(segments))


def coalesce_segments(buffer: torch.Tensor, segments: Sequence[Tuple[int, int, int]], wire_ids: torch.dtype,
                      value_dtype: torch.dtype, row_shape: Sequence[int], num_rows: Optional[int] = None, *,
                      ids_dtype: torch.dtype = torch.int64, accumulate_dtype: bool = False
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Coalesce rows straight out of a byte buffer holding several segments (a receive buffer).

    Segment ``(count, id_offset, value_offset)`` holds ``count`` ids of
    ``wire_ids`` at byte ``id_offset`` and their value rows at byte
    ``value_offset``. The result is :func:`coalesce_rows` of all segments'
    rows concatenated in order (summed in that order, so deterministic),
    without first copying them out of the buffer.

    Args:
        buffer: 1-D uint8 tensor; every segment must lie inside it, aligned to
            its element size.
        segments: ``(count, id_byte_offset, value_byte_offset)`` triples.
        wire_ids: dtype of the ids in the buffer: int16, int32 or int64.
        value_dtype: dtype of the value rows (one of :data:`VALUE_DTYPES`).
        row_shape: shape of one value row.
        num_rows: ids must lie in ``[0, num_rows)`` (checked: they came from peers).
        ids_dtype: dtype of the returned ids (int32 or int64).
        accumulate_dtype: return the sums in float32 for fp16/bf16 rows (not
            rounded), for a caller that divides before rounding.

    Returns:
        ``(unique_ids, sums)`` as for :func:`coalesce_rows`.

    Raises:
        TypeError, ValueError: bad arguments, a segment outside the buffer or
            misaligned, or an id out of range.
    """
    _check_buffer(buffer, "buffer")
    id_bytes = _wire_id_bytes(wire_ids, "wire_ids")
    if value_dtype not in VALUE_DTYPES:
        raise TypeError(f"value_dtype must be float32, float64, float16 or bfloat16, got {value_dtype}")
    if ids_dtype not in INDEX_DTYPES:
        raise TypeError(f"ids_dtype must be int32 or int64, got {ids_dtype}")
    bound = check_num_rows(num_rows)
    flat = [int(v) for seg in segments for v in seg]
    if len(flat) != 3 * len(segments):
        raise ValueError("segments must be (count, id_byte_offset, value_byte_offset) triples")
    d = math.prod(row_shape)
    ids, sums = _library.call("coalesce_segments", buffer, flat, id_bytes, value_dtype, d, bound, ids_dtype,
                                                       bool(accumulate_dtype))
    return ids, sums.view((ids.shape[0], *row_shape))
