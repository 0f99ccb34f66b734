"""The row kernels as PyTorch operators: ``torch.ops.sparsecomm.*``.

Each op has a schema (``torch.library.custom_op``), a CPU kernel (the C++
kernels in ``sparsecomm._C``), a CUDA kernel (its launch of the ``csrc/cuda``
kernels, beside the op, through :mod:`sparsecomm._cuda` and CuPy), a fake
implementation (shapes only, for ``torch.compile`` and meta tensors) and,
where a gradient means something, an autograd formula. The dispatcher picks
the kernel from the tensors' device; a device with neither kernel gets
PyTorch's own "could not run ... with arguments from the ... backend" error.

One module per job: ``_rows`` (coalesce, partition, gather, scatter-add,
row-wise Adagrad), ``_pooled`` (owner pooling's index ops), ``_wire`` (send
and receive buffers); ``_registry`` declares an op with its kernels and calls
it, ``_common`` holds what their kernels share. This package is the only importer of
``sparsecomm._C``'s row kernels.

These ops trust their arguments' types and shapes: :mod:`sparsecomm.ops`
validates, names the bad argument and then calls them. They check what only
real data can tell (ids in range, buffers not overlapping) themselves, so a
compiled graph, which skips the Python checks that need data, stays safe.

Ops (values are 2-D ``(n, d)`` here; ``num_rows < 0`` means no upper bound):

- ``coalesce(ids, values, num_rows) -> (unique_ids, sums)``
- ``coalesce_partition(ids, values, num_rows, num_owners, scheme, range_size, stride)
  -> (counts, ids, sums)``: coalesce, then the rows grouped by owner.
- ``partition(ids, values?, num_rows, num_owners, scheme, range_size, stride)
  -> (counts, ids, values, perm)``: ``values`` is ``(0, 0)`` when none was given.
- ``gather(table, ids) -> rows``
- ``scatter_add_(table!, ids, values)``
- ``pack_rows_(buffer!, src, index?, segments, wire_id_bytes)``: copy rows
  (``src[index[start:start+count]]``) straight into their places in a byte
  buffer, ``segments`` flat ``[start, count, byte_offset] * nseg``.
- ``unpack_rows_(out!, buffer, segments)``: copy ``count`` rows from ``buffer[byte_offset:]``
  into ``out[start:start+count]`` for each segment (reading a receive buffer),
  ``segments`` flat ``[start, count, byte_offset] * nseg``.
- ``coalesce_segments(buffer, segments, id_bytes, value_dtype, d, num_rows, out_ids_dtype, out_acc)
  -> (unique_ids, sums)``: coalesce rows straight out of a receive buffer,
  ``segments`` flat ``[count, id_byte_offset, value_byte_offset] * nseg``.
- ``group_by(index, size) -> (order, offsets)``: a stable counting sort.
- ``bag_groups(key, positions, lengths, size) -> (order, rows, offsets)``: the owner's backward plan of
  pooled lookups (occurrences grouped by ``key[positions]``, with their bags).
- ``unique_inverse(ids, num_rows) -> (unique, inverse)``: ``torch.unique(sorted, return_inverse)``.
- ``pooled_request(ids, bag_of, num_rows, num_owners, scheme, range_size, stride, num_bags)
  -> (unique, unique_counts, order, occ_counts, positions, bag_rows, lengths, bag_counts)``: owner
  pooling's request (``num_bags < 0``: no bound on ``bag_of``).
"""

from sparsecomm._library._common import INDEX_CODE, VALUE_CODE, acc_dtype, check_no_overlap
from sparsecomm._library._pooled import (bag_groups_torch, group_by_torch, pooled_request_torch,
                                         unique_inverse_torch)
from sparsecomm._library._registry import call
from sparsecomm._library._rows import bitmap_ids, bitmap_owns, bitmap_positions, empty_rows, owned_bitmap
from sparsecomm._library import _wire  # noqa: F401  (registers pack_rows_, unpack_rows_ and coalesce_segments)

__all__ = ["INDEX_CODE", "VALUE_CODE", "acc_dtype", "bitmap_ids", "bitmap_owns", "bitmap_positions", "call",
           "check_no_overlap", "empty_rows", "owned_bitmap", "group_by_torch",
           "bag_groups_torch", "unique_inverse_torch", "pooled_request_torch"]
