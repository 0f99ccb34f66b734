"""Checks of the CUDA kernel sources and their loader that need no GPU.

* every ``csrc/cuda/*.cu`` compiles with ``nvcc -ptx -arch=sm_90`` without a
  warning, both as written and as the loader hands it to NVRTC (includes
  inlined), and with NVRTC itself where CuPy can find it;
* the compiled PTX defines exactly the kernels ``sparsecomm._cuda.KERNELS``
  names, and every launch the loader makes passes as many arguments, of the
  same widths, as the kernel's PTX signature declares: the loader and the
  sources cannot drift apart unnoticed;
* importing the loader does not import CuPy.

``sparsecomm/_cuda.py`` is loaded from its file, not through the package, so
these checks run even where the C++ extension is not built.
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
CUDA_DIR = REPO / "csrc" / "cuda"
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
        proc = _nvcc_ptx(CUDA_DIR / name, tmp)
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
    _assert_clean(_nvcc_ptx(CUDA_DIR / name, tmp_path))


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


# ---- loader and sources agree -------------------------------------------------------


@pytest.mark.parametrize("name", CU_FILES)
def test_kernel_names_appear_in_source(name):
    # Cheap check without nvcc: the names are built by SPARSECOMM_ macros, so
    # look for the name's stem before `##` and for each suffix as a macro argument.
    source = (CUDA_DIR / name).read_text()
    for kernel in cuda.KERNELS[name]:
        parts = kernel.split("_")
        stem_len = next((i for i in range(len(parts), 0, -1) if "_".join(parts[:i]) + "_##" in source), 0)
        assert stem_len, f"no SPARSECOMM_ macro in {name} pastes a name for {kernel}"
        for suffix in parts[stem_len:]:
            assert re.search(rf"SPARSECOMM_DEFINE_\w+\([^)]*\b{suffix}\b", source), (kernel, suffix)


def test_ptx_defines_exactly_the_expected_kernels(ptx_signatures):
    for name in CU_FILES:
        assert set(ptx_signatures[name]) == set(cuda.KERNELS[name]), name


def _record_launches(monkeypatch) -> list:
    calls = []

    def fake_launch(device, name, total, args, shared_mem=0):
        calls.append((name, total, tuple(args), shared_mem))

    monkeypatch.setattr(cuda, "_launch", fake_launch)
    return calls


def test_launch_arguments_match_kernel_signatures(monkeypatch, ptx_signatures):
    # Drive every host path on CPU tensors with the launch intercepted, and
    # compare each launch with the kernel's PTX parameter list.
    calls = _record_launches(monkeypatch)
    value_dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    for id_dtype in (torch.int32, torch.int64):
        ids = torch.tensor([5, 1, 5, 0, 9, 1], dtype=id_dtype)
        for value_dtype in value_dtypes:
            values = torch.ones(6, 3, dtype=value_dtype)
            cuda.coalesce_rows(ids, values)
            cuda.scatter_add_rows(torch.zeros(10, 3, dtype=value_dtype), ids, values)
        for scheme in (0, 1):
            cuda.partition_rows(ids, None, 3, scheme, 4, 1)
            cuda.partition_rows(ids, torch.ones(6, 2), 5000, scheme, 4, 2)  # global-memory bins
        # Row widths of 1, 2, 4, 8 and 16 bytes reach every gather copy unit.
        for dtype, d in ((torch.uint8, 1), (torch.float16, 1), (torch.float32, 1),
                         (torch.float64, 1), (torch.float32, 4)):
            cuda.gather_rows(torch.zeros(10, d, dtype=dtype), ids)

    signatures = {k: v for per_file in ptx_signatures.values() for k, v in per_file.items()}
    for name, total, args, _ in calls:
        assert name in signatures, name
        assert total > 0
        assert [a.itemsize for a in args] == signatures[name], name
    assert {c[0] for c in calls} == set(signatures), "every kernel is reachable from the loader"


def test_empty_inputs_launch_nothing(monkeypatch):
    calls = _record_launches(monkeypatch)
    ids = torch.empty(0, dtype=torch.int64)
    values = torch.empty(0, 7, dtype=torch.float16)
    u_ids, sums = cuda.coalesce_rows(ids, values)
    assert u_ids.shape == (0,) and u_ids.dtype == torch.int64
    assert sums.shape == (0, 7) and sums.dtype == torch.float16
    counts, p_ids, p_values, perm = cuda.partition_rows(ids, values, 4, 0, 1, 1)
    assert counts.tolist() == [0, 0, 0, 0] and p_ids.numel() == 0
    assert p_values.shape == (0, 7) and perm.dtype == torch.int64 and perm.numel() == 0
    assert cuda.gather_rows(torch.zeros(3, 7), ids).shape == (0, 7)
    table = torch.zeros(3, 7)
    assert cuda.scatter_add_rows(table, ids, torch.empty(0, 7)) is table
    assert calls == []


def test_partition_rejects_bad_owner_map():
    ids = torch.tensor([1, 2])
    for args in ((0, 0, 1, 1), (2, 2, 1, 1), (2, 0, 1, 0), (2, 1, 0, 1)):
        with pytest.raises(ValueError):
            cuda.partition_rows(ids, None, *args)


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
