#!/usr/bin/env bash
# Run the kernels under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Builds a second copy of the C++ extension with -fsanitize=address,undefined
# into build/asan (the editable install and its build directory are left
# alone), lays out a package tree there that imports sparsecomm's Python files
# from this checkout with the sanitized _C beside them, and runs the kernel
# property tests (tests/test_ops.py, tests/test_ops_pooled.py), the owner map's
# tests (tests/test_ownership.py), one multi-rank sharded test (3 gloo
# ranks) and the shared-memory all-to-all against gloo's against it. Any
# sanitizer report fails the run: ASan and UBSan stop the process at the
# first error, and the output is searched for reports too.
#
# Usage: bash scripts/sanitize.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CXX=${CXX:-g++}
root=$PWD
out=$root/build/asan
site=$out/site
logs=$out/logs

flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
echo "[sanitize] building the extension with: $flags"
cmake -S "$root" -B "$out/cmake" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" >/dev/null
cmake --build "$out/cmake" --parallel "$(nproc)" >/dev/null

# The package tree: links to this checkout's Python files, and the sanitized _C.
rm -rf "$site" "$logs"
mkdir -p "$site/sparsecomm" "$logs"
for entry in "$root"/sparsecomm/*; do
  case "$(basename "$entry")" in _C.*|__pycache__) continue ;; esac
  ln -s "$entry" "$site/sparsecomm/"
done
cp "$out"/cmake/_C*.so "$site/sparsecomm/"
# The editable install puts an import hook first on sys.meta_path that would
# load the installed _C; sitecustomize (run at every interpreter start, the
# spawned ranks' too) removes it, so the tree above wins through PYTHONPATH.
cat > "$site/sitecustomize.py" <<'EOF'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__name__.startswith("ScikitBuild")]
EOF

# Python is not built with ASan: its runtime must be loaded first, and the
# C++ runtime with it (ASan intercepts __cxa_throw and must find the real one
# at start-up, or the kernels' first exception aborts).
export LD_PRELOAD="$("$CXX" -print-file-name=libasan.so) $(readlink -f "$("$CXX" -print-file-name=libstdc++.so)")"
# Python's own allocations are never freed at exit: leak reports would be noise.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export PYTHONPATH="$site:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# Run from build/asan: the checkout's own sparsecomm/ (with the installed
# _C's import path) must not shadow the tree above through the current directory.
cd "$out"
"$PY" - <<EOF
import sparsecomm._C as c
assert c.__file__.startswith("$site/"), f"imported {c.__file__}, not the sanitized build"
print(f"[sanitize] using {c.__file__}")
EOF

# --capture=sys: reports go to file descriptor 2, which pytest's default
# capture would swallow when the sanitizer ends the process mid-test.
status=0
"$PY" -m pytest -q -p no:cacheprovider --capture=sys --rootdir "$root" -c "$root/pyproject.toml" \
  "$root/tests/test_ops.py" "$root/tests/test_ops_pooled.py" "$root/tests/test_ownership.py" \
  "$root/tests/test_sharded_peers.py::test_bad_counts_and_ids_from_one_peer_raise_on_every_rank" \
  "$root/tests/test_shm_alltoall.py::test_shared_memory_all_to_all_moves_the_bytes_gloo_moves" \
  "$root/tests/test_shm_alltoall.py::test_sizes_that_disagree_fail_the_call_on_every_rank" \
  "$root/tests/test_shm_alltoall.py::test_rows_straight_between_tensors_and_slots_equal_the_packed_exchange" "$@" \
  2>&1 | tee "$logs/pytest.log" || status=$?
if grep -qE "ERROR: AddressSanitizer|AddressSanitizer: CHECK failed|runtime error:|UndefinedBehaviorSanitizer" \
    "$logs/pytest.log"; then
  echo "[sanitize] sanitizer reports in the output above (saved in $logs/pytest.log)" >&2
  status=1
fi
if [ "$status" -ne 0 ]; then
  echo "[sanitize] FAILED" >&2
  exit "$status"
fi
echo "[sanitize] no sanitizer reports"
