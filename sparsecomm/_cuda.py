"""The CUDA side's machinery: the kernel sources, the kernel table, and launching through CuPy.

The kernels live as CUDA C++ source in ``csrc/cuda/*.cu``, with the owner map
they share with the C++ kernels in ``csrc/owner_map.h`` (both installed into the
wheel as ``sparsecomm/cuda_src/``). On first use on a device, CuPy compiles a
file with NVRTC (and caches the binary on disk), so the package itself builds
without a CUDA toolkit. Every launch goes on torch's current stream, and every
output is allocated by torch, so the ops compose with the rest of a PyTorch
program like native ones.

This module names no op. The table of kernels (:data:`KERNELS`, file -> entry
points) is read from the sources themselves, so a new ``.cu`` file needs no
edit here; each op's launch (its kernel's name, grid size and arguments) lives
with its operator in :mod:`sparsecomm._library`, which validates every input
before calling in. CuPy is imported on the first launch, never at import time,
so CPU-only installs do not need it.
"""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

import numpy
import torch
from torch import Tensor

__all__ = [
    "KERNELS",
    "NVRTC_OPTIONS",
    "BLOCK",
    "VALUE_SUFFIX",
    "ID_SUFFIX",
    "find_source_dir",
    "include_dirs",
    "load_source",
    "kernel_declarations",
    "kernel_table",
    "grid_size",
    "launch",
    "ptr",
    "i64",
    "i32",
]

# The .cu files generate one extern "C" entry point per dtype combination with
# SPARSECOMM_DEFINE_* macros, named sparsecomm_<op>_<suffixes>; these are the
# suffixes of the element types.
VALUE_SUFFIX = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}
"""The kernel name suffix of each value dtype."""

ID_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}
"""The kernel name suffix of each id dtype."""

NVRTC_OPTIONS: Tuple[str, ...] = ("--std=c++14",)
"""Options for NVRTC; CuPy adds ``-arch`` for the current device itself."""

BLOCK = 256
"""Threads per block of every launch.

``csrc/cuda/common.cuh`` (``kBlock``) stages long row groups for blocks of this
size; with another size the segment sums stay exact but lose that path.
"""

# Grid-stride kernels: more blocks than this per SM only adds scheduling cost.
_BLOCKS_PER_SM = 32

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
        name: File name inside the source folder, ``"<op>.cu"``.

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


# ---- the kernel table, read from the sources -----------------------------------

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_DIRECTIVE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)
_FUNCTION_MACRO = re.compile(r"#\s*define\s+(\w+)\(([^)]*)\)(.*)", re.S)
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\w+')
_ENTRY_POINT = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')
# Macros inside macros: deeper nesting than this is a macro that expands itself.
_MAX_EXPANSIONS = 16


def _function_macros(directives: Sequence[str]) -> Dict[str, Tuple[Tuple[str, ...], str]]:
    """The function-like ``#define``s among ``directives``: name -> (parameters, body)."""
    macros = {}
    for directive in directives:
        match = _FUNCTION_MACRO.match(directive.replace("\\\n", " ").strip())
        if match is not None:
            params = tuple(p.strip() for p in match.group(2).split(",") if p.strip())
            macros[match.group(1)] = (params, match.group(3))
    return macros


def _call_arguments(text: str, open_paren: int) -> Tuple[Tuple[str, ...], int]:
    """Split the arguments of the call whose ``(`` is at ``open_paren``; return them and the index after ``)``."""
    depth, start, args = 0, open_paren + 1, []
    for i in range(open_paren, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return tuple(args), i + 1
        elif text[i] == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
    raise ValueError("sparsecomm: unbalanced parentheses in a macro call of a CUDA source")


def _expand_once(code: str, macros: Dict[str, Tuple[Tuple[str, ...], str]]) -> Tuple[str, bool]:
    """Replace every call of a function-like macro in ``code`` by its body (``##`` pasted); say if any was."""
    call = re.compile(r"\b(" + "|".join(map(re.escape, macros)) + r")\s*\(") if macros else None
    out, at, expanded = [], 0, False
    while call is not None:
        match = call.search(code, at)
        if match is None:
            break
        params, body = macros[match.group(1)]
        args, end = _call_arguments(code, match.end() - 1)
        if len(args) != len(params) and (params or args != ("",)):
            raise ValueError(f"sparsecomm: macro {match.group(1)} takes {len(params)} arguments, given {len(args)}")
        bound = dict(zip(params, args))
        body = _TOKEN.sub(lambda t: bound.get(t.group(0), t.group(0)), body)
        out.extend((code[at:match.start()], " ", re.sub(r"\s*##\s*", "", body), " "))
        at, expanded = end, True
    out.append(code[at:])
    return "".join(out), expanded


def kernel_declarations(source: str) -> Dict[str, Tuple[str, ...]]:
    """Return the ``extern "C" __global__`` entry points of a CUDA source, with their parameters.

    The entry points are generated by function-like macros (one per dtype
    combination), so the macros are expanded first, as the preprocessor
    would: a parameter replaced by its argument, ``##`` pasting the tokens
    beside it, the result rescanned for further macros. Object-like macros,
    ``#`` stringizing and conditionals are not looked at: the sources use none
    of them to name an entry point. ``tests/test_cuda_compile.py`` checks the
    result against a real preprocessor and against the compiled PTX.

    Args:
        source: The text of a ``.cu`` file, its includes inlined or not.

    Returns:
        Entry point name -> its parameter declarations (``"long long d"``), in
        source order.
    """
    code = _COMMENT.sub(" ", source)
    macros = _function_macros(_DIRECTIVE.findall(code))
    code = _DIRECTIVE.sub(" ", code)
    for _ in range(_MAX_EXPANSIONS):
        code, expanded = _expand_once(code, macros)
        if not expanded:
            break
    else:
        raise ValueError("sparsecomm: macros of a CUDA source expand without end")
    return {name: tuple(" ".join(p.split()) for p in params.split(",") if p.strip())
            for name, params in _ENTRY_POINT.findall(code)}


@functools.lru_cache(maxsize=None)
def kernel_table() -> Dict[str, Tuple[str, ...]]:
    """Return every kernel the loader may launch, by the source file that defines it (file -> entry names).

    Read from the ``.cu`` files of :func:`find_source_dir` (:func:`kernel_declarations`),
    so a kernel is launchable as soon as its source defines it.

    Raises:
        FileNotFoundError: No folder holds the kernel sources.
    """
    folder = find_source_dir()
    return {path.name: tuple(kernel_declarations(load_source(path.name)))
            for path in sorted(folder.glob("*.cu"))}


def __getattr__(name: str) -> Any:
    # KERNELS is read from the sources on first use, not at import: a CPU-only
    # install without them still imports this module.
    if name == "KERNELS":
        return kernel_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _stream_handle(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _source_of(name: str) -> str:
    """The file that defines kernel ``name``."""
    for file, names in kernel_table().items():
        if name in names:
            return file
    raise KeyError(f"sparsecomm: no CUDA source in {find_source_dir()} defines a kernel named {name!r}")


def _function(cupy: Any, device: int, name: str) -> Any:
    """Return kernel ``name`` compiled for ``device`` (caller holds its context)."""
    key = (device, name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    file = _source_of(name)
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


def grid_size(total: int, device: int) -> int:
    """Blocks of :data:`BLOCK` threads for a grid-stride kernel over ``total`` elements on device ``device``.

    One thread an element, capped at a fixed number of blocks per SM (the
    kernels' loops stride over the rest).
    """
    return min(-(-total // BLOCK), _max_blocks(device))


def launch(
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
        args: Kernel arguments, already as NumPy scalars (:func:`ptr`,
            :func:`i64`, :func:`i32`), in the kernel's parameter order.
        shared_mem: Dynamic shared memory per block, in bytes.

    Raises:
        KeyError: No source defines a kernel named ``name``.
    """
    if total <= 0:
        return
    cupy = _cupy()
    index = _device_index(device)
    blocks = grid_size(total, index)
    with cupy.cuda.Device(index):
        fn = _function(cupy, index, name)
        stream = cupy.cuda.ExternalStream(_stream_handle(index))
        with stream:
            fn((blocks,), (BLOCK,), tuple(args), shared_mem=shared_mem)


# Kernel arguments travel as fixed-width NumPy scalars: CuPy passes a plain
# Python int as int64, which would silently mismatch an `int` parameter.
def ptr(tensor: Tensor) -> Any:
    """A pointer argument: the tensor's data address."""
    return numpy.uint64(tensor.data_ptr())


def i64(value: int) -> Any:
    """A ``long long`` argument."""
    return numpy.int64(value)


def i32(value: int) -> Any:
    """An ``int`` argument."""
    return numpy.int32(value)
