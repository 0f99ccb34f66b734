"""Typed, validated row kernels: coalesce, partition by owner, gather, scatter-add, packing.

The public face of the operators registered in :mod:`sparsecomm._library`
(``torch.ops.sparsecomm.*``): these functions validate, then call the op, and
PyTorch's dispatcher runs the C++ (OpenMP) kernel for CPU tensors or the CUDA
kernel (CuPy, torch's current stream) for CUDA tensors. Both work under
``torch.compile(fullgraph=True)``: the ops have fake implementations.

Every function checks its arguments and raises ``TypeError`` (wrong type or
dtype) or ``ValueError`` (shape, contiguity, device, out-of-range id) naming the
argument, before touching any output. Only CPU and CUDA tensors are accepted:
a ``meta`` (or any other) tensor has no memory a kernel could read. Values may
be float32, float64, float16 or bfloat16 (fp16/bf16 accumulate in float32 and
round once); ids int32 or int64. Values are ``(n, *row_shape)``: each row is
``prod(row_shape)`` values.

One module per job: ``_rows`` (coalesce, partition, gather, scatter-add,
row-wise Adagrad), ``_pooled`` (owner pooling's index ops), ``_wire`` (send
and receive buffers), ``_validate`` (the argument checks they share); this
package exports each job module's ``__all__``. The
owner map (``scheme``, ``num_rows``, ``range_size``, ``stride``) is
:mod:`sparsecomm.ownership`'s.
"""

from sparsecomm.ops import _pooled, _rows, _wire
from sparsecomm.ops._pooled import *  # noqa: F401,F403
from sparsecomm.ops._rows import *  # noqa: F401,F403
from sparsecomm.ops._validate import INDEX_DTYPES, VALUE_DTYPES, _owner_map  # noqa: F401  (_owner_map: benchmarks)
from sparsecomm.ops._wire import *  # noqa: F401,F403

# Each job module's public names (its __all__): a new op in a module is exported without an edit here.
__all__ = ["INDEX_DTYPES", "VALUE_DTYPES"]
__all__ += _rows.__all__
__all__ += _pooled.__all__
__all__ += _wire.__all__
