#!/usr/bin/env bash
# Set up sparsecomm for development: torch (only where none is installed),
# the build tools, then this repository in editable mode with the extras given.
#
# Usage: bash scripts/setup.sh [extra,...]        e.g. bash scripts/setup.sh test,mpi
#
# Which torch, precisely (it is the only large download):
#   - a torch already importable by $PYTHON is kept, whatever its build;
#     nothing below ever upgrades or replaces it;
#   - otherwise torch==$TORCH_VERSION (default 2.13.0) is installed:
#       TORCH_INDEX_URL unset: from the indexes your pip is configured with.
#         From the public PyPI on Linux x86_64 that is the default wheel, built
#         with CUDA (it pulls the nvidia-* CUDA libraries, several GB); on macOS
#         and Windows, and from a local wheel cache, whatever that holds.
#       TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu: the CPU-only
#         build (about 200 MB), for machines without an NVIDIA GPU.
#       TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ: a build for
#         CUDA X.Y (see https://pytorch.org/get-started/locally/ for the ones
#         that exist for this torch version).
# Extras: test, mpi (Open MPI + mpi4py wheels), bench (matplotlib), gpu (CuPy
# for CUDA 12.x: the CUDA kernels), gpu-cuda13 (CuPy for CUDA 13.x).
# Needs a C++17 compiler and CMake >= 3.18 (OpenMP used when found).
# PYTHON picks the interpreter (default: python3; run inside a virtual
# environment to keep this out of the system's Python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-test}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

torch_build() {
  "$PY" -c "import torch; c = torch.version.cuda; print(torch.__version__, '(CUDA ' + c + ' build)' if c else '(CPU-only build)')"  2>/dev/null
}

if "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] keeping the installed torch $(torch_build)"
else
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    echo "[setup] no torch found: installing torch==${TORCH_VERSION} from ${TORCH_INDEX_URL}"
    "$PY" -m pip install -q "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
  else
    echo "[setup] no torch found: installing torch==${TORCH_VERSION} from pip's configured indexes"
    echo "[setup]   (public PyPI on Linux: the CUDA build, several GB; for the CPU-only build set"
    echo "[setup]    TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu and run this again)"
    "$PY" -m pip install -q "torch==${TORCH_VERSION}"
  fi
  echo "[setup] installed torch $(torch_build)"
fi
# Build requirements first, then build without isolation: faster, and the
# build sees the same pip configuration as everything else. torch is
# installed by now, so the package's "torch>=2.4" is already satisfied and
# pip resolves no other torch.
"$PY" -m pip install -q "scikit-build-core>=0.8" "pybind11>=2.11"
"$PY" -m pip install -q --no-build-isolation -e ".[${extras}]"
"$PY" -c "import sparsecomm, torch; print(f'[setup] sparsecomm {sparsecomm.__version__} with torch {torch.__version__}')"
