"""CUDA implementations of the row kernels, compiled at run time through CuPy.

The kernels live as CUDA C++ source in ``csrc/cuda/*.cu``, with the owner map
they share with the C++ kernels in ``csrc/owner_map.h`` (both installed into the
wheel as ``sparsecomm/cuda_src/``). On first use on a device, CuPy compiles a
file with NVRTC (and caches the binary on disk), so the package itself builds
without a CUDA toolkit. Every launch goes on torch's current stream, and every
output is allocated by torch, so the ops compose with the rest of a PyTorch
program like native ones.

Sorting and run-finding use torch (``torch.sort(stable=True)``,
``torch.unique_consecutive``, ``torch.cumsum``); the kernels do the fused
parts: segment sums, owner mapping with its histogram, and row copies.

This module is the CUDA half of :mod:`sparsecomm.ops`, which validates every
input (contiguous, one device, supported dtypes, ids in range) before calling
in; the functions here do not repeat those checks. CuPy is imported on the
first call, never at import time, so CPU-only installs do not need it.
"""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy
import torch
from torch import Tensor

from sparsecomm import ownership
from sparsecomm.types import PartitionScheme

__all__ = [
    "coalesce_rows",
    "partition_rows",
    "gather_rows",
    "scatter_add_rows",
    "find_source_dir",
    "include_dirs",
    "load_source",
    "KERNELS",
    "NVRTC_OPTIONS",
]

# ---- kernel catalogue -----------------------------------------------------------
# The .cu files generate one extern "C" entry point per dtype combination with
# SPARSECOMM_ macros; these tables name them. tests/test_cuda_compile.py checks
# that the compiled PTX defines exactly these names, so the two cannot drift.

_VALUE_SUFFIX = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}
_ID_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}
# gather copies bytes, not values: kernels are typed by copy unit (bytes).
_UNIT_SUFFIX = {16: "u128", 8: "u64", 4: "u32", 2: "u16", 1: "u8"}

KERNELS: Dict[str, Tuple[str, ...]] = {
    "coalesce.cu": tuple(f"sparsecomm_coalesce_rows_{v}" for v in _VALUE_SUFFIX.values()),
    "scatter_add.cu": tuple(
        f"sparsecomm_scatter_add_rows_{v}_{i}"
        for v in _VALUE_SUFFIX.values()
        for i in _ID_SUFFIX.values()
    ),
    "partition.cu": tuple(f"sparsecomm_partition_owners_{i}" for i in _ID_SUFFIX.values()),
    "gather.cu": tuple(
        f"sparsecomm_gather_rows_{u}_{i}"
        for u in _UNIT_SUFFIX.values()
        for i in _ID_SUFFIX.values()
    ),
}
"""Every kernel the loader may launch, by the source file that defines it."""

NVRTC_OPTIONS: Tuple[str, ...] = ("--std=c++14",)
"""Options for NVRTC; CuPy adds ``-arch`` for the current device itself."""

_BLOCK = 256
# Grid-stride kernels: more blocks than this per SM only adds scheduling cost.
_BLOCKS_PER_SM = 32
# partition_owners counts in shared memory (8 bytes a bin) up to this many
# owners; beyond it, straight into global memory.
_MAX_BLOCK_BINS = 4096

# ---- finding and loading the sources --------------------------------------------

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def _source_layouts() -> Tuple[Tuple[Path, Tuple[Path, ...]], ...]:
    """Where the sources may be: (folder of the ``.cu`` files, folders their includes are looked up in)."""
    package = Path(__file__).resolve().parent
    installed = package / "cuda_src"  # the wheel copies csrc/owner_map.h in beside the .cu files
    checkout = package.parent / "csrc"
    return ((installed, (installed,)), (checkout / "cuda", (checkout / "cuda", checkout)))


def _source_layout() -> Tuple[Path, Tuple[Path, ...]]:
    layouts = _source_layouts()
    for folder, includes in layouts:
        if folder.is_dir() and any(folder.glob("*.cu")):
            return folder, includes
    searched = ", ".join(str(folder) for folder, _ in layouts)
    raise FileNotFoundError(
        f"sparsecomm: CUDA kernel sources not found (searched {searched}); "
        "reinstall sparsecomm or run from a source checkout"
    )


def find_source_dir() -> Path:
    """Return the folder that holds the CUDA kernel sources.

    An installed wheel carries them as package data in ``sparsecomm/cuda_src``;
    a source checkout (editable install) has them in ``csrc/cuda``.

    Returns:
        The first of ``<package>/cuda_src`` and ``<repo>/csrc/cuda`` that holds
        ``.cu`` files.

    Raises:
        FileNotFoundError: Neither folder holds any ``.cu`` file.
    """
    return _source_layout()[0]


def include_dirs() -> Tuple[Path, ...]:
    """Return the folders a kernel source's ``#include "..."`` is looked up in, in order.

    The source folder first; in a source checkout also ``csrc/``, which holds
    ``owner_map.h``, the owner map the CUDA and the C++ kernels share (an
    installed wheel has its copy beside the ``.cu`` files).

    Raises:
        FileNotFoundError: No folder holds the kernel sources.
    """
    return _source_layout()[1]


@functools.lru_cache(maxsize=None)
def load_source(name: str) -> str:
    """Return the source of one kernel file with its local includes inlined.

    NVRTC gets a single self-contained string: no include path to pass, and
    CuPy's on-disk kernel cache (keyed by the source text) notices an edit to
    a shared header too. ``#line`` directives keep compiler messages pointing
    at the original files.

    Args:
        name: File name inside the source folder, e.g. ``"gather.cu"``.

    Returns:
        The preprocessed source text.

    Raises:
        FileNotFoundError: The file, or a file it includes, does not exist.
    """
    return _inline_includes(include_dirs(), name, set())


def _find_include(folders: Tuple[Path, ...], name: str) -> Path:
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"sparsecomm: CUDA source {name!r} not found in {', '.join(map(str, folders))}")


def _inline_includes(folders: Tuple[Path, ...], name: str, seen: set) -> str:
    if name in seen:  # include guards make a second copy empty anyway
        return ""
    seen.add(name)
    lines = _find_include(folders, name).read_text(encoding="utf-8").splitlines()
    out = [f'#line 1 "{name}"']
    for lineno, line in enumerate(lines, start=1):
        match = _LOCAL_INCLUDE.match(line)
        if match is None:
            out.append(line)
            continue
        out.append(_inline_includes(folders, match.group(1), seen))
        out.append(f'#line {lineno + 1} "{name}"')
    return "\n".join(out) + "\n"


# ---- CuPy plumbing --------------------------------------------------------------

_lock = threading.Lock()
_modules: Dict[Tuple[int, str], Any] = {}
_functions: Dict[Tuple[int, str], Any] = {}


def _cupy() -> Any:
    """Import CuPy on first use, with an install hint when it is missing."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            "sparsecomm needs CuPy to run its kernels on CUDA tensors: "
            "pip install sparsecomm[gpu] (CUDA 12: pip install cupy-cuda12x; "
            "CUDA 13: pip install cupy-cuda13x)"
        ) from exc
    return cupy


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _function(cupy: Any, device: int, name: str) -> Any:
    """Return kernel ``name`` compiled for ``device`` (caller holds its context)."""
    key = (device, name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    file = next(f for f, names in KERNELS.items() if name in names)
    with _lock:
        module = _modules.get((device, file))
        if module is None:
            module = cupy.RawModule(code=load_source(file), options=NVRTC_OPTIONS)
            _modules[(device, file)] = module
        fn = module.get_function(name)
        _functions[key] = fn
    return fn


@functools.lru_cache(maxsize=None)
def _max_blocks(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count * _BLOCKS_PER_SM


def _launch(
    device: torch.device,
    name: str,
    total: int,
    args: Sequence[Any],
    shared_mem: int = 0,
) -> None:
    """Launch grid-stride kernel ``name`` over ``total`` elements on torch's stream.

    Args:
        device: The CUDA device the tensors in ``args`` live on.
        name: One of the names in :data:`KERNELS`.
        total: Number of elements the kernel covers; nothing runs when 0 (a
            zero-sized grid is a launch error).
        args: Kernel arguments, already as CuPy/NumPy scalars.
        shared_mem: Dynamic shared memory per block, in bytes.
    """
    if total <= 0:
        return
    cupy = _cupy()
    index = _device_index(device)
    blocks = min(-(-total // _BLOCK), _max_blocks(index))
    with cupy.cuda.Device(index):
        fn = _function(cupy, index, name)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream)
        with stream:
            fn((blocks,), (_BLOCK,), tuple(args), shared_mem=shared_mem)


# Kernel arguments travel as fixed-width NumPy scalars: CuPy passes a plain
# Python int as int64, which would silently mismatch an `int` parameter.
def _ptr(tensor: Tensor) -> Any:
    return numpy.uint64(tensor.data_ptr())


def _i64(value: int) -> Any:
    return numpy.int64(value)


def _i32(value: int) -> Any:
    return numpy.int32(value)


def _group_rows(ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Group positions by id: (order, group start offsets, group ids ascending).

    ``ids[order]`` is sorted and stable, so within a group ``order`` lists the
    input positions in input order: what makes the segment sums deterministic.
    """
    sorted_ids, order = torch.sort(ids, stable=True)
    group_ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    seg_start = torch.zeros(group_ids.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=seg_start[1:])
    return order, seg_start, group_ids


# ---- the four ops ---------------------------------------------------------------


def coalesce_rows(ids: Tensor, values: Tensor) -> Tuple[Tensor, Tensor]:
    """Sum the value rows of equal ids, on the GPU.

    Args:
        ids: ``(n,)`` int32 or int64 row ids, ``n`` may be 0.
        values: ``(n, d)`` float32/float64/float16/bfloat16 rows, ``d >= 1``.

    Returns:
        ``(unique_ids, sums)``: the distinct ids ascending (dtype of ``ids``)
        and ``(u, d)`` row sums (dtype of ``values``). Each sum adds its rows
        in input order (fp16/bf16 in float32, rounded once), so results are
        deterministic and bitwise equal to the CPU kernel.
    """
    d = values.shape[1]
    if ids.numel() == 0:
        return ids.new_empty(0), values.new_empty((0, d))
    order, seg_start, group_ids = _group_rows(ids)
    num_groups = group_ids.numel()
    out = values.new_empty((num_groups, d))
    _launch(
        values.device,
        f"sparsecomm_coalesce_rows_{_VALUE_SUFFIX[values.dtype]}",
        num_groups * d,
        (_ptr(values), _ptr(order), _ptr(seg_start), _i64(num_groups), _i64(d), _ptr(out)),
    )
    return group_ids, out


def partition_rows(
    ids: Tensor,
    values: Optional[Tensor],
    num_owners: int,
    scheme: int,
    range_size: int,
    stride: int,
) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """Reorder rows so that each owner's rows are contiguous, on the GPU.

    ``owner(id) = (bucket(id) // stride) % num_owners`` where ``bucket`` is
    splitmix64(id) for the hash scheme or ``id // range_size`` for the range
    scheme: ``csrc/owner_map.h``, the map the CPU kernel evaluates too.

    Args:
        ids: ``(n,)`` int32 or int64 non-negative row ids.
        values: ``(n, d)`` rows that travel with the ids, or None.
        num_owners: Number of owners (ranks), >= 1.
        scheme: The scheme's code (:func:`sparsecomm.ownership.scheme_code`).
        range_size: Ids per range (range scheme only), >= 1.
        stride: Consecutive buckets that map to one owner, >= 1.

    Returns:
        ``(counts, ids_out, values_out, perm)``: ``(num_owners,)`` int64 rows
        per owner; ids grouped by owner in owner order, stable inside an owner;
        values permuted the same way (None if ``values`` is None); ``(n,)``
        int64 ``perm`` with ``ids_out == ids[perm]``.

    Raises:
        ValueError: An owner-map parameter is out of range.
    """
    ownership.OwnerMap(num_owners, scheme, range_size, stride).check()
    if num_owners > 2**31 - 1:  # owners are written as int32
        raise ValueError(f"sparsecomm: num_owners must be in [1, 2**31), got {num_owners}")
    is_range = ownership.scheme_from_code(scheme) is PartitionScheme.RANGE
    n = ids.numel()
    counts = torch.zeros(num_owners, dtype=torch.int64, device=ids.device)
    if n == 0:
        empty_values = None if values is None else values.new_empty((0, values.shape[1]))
        perm = torch.empty(0, dtype=torch.int64, device=ids.device)
        return counts, ids.new_empty(0), empty_values, perm
    owners = torch.empty(n, dtype=torch.int32, device=ids.device)
    block_bins = num_owners <= _MAX_BLOCK_BINS
    _launch(
        ids.device,
        f"sparsecomm_partition_owners_{_ID_SUFFIX[ids.dtype]}",
        n,
        (
            _ptr(ids),
            _i64(n),
            _i32(scheme),
            _i64(num_owners),
            # Unused by the hash scheme; 1 keeps the argument meaningful.
            _i64(range_size if is_range else 1),
            _i64(stride),
            _ptr(owners),
            _ptr(counts),
            _i32(int(block_bins)),
        ),
        shared_mem=8 * num_owners if block_bins else 0,
    )
    # A stable sort of the owner ranks is the stable counting sort we need.
    perm = torch.sort(owners, stable=True).indices
    ids_out = gather_rows(ids.view(n, 1), perm).view(n)
    values_out = None if values is None else gather_rows(values, perm)
    return counts, ids_out, values_out, perm


def gather_rows(table: Tensor, ids: Tensor) -> Tensor:
    """Copy the rows ``table[ids]`` into a new tensor, on the GPU.

    Args:
        table: ``(V, d)`` contiguous rows of any dtype.
        ids: ``(n,)`` int32 or int64 ids in ``[0, V)``.

    Returns:
        ``(n, d)`` tensor of the dtype of ``table`` with ``out[i] = table[ids[i]]``.
    """
    n = ids.numel()
    num_rows, d = table.shape
    out = table.new_empty((n, d))
    row_bytes = d * table.element_size()
    if n == 0 or row_bytes == 0:
        return out
    # Widest copy unit that divides the row and keeps both sides aligned.
    unit = next(
        w
        for w in _UNIT_SUFFIX
        if row_bytes % w == 0 and table.data_ptr() % w == 0 and out.data_ptr() % w == 0
    )
    row_units = row_bytes // unit
    _launch(
        table.device,
        f"sparsecomm_gather_rows_{_UNIT_SUFFIX[unit]}_{_ID_SUFFIX[ids.dtype]}",
        n * row_units,
        (_ptr(table), _i64(num_rows), _ptr(ids), _i64(n), _i64(row_units), _ptr(out)),
    )
    return out


def scatter_add_rows(table: Tensor, ids: Tensor, values: Tensor) -> Tensor:
    """Add ``values[i]`` into ``table[ids[i]]`` in place, on the GPU.

    Duplicate ids are allowed. Each touched table row becomes its old value
    plus its updates summed in input order (fp16/bf16 in float32, rounded
    once), without atomics: deterministic and bitwise equal to the CPU kernel.

    Args:
        table: ``(V, d)`` float32/float64/float16/bfloat16 table, updated in place.
        ids: ``(n,)`` int32 or int64 ids in ``[0, V)``.
        values: ``(n, d)`` rows of the dtype of ``table``.

    Returns:
        ``table``.
    """
    if ids.numel() == 0:
        return table
    num_rows, d = table.shape
    order, seg_start, group_ids = _group_rows(ids)
    num_groups = group_ids.numel()
    _launch(
        table.device,
        f"sparsecomm_scatter_add_rows_{_VALUE_SUFFIX[table.dtype]}_{_ID_SUFFIX[ids.dtype]}",
        num_groups * d,
        (
            _ptr(table),
            _i64(num_rows),
            _ptr(group_ids),
            _ptr(values),
            _ptr(order),
            _ptr(seg_start),
            _i64(num_groups),
            _i64(d),
        ),
    )
    return table
