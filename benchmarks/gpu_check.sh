#!/usr/bin/env bash
# One-shot check of the CUDA kernels on a GPU machine.
#
# Runs, each step under its own timeout and without touching the network:
#   1. what the machine has (torch, CUDA, GPU, CuPy, nvcc);
#   2. an offline editable install, only when `import sparsecomm.ops` fails;
#   3. the nvcc/NVRTC compile checks (tests/test_cuda_compile.py);
#   4. the GPU tests: kernels vs CPU, sparse_allreduce / the DDP hook / sharded
#      tables on CUDA tensors at gloo world 2 and NCCL world 1 (pytest -m gpu);
#   5. the kernel microbenchmarks on CUDA (benchmarks/bench_kernels.py);
# then prints a summary table. A failing step is reported, never fatal, so one
# run shows everything that works and everything that does not.
#
# Usage: bash benchmarks/gpu_check.sh
# Environment: PYTHON (default python), STEP_TIMEOUT seconds (default 300),
# LOG_DIR (default $OUT/gpu_check when OUT is set, else /tmp/sparsecomm_gpu_check).
set -u

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
if [ -n "${OUT:-}" ]; then
  LOG_DIR=${LOG_DIR:-$OUT/gpu_check}
else
  LOG_DIR=${LOG_DIR:-/tmp/sparsecomm_gpu_check}
fi
mkdir -p "$LOG_DIR"

STEP_NAMES=()
STEP_RESULTS=()
STEP_SECONDS=()
STEP_NOTES=()

# record NAME RESULT SECONDS NOTE: add one row to the summary.
record() {
  STEP_NAMES+=("$1")
  STEP_RESULTS+=("$2")
  STEP_SECONDS+=("$3")
  STEP_NOTES+=("$4")
}

# step NAME COMMAND...: run COMMAND under the timeout, log it, record the result.
# Returns the command's exit status.
step() {
  local name=$1
  shift
  local log="$LOG_DIR/$name.log"
  local start=$SECONDS
  echo
  echo "=== $name: $*"
  timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local result
  case $rc in
    0) result=ok ;;
    124) result="TIMEOUT (${STEP_TIMEOUT}s)" ;;
    5) result="NOTHING RAN" ;;  # pytest: every test skipped or deselected
    *) result="FAIL (rc=$rc)" ;;
  esac
  # The last non-empty line (pytest's "N passed, M skipped", an error) says most.
  local note
  note=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c 1-70)
  record "$name" "$result" "$((SECONDS - start))" "$note"
  return "$rc"
}

# ---- 1. the machine ------------------------------------------------------------
step environment "$PY" -c '
import platform, shutil, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
print("nvcc:", shutil.which("nvcc") or "not on PATH")
'

if ! step cupy "$PY" -c '
import cupy
try:
    devices = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:  # installed, but no driver or device
    devices = f"none ({exc})"
print("cupy", cupy.__version__, "| devices", devices)
'; then
  # Nothing is installed from the network here; the GPU tests will skip.
  STEP_NOTES[${#STEP_NOTES[@]}-1]="cupy missing: pip install sparsecomm[gpu] (cupy-cuda12x/13x)"
  echo "cupy missing"
fi

# ---- 2. the package ------------------------------------------------------------
if "$PY" -c 'import sparsecomm.ops' >/dev/null 2>&1; then
  record install "ok" 0 "sparsecomm already importable"
else
  # Offline: build from this checkout with what is installed (scikit-build-core,
  # pybind11, a C++ compiler); a failure is printed and the run goes on.
  step install "$PY" -m pip install --no-build-isolation --no-index --no-deps -e .
fi

# ---- 3-4. tests ----------------------------------------------------------------
step compile_tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_compile.py
# Without a GPU or CuPy the module skips itself; -rs prints why.
step gpu_tests "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_gpu_kernels.py tests/test_gpu_collectives.py \
  tests/test_sharded_devices.py tests/test_sharded_compile.py

# ---- 5. benchmarks -------------------------------------------------------------
if [ -f benchmarks/bench_kernels.py ]; then
  step bench_kernels "$PY" benchmarks/bench_kernels.py --device cuda
else
  record bench_kernels "SKIPPED" 0 "benchmarks/bench_kernels.py not found"
fi

# ---- 6. communication benchmarks on CUDA (sparsecomm/bench/{allreduce,sparse_sync}.py) ----
# Dense collectives on NCCL (nccl-tests style) and the sparse sync sweep with
# CUDA tensors, one rank per GPU. NCCL allows one rank per GPU, so with a
# single GPU the NCCL runs are a world of one (the CUDA path, not the
# network), and the sweep also runs 2 ranks sharing the GPU over gloo (CUDA
# tensors, host transport). Rows go to $LOG_DIR/*.json; a non-zero #wrong
# makes the step fail (exit status 3).
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 1 ]; then
  step bench_allreduce "$PY" benchmarks/bench_allreduce.py --nproc "$NGPU" --device cuda --backend nccl \
    -b 8 -e 256M -f 4 --json "$LOG_DIR/bench_allreduce_nccl.json"
  step bench_sparse "$PY" benchmarks/bench_sparse.py --nproc "$NGPU" --device cuda --backend nccl \
    --methods dense,torch_sparse,allgather,sparsecomm,sparsecomm_allgather,sparsecomm_densify \
    --json "$LOG_DIR/bench_sparse_nccl.json"
  if [ "$NGPU" -lt 2 ]; then
    step bench_sparse_gloo "$PY" benchmarks/bench_sparse.py --nproc 2 --device cuda --backend gloo \
      --densities 0.001,0.01 --json "$LOG_DIR/bench_sparse_gloo_cuda.json"
  fi
else
  record bench_allreduce "SKIPPED" 0 "no CUDA device"
  record bench_sparse "SKIPPED" 0 "no CUDA device"
fi

# ---- summary -------------------------------------------------------------------
echo
echo "=== summary (logs in $LOG_DIR)"
printf '%-14s %-18s %6s  %s\n' step result seconds note
printf '%-14s %-18s %6s  %s\n' ---- ------ ------- ----
for i in "${!STEP_NAMES[@]}"; do
  printf '%-14s %-18s %6s  %s\n' "${STEP_NAMES[$i]}" "${STEP_RESULTS[$i]}" "${STEP_SECONDS[$i]}" "${STEP_NOTES[$i]}"
done

# Non-zero only when the kernels themselves failed a check; the install and
# the benchmark are informational.
for i in "${!STEP_NAMES[@]}"; do
  case "${STEP_NAMES[$i]}:${STEP_RESULTS[$i]}" in
    compile_tests:FAIL* | compile_tests:TIMEOUT* | gpu_tests:FAIL* | gpu_tests:TIMEOUT*) exit 1 ;;
  esac
done
exit 0
