"""The wire-buffer operators: pack rows into a send buffer, unpack or coalesce rows out of a receive buffer.

Both work on a flat ``uint8`` buffer laid out in segments (one per peer),
so a message is packed and read without staging copies.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from sparsecomm import _C
from sparsecomm._library._common import (INDEX_CODE, VALUE_CODE, WIRE_ID_DTYPE, acc_dtype, check_cuda_ids,
                                         check_no_overlap, dynamic_rows, row_bytes, threads)
from sparsecomm._library._registry import cuda_kernel, custom_op
from sparsecomm._library._rows import coalesce_rows_cuda

__all__ = ["pack_rows_", "unpack_rows_", "coalesce_segments"]


# -------------------------------------------------- packing a send buffer

@custom_op("pack_rows_", mutates_args=("buffer",))
def pack_rows_(buffer: Tensor, src: Tensor, index: Optional[Tensor], segments: List[int],
               wire_id_bytes: int) -> None:
    check_no_overlap(buffer, src, "src")
    _C.pack_rows(src.data_ptr(), src.shape[0], row_bytes(src),
                 0 if index is None else index.data_ptr(), INDEX_CODE[index.dtype] if index is not None else 1,
                 0 if index is None else index.shape[0], segments, buffer.data_ptr(), buffer.numel(), wire_id_bytes,
                 threads(buffer.numel()))


@cuda_kernel("pack_rows_")
def _(buffer: Tensor, src: Tensor, index: Optional[Tensor], segments: List[int], wire_id_bytes: int) -> None:
    check_no_overlap(buffer, src, "src")
    if index is not None:
        check_cuda_ids(index, src.shape[0], "index")
    for s in range(0, len(segments), 3):
        start, count, offset = segments[s:s + 3]
        rows = src[start:start + count] if index is None else src.index_select(0, index[start:start + count])
        if wire_id_bytes:
            dst = buffer[offset:offset + count * wire_id_bytes].view(WIRE_ID_DTYPE[wire_id_bytes])
        else:
            dst = buffer[offset:offset + count * row_bytes(src)].view(src.dtype).view(rows.shape)
        dst.copy_(rows)


@pack_rows_.register_fake
def _(buffer: Tensor, src: Tensor, index: Optional[Tensor], segments: List[int], wire_id_bytes: int) -> None:
    return None


# ------------------------------------------ unpacking a receive buffer

@custom_op("unpack_rows_", mutates_args=("out",))
def unpack_rows_(out: Tensor, buffer: Tensor, segments: List[int]) -> None:
    check_no_overlap(out, buffer, "buffer", "out")
    _C.unpack_rows(buffer.data_ptr(), buffer.numel(), segments, out.data_ptr(), out.shape[0], row_bytes(out),
                   threads(out.numel() * out.element_size()))


@cuda_kernel("unpack_rows_")
def _(out: Tensor, buffer: Tensor, segments: List[int]) -> None:
    check_no_overlap(out, buffer, "buffer", "out")
    rb = row_bytes(out)
    flat = out.view(-1).view(torch.uint8) if out.numel() else out
    for s in range(0, len(segments), 3):
        start, count, offset = segments[s:s + 3]
        if start < 0 or count < 0 or start + count > out.shape[0]:
            raise ValueError(f"sparsecomm: segment {s // 3} writes rows outside the output")
        if offset < 0 or offset + count * rb > buffer.numel():
            raise ValueError(f"sparsecomm: segment {s // 3} reads outside the buffer")
    for s in range(0, len(segments), 3):
        start, count, offset = segments[s:s + 3]
        if count and rb:
            flat[start * rb:(start + count) * rb].copy_(buffer[offset:offset + count * rb])


@unpack_rows_.register_fake
def _(out: Tensor, buffer: Tensor, segments: List[int]) -> None:
    return None


# ------------------------------------------ coalescing out of a receive buffer


@custom_op("coalesce_segments")
def coalesce_segments(buffer: Tensor, segments: List[int], id_bytes: int, value_dtype: torch.dtype, d: int,
                      num_rows: int, out_ids_dtype: torch.dtype, out_acc: bool) -> Tuple[Tensor, Tensor]:
    nseg = len(segments) // 3
    seg = torch.tensor(segments, dtype=torch.int64).view(nseg, 3).t().contiguous()
    esz = value_dtype.itemsize
    plan = _C.coalesce_segments_plan(buffer.data_ptr(), buffer.numel(), nseg, seg[0].data_ptr(), seg[1].data_ptr(),
                                     seg[2].data_ptr(), id_bytes, d * esz, esz, num_rows,
                                     INDEX_CODE[out_ids_dtype], threads(buffer.numel()))
    u = plan.num_unique
    out_ids = torch.empty(u, dtype=out_ids_dtype)
    out_values = torch.empty((u, d), dtype=acc_dtype(value_dtype) if out_acc else value_dtype)
    _C.coalesce_segments_apply(plan, VALUE_CODE[value_dtype], d, out_ids.data_ptr(), out_values.data_ptr(),
                               out_acc, threads(out_values.numel() * out_values.element_size()))
    return out_ids, out_values


@cuda_kernel("coalesce_segments")
def _(buffer: Tensor, segments: List[int], id_bytes: int, value_dtype: torch.dtype, d: int, num_rows: int,
      out_ids_dtype: torch.dtype, out_acc: bool) -> Tuple[Tensor, Tensor]:
    esz = value_dtype.itemsize
    ids, rows = [], []
    for s in range(0, len(segments), 3):
        count, id_off, val_off = segments[s:s + 3]
        ids.append(buffer[id_off:id_off + count * id_bytes].view(WIRE_ID_DTYPE[id_bytes]))
        rows.append(buffer[val_off:val_off + count * d * esz].view(value_dtype).view(count, d))
    ids = torch.cat(ids).to(out_ids_dtype) if ids else buffer.new_empty(0, dtype=out_ids_dtype)
    values = torch.cat(rows) if rows else buffer.new_empty((0, d), dtype=value_dtype)
    if out_acc:
        values = values.to(acc_dtype(value_dtype))
    check_cuda_ids(ids, num_rows)
    return coalesce_rows_cuda(ids, values)


@coalesce_segments.register_fake
def _(buffer: Tensor, segments: List[int], id_bytes: int, value_dtype: torch.dtype, d: int, num_rows: int,
      out_ids_dtype: torch.dtype, out_acc: bool) -> Tuple[Tensor, Tensor]:
    u = dynamic_rows()
    return (buffer.new_empty(u, dtype=out_ids_dtype),
            buffer.new_empty((u, d), dtype=acc_dtype(value_dtype) if out_acc else value_dtype))
