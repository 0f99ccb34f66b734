"""Checks of the CUDA kernel sources and their loader that need no GPU.

* every ``csrc/cuda/*.cu`` compiles with ``nvcc -ptx -arch=sm_90`` without a
  warning, both as written (with the C++ build's include path, for
  ``csrc/owner_map.h``) and as the loader hands it to NVRTC (includes inlined,
  nothing beside it), and with NVRTC itself where CuPy can find it;
* ``csrc/owner_map.h``, the owner map the CPU and CUDA kernels share, compiles
  as plain C++ and as CUDA, reaches NVRTC inlined (from a checkout and from a
  wheel's layout), and is the only source that spells the map out;
* ``sparsecomm._cuda.KERNELS``, which the loader reads from the sources
  themselves, names the entry points a real preprocessor sees, with the same
  parameters, and the compiled PTX defines exactly those kernels with
  parameters of the declared widths (tests/test_ops_cuda_launch.py checks
  every launch against the declarations): the operators' launches, the table
  and the sources cannot drift apart unnoticed;
* importing the loader does not import CuPy.

``sparsecomm/_cuda.py`` is loaded from its file as a module of its own: these
checks need neither the package nor its compiled kernels.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
CUDA_DIR = CSRC / "cuda"
OWNER_MAP = CSRC / "owner_map.h"
LOADER = REPO / "sparsecomm" / "_cuda.py"
CU_FILES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


def _load_loader():
    spec = importlib.util.spec_from_file_location("_sparsecomm_cuda_under_test", LOADER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cuda = _load_loader()


def _nvcc_ptx(source: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """``nvcc -ptx`` of ``source``; ``extra`` adds options (the C++ build's ``-I csrc`` for the sources as written)."""
    out = tmp_path / (source.stem + ".ptx")
    return subprocess.run(
        [NVCC, "-ptx", "-arch=sm_90", *extra, str(source), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_clean(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.([a-z])(\d+)\s+\w+")


def _ptx_signatures(ptx: str) -> dict:
    """Map each kernel in a PTX file to the byte widths of its parameters."""
    signatures = {}
    for name, params in _ENTRY.findall(ptx):
        widths = [int(bits) // 8 for _, bits in _PARAM.findall(params)]
        assert len(widths) == params.count(".param"), f"unparsed parameter in {name}: {params}"
        signatures[name] = widths
    return signatures


@pytest.fixture(scope="module")
def ptx_signatures(tmp_path_factory) -> dict:
    if NVCC is None:
        pytest.skip("nvcc not on PATH")
    tmp = tmp_path_factory.mktemp("ptx")
    signatures = {}
    for name in CU_FILES:
        proc = _nvcc_ptx(CUDA_DIR / name, tmp, f"-I{CSRC}")
        _assert_clean(proc)
        signatures[name] = _ptx_signatures((tmp / (Path(name).stem + ".ptx")).read_text())
    return signatures


# ---- compilation ------------------------------------------------------------------


def test_sources_exist():
    assert CU_FILES, f"no .cu files in {CUDA_DIR}"
    assert sorted(cuda.KERNELS) == CU_FILES, "every .cu file is listed in _cuda.KERNELS and vice versa"


@needs_nvcc
@pytest.mark.parametrize("name", CU_FILES)
def test_nvcc_compiles_without_warnings(name, tmp_path):
    _assert_clean(_nvcc_ptx(CUDA_DIR / name, tmp_path, f"-I{CSRC}"))


@needs_nvcc
@pytest.mark.parametrize("name", CU_FILES)
def test_loader_source_compiles_without_warnings(name, tmp_path):
    # What NVRTC gets: one self-contained string, compiled with the loader's options.
    source = cuda.load_source(name)
    assert not re.search(r'^\s*#\s*include\s+"', source, re.M), "local includes are inlined"
    path = tmp_path / name
    path.write_text(source)
    _assert_clean(_nvcc_ptx(path, tmp_path, *cuda.NVRTC_OPTIONS))


@pytest.mark.parametrize("name", CU_FILES)
def test_nvrtc_compiles_without_warnings(name):
    pytest.importorskip("cupy")
    from cupy_backends.cuda.libs import nvrtc

    try:
        nvrtc.getVersion()
    except Exception as exc:  # the NVRTC library itself is a separate install
        pytest.skip(f"NVRTC library not loadable: {exc}")
    program = nvrtc.createProgram(cuda.load_source(name), name, [], [])
    try:
        nvrtc.compileProgram(program, [*cuda.NVRTC_OPTIONS, "-arch=compute_90"])
    except Exception as exc:
        pytest.fail(f"{exc}\n{nvrtc.getProgramLog(program)}")
    log = nvrtc.getProgramLog(program)
    assert "warning" not in log.lower(), log
    ptx = nvrtc.getPTX(program)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert set(re.findall(r"\.entry\s+(\w+)", ptx)) == set(cuda.KERNELS[name])


# ---- the shared owner map ---------------------------------------------------------

_OWNER_MAP_USE = """
#include "owner_map.h"
extern "C" __global__ void owner_of(const long long* ids, long long n, int scheme, long long num_owners,
                                    long long range_size, long long stride, long long* out) {
  const sparsecomm::OwnerMap map = {scheme, num_owners, range_size, stride};
  for (long long i = 0; i < n; ++i) out[i] = sparsecomm::owner_map_error(map) ? -1 : sparsecomm::row_owner(ids[i], map);
}
"""


def test_loader_inlines_the_shared_owner_map():
    source = cuda.load_source("partition.cu")
    assert '#line 1 "owner_map.h"' in source
    header = OWNER_MAP.read_text()
    assert header.strip().splitlines()[-1] in source, "the whole header, to its last line"
    for line in ("#define SPARSECOMM_SCHEME_HASH 0", "#define SPARSECOMM_SCHEME_RANGE 1"):
        assert line in header and line in source


def test_a_wheel_layout_finds_the_owner_map_beside_the_sources(tmp_path):
    # CMakeLists.txt installs csrc/cuda/* and csrc/owner_map.h into one folder, sparsecomm/cuda_src.
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert re.search(r"install\(FILES csrc/owner_map\.h DESTINATION sparsecomm/cuda_src\)", cmake)
    for path in [*CUDA_DIR.iterdir(), OWNER_MAP]:
        shutil.copy(path, tmp_path / path.name)
    assert cuda._inline_includes((tmp_path,), "partition.cu", set()) == cuda.load_source("partition.cu")
    (tmp_path / "owner_map.h").unlink()
    with pytest.raises(FileNotFoundError, match="owner_map.h"):
        cuda._inline_includes((tmp_path,), "partition.cu", set())


def test_owner_map_compiles_as_plain_cpp(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    proc = subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-x", "c++",
                           str(OWNER_MAP)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
def test_owner_map_compiles_as_cuda_with_and_without_nvrtc_inlining(tmp_path):
    use = tmp_path / "owner_of.cu"
    use.write_text(_OWNER_MAP_USE)
    _assert_clean(_nvcc_ptx(use, tmp_path, f"-I{CSRC}"))
    # As NVRTC would get it: the header inlined, no include path, no system headers.
    inlined = tmp_path / "owner_of_inlined.cu"
    inlined.write_text(_OWNER_MAP_USE.replace('#include "owner_map.h"', OWNER_MAP.read_text()))
    _assert_clean(_nvcc_ptx(inlined, tmp_path, *cuda.NVRTC_OPTIONS))


def test_only_the_owner_map_spells_out_the_owner_map():
    # splitmix64's constants and a scheme compared with a bare number appear in owner_map.h alone.
    sources = [p for p in CSRC.rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh") and p != OWNER_MAP]
    assert sources
    for path in sources:
        text = path.read_text()
        assert "9E3779B97F4A7C15" not in text.upper(), path
        assert not re.search(r"scheme\s*[!=]=\s*\d", text), path


# ---- loader and sources agree -------------------------------------------------------


# The entry points as the preprocessed text spells them (independent of the loader's own parsing).
_PREPROCESSED_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')


def _declared_width(declaration: str) -> int:
    """Bytes of a kernel parameter as the source declares it: a pointer, ``long long`` or ``int``."""
    if "*" in declaration:
        return 8
    return {"long long": 8, "int": 4}[declaration.rsplit(None, 1)[0]]


@pytest.mark.parametrize("name", CU_FILES)
def test_kernel_table_is_what_the_preprocessor_sees(name):
    # The C preprocessor does not care that the text is CUDA: its expansion of the
    # SPARSECOMM_DEFINE_* macros is the reference for the loader's.
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    source = cuda.load_source(name)
    proc = subprocess.run([cxx, "-E", "-P", "-x", "c++", "-"], input=source, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    want = {kernel: tuple(" ".join(p.split()) for p in params.split(","))
            for kernel, params in _PREPROCESSED_ENTRY.findall(proc.stdout)}
    assert want, f"no entry points in {name}"
    assert cuda.kernel_declarations(source) == want
    assert set(cuda.KERNELS[name]) == set(want)


def test_kernel_table_expands_nested_macros_and_pastes_names():
    source = """
    // extern "C" __global__ void commented_out(int x) {}
    #define DEFINE_ONE(SUFFIX, T) \\
      extern "C" __global__ void k_##SUFFIX##_x(const T* __restrict__ a, long long n) {}
    #define DEFINE_TWO(SUFFIX, T) DEFINE_ONE(SUFFIX##1, T) DEFINE_ONE(SUFFIX##2, unsigned T)
    DEFINE_TWO(a, int)
    extern "C" __global__ void plain(int* p) {}
    """
    assert cuda.kernel_declarations(source) == {
        "k_a1_x": ("const int* __restrict__ a", "long long n"),
        "k_a2_x": ("const unsigned int* __restrict__ a", "long long n"),
        "plain": ("int* p",),
    }
    with pytest.raises(ValueError, match="expand without end"):
        cuda.kernel_declarations("#define LOOP(x) LOOP(x)\nLOOP(1)\n")
    with pytest.raises(ValueError, match="macro TWO takes 2 arguments, given 1"):
        cuda.kernel_declarations("#define TWO(a, b) a b\nTWO(1)\n")


def test_ptx_defines_exactly_the_kernels_of_the_table_with_the_declared_widths(ptx_signatures):
    for name in CU_FILES:
        assert set(ptx_signatures[name]) == set(cuda.KERNELS[name]), name
        declarations = cuda.kernel_declarations(cuda.load_source(name))
        for kernel, widths in ptx_signatures[name].items():
            assert [_declared_width(d) for d in declarations[kernel]] == widths, kernel


# ---- import behaviour ------------------------------------------------------------


def test_import_does_not_need_cupy():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(LOADER)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'cupy' not in sys.modules, 'cupy imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_missing_cupy_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(ImportError, match=r"sparsecomm\[gpu\]"):
        cuda._cupy()
