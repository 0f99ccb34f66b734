#!/usr/bin/env bash
# Set up sparsecomm for development, in three steps that each print a line:
# torch (only where none is installed), the build tools, then this repository
# built in place (editable) with the extras given.
#
# Usage: bash scripts/setup.sh [extra,...]        e.g. bash scripts/setup.sh test,mpi
#
# Which torch, precisely (it is the only large download; docs/INSTALL.md):
#   - a torch (>= 2.4) already importable by $PYTHON is kept, whatever its
#     build: nothing is downloaded for it, and nothing below upgrades or
#     replaces it;
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
#     An index pip cannot reach makes it retry for minutes: install torch
#     first from whatever source works (a wheel file, a mirror, conda), then
#     run this script, which keeps it.
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

say() { echo "[setup] $*"; }

torch_build() {
  "$PY" -c "import torch; c = torch.version.cuda; print(torch.__version__, '(CUDA ' + c + ' build)' if c else '(CPU-only build)')"  2>/dev/null
}

say "using $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
if "$PY" -c "import torch" >/dev/null 2>&1; then
  # The package needs torch >= 2.4: an older one would make pip below replace
  # it, silently, with whatever its index offers (on Linux: the CUDA build).
  if ! "$PY" -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 4))"; then
    say "the installed torch $(torch_build) is older than 2.4, which sparsecomm needs;"
    say "upgrade it yourself (pip install torch==${TORCH_VERSION} from the index of the build you want) and run this again"
    exit 1
  fi
  say "step 1/3: torch: keeping the installed torch $(torch_build); nothing to download"
else
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    say "step 1/3: torch: none found; installing torch==${TORCH_VERSION} from ${TORCH_INDEX_URL}"
  else
    say "step 1/3: torch: none found; installing torch==${TORCH_VERSION} from pip's configured indexes"
    say "  (public PyPI on Linux: the CUDA build, several GB; for the CPU-only build set"
    say "   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu and run this again)"
  fi
  say "  (if pip keeps retrying, the index is out of reach: press Ctrl-C, install torch==${TORCH_VERSION}"
  say "   from a source that works, and run this again; it keeps that torch: docs/INSTALL.md)"
  # Not quiet: a download of 200 MB to several GB wants its progress bar.
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$PY" -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
  else
    "$PY" -m pip install "torch==${TORCH_VERSION}"
  fi
  say "installed torch $(torch_build)"
fi

# Build requirements first, then build without isolation: faster, and the
# build sees the same pip configuration as everything else. torch is
# installed by now, so the package's "torch>=2.4" is already satisfied and
# pip resolves no other torch.
say "step 2/3: build tools (scikit-build-core, pybind11)"
"$PY" -m pip install -q "scikit-build-core>=0.8" "pybind11>=2.11"

say "step 3/3: building sparsecomm's C++ kernels (about a minute) and installing it, editable, with [${extras}]..."
start=$SECONDS
# Not quiet: pip's lines (what it collects, "Building editable for sparsecomm ...") show it is working.
"$PY" -m pip install --no-build-isolation -e ".[${extras}]"
say "built and installed in $((SECONDS - start)) s"
"$PY" -c "import sparsecomm, torch; print(f'[setup] done: sparsecomm {sparsecomm.__version__} with torch {torch.__version__}')"
