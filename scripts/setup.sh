#!/usr/bin/env bash
# Set up sparsecomm for development on a fresh machine: the CPU build of torch
# (only where no torch is installed, so pip never resolves a multi-GB CUDA
# build), then an editable install of this repository with the test tools.
# Usage: bash scripts/setup.sh [extra,...]   e.g. bash scripts/setup.sh test,mpi
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-test}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] no torch found: installing the CPU build torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
# Build requirements first, then build without isolation: faster, and the
# build sees the same pip configuration as everything else.
"$PY" -m pip install -q "scikit-build-core>=0.8" "pybind11>=2.11"
"$PY" -m pip install -q --no-build-isolation -e ".[${extras}]"
"$PY" -c "import sparsecomm, torch; print(f'[setup] sparsecomm {sparsecomm.__version__} with torch {torch.__version__}')"
