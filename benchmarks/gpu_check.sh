#!/usr/bin/env bash
# The first-GPU-run check: in one call of at most 10 minutes on a single-GPU machine without network, build the
# library with the machine's own python3 and torch, run every CUDA path's tests, then short benchmarks; write a
# short summary, the full log and one tar of the results into $OUT.
#
#   bash benchmarks/gpu_check.sh                          # the GPU machine (its python3 holds torch)
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu_check.sh       # dry run on a machine without a GPU
#   STEPS=build,cuda_tests bash benchmarks/gpu_check.sh   # a selection (names or their prefixes, see below)
#
# Steps, most important first; each gets min(its own limit, what is left of BUDGET_S), and is skipped when less
# than MIN_STEP_S is left, so the script ends in time with what it has:
#   build           CMake (+ ninja when found) with $PYTHON, tests and C++ benchmarks off, sm_90; no pip, no network
#   cuda_tests      tests/python/test_cuda.py: every kernel, Gloo ranks sharing the GPU (host staging), 1-rank NCCL
#   kernel_tests    the CUDA kernel-vs-CPU tests of test_neighborhood_attention.py and test_point_search.py
#   ring_attention  benchmarks/ring_attention, 2 ranks on one GPU (Gloo, host staging)
#   halo_conv       benchmarks/halo_conv, 2 ranks on one GPU
#   vit_baseline_*, transolver_baseline_*, stormscope_baseline_*   single device, one launch per size, smallest
#                   first (a failed or timed-out size skips the larger ones)
#   vit_shared2_*, transolver_shared2_*, stormscope_shared2_*      2 ranks sharing the GPU (per-rank memory)
# STEPS=all (default) or a comma list; a name selects the steps it names or prefixes (vit selects every vit_*).
#
# Variables: DEVICE (cuda | cpu), QUICK (CI sizes), BUDGET_S (540), MIN_STEP_S (20), RESERVE_S (15, kept for
# packing), OUT ($OUT of the device machine; else the git-ignored benchmarks/results/local/gpu_check[_cpu]),
# PYTHON (default: python3 if it imports torch, else .venv/bin/python), BUILD_DIR (build-gpu-check; BUILD_DIR=build
# reuses `make build`'s tree), TORCH_CUDA_ARCH_LIST (9.0), PYTHON_INCLUDE (a folder holding Python.h when the
# interpreter's own is missing), PYTEST_K (a -k filter for cuda_tests), COMMIT (recorded in the summary when the
# tree travels without .git).
#
# $OUT receives three files: summary.txt (machine, tools, one line per step, the failures), gpu_check.log (every
# step's full output) and results.tar.gz (logs/ and results/: the benchmarks' JSON, Markdown and PNG; their --out
# points there, so the tree's results stay as they are).
# Exit status: 0 when no step failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-}
BUDGET_S=${BUDGET_S:-540}
MIN_STEP_S=${MIN_STEP_S:-20}
RESERVE_S=${RESERVE_S:-15}
BUILD_DIR=${BUILD_DIR:-build-gpu-check}
# Torch's CMake turns this into the nvcc -gencode flags (it ignores CMAKE_CUDA_ARCHITECTURES): H100/H200.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
STEPS=${STEPS:-all}
[ -n "${SKIP_BUILD:-}" ] && SKIP_STEPS="build,${SKIP_STEPS:-}"
SKIP_STEPS=${SKIP_STEPS:-}
[ -n "${OUT:-}" ] || OUT=benchmarks/results/local/gpu_check$([ "$DEVICE" = cuda ] || echo "_$DEVICE")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/summary.txt" "$OUT/gpu_check.log" "$OUT/results.tar.gz"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$WORK/logs" "$WORK/results/workloads" "$WORK/bin"
STEP_TABLE="$WORK/steps.tsv"
: > "$STEP_TABLE"
FULL_LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

say() { echo "== [${SECONDS}s] $*" | tee -a "$FULL_LOG"; }

# ---- the interpreter: the machine's python3 on the GPU machine, the dev venv as a fallback ----
PYTHON=${PYTHON:-${PY:-}}
for c in ${PYTHON:-python3 .venv/bin/python}; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then FOUND=$c; break; fi
done
if [ -z "${FOUND:-}" ]; then
  echo "gpu_check: no python with torch (tried ${PYTHON:-python3, .venv/bin/python}); pass PYTHON=..." \
    | tee "$OUT/summary.txt"
  exit 2
fi
case $FOUND in
  */*) PYTHON="$(cd "$(dirname "$FOUND")" && pwd)/$(basename "$FOUND")" ;;  # a venv's python keeps its path
  *) PYTHON=$(command -v "$FOUND") ;;
esac
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
# Benchmarks ask git for the commit; a machine without git gets a stand-in that answers nothing.
if ! command -v git >/dev/null 2>&1; then printf '#!/bin/sh\nexit 1\n' > "$WORK/bin/git"; chmod +x "$WORK/bin/git"; fi
export PATH="$WORK/bin:$PATH"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || true)}

# ---- tools: cmake and ninja from PATH or from the interpreter's pip packages; nvcc; Python.h ----
find_tool() {  # find_tool NAME PYTHON_EXPR: the tool's path, or empty
  local p
  p=$(command -v "$1" 2>/dev/null) && { echo "$p"; return; }
  p=$("$PYTHON" -c "$2" 2>/dev/null) && [ -x "$p/$1" ] && echo "$p/$1"
}
CMAKE=$(find_tool cmake 'import cmake; print(cmake.CMAKE_BIN_DIR)')
NINJA=$(find_tool ninja 'import ninja; print(ninja.BIN_DIR)')
NVCC=$(command -v nvcc 2>/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true)
PY_INCLUDE=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)
PY_VER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PYTHON_H=""
for d in ${PYTHON_INCLUDE:-} "$PY_INCLUDE" "/usr/include/python$PY_VER" "/usr/local/include/python$PY_VER"; do
  if [ -f "$d/Python.h" ]; then PYTHON_H=$d; break; fi
done
version_of() {  # the version a tool prints (nvcc: its release)
  [ -n "$1" ] || { echo missing; return; }
  local out r
  out=$("$1" --version 2>/dev/null)
  r=$(grep -o 'release [0-9.]*[0-9]' <<< "$out" | head -1)
  if [ -n "$r" ]; then echo "${r#release }"; else grep -oE '[0-9]+\.[0-9][0-9.]*[0-9]' <<< "$out" | head -1; fi
}

# ---- step bookkeeping ----
selected() {  # selected NAME: true when STEPS (minus SKIP_STEPS) names NAME or a prefix of it
  local name=$1 t
  for t in ${SKIP_STEPS//,/ }; do [ "$name" = "$t" ] || [[ $name == "${t}_"* ]] && return 1; done
  [ "$STEPS" = all ] && return 0
  for t in ${STEPS//,/ }; do [ "$name" = "$t" ] || [[ $name == "${t}_"* ]] && return 0; done
  return 1
}
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STEP_TABLE"; }  # name status seconds note
STATUS=""

# run_step NAME MAX_SECONDS CMD...: runs CMD under a timeout of min(MAX, budget left), logging to logs/NAME.log;
# sets STATUS to ok, FAILED, TIMEOUT, skipped or unselected.
run_step() {
  local name=$1 max=$2; shift 2
  STATUS=unselected
  selected "$name" || return 0
  local left=$((BUDGET_S - RESERVE_S - SECONDS))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    STATUS=skipped; record "$name" skipped 0 "budget: ${left}s left"; say "$name: skipped (${left}s left)"; return 0
  fi
  if [ -n "${NEEDS_MODULE:-}" ] && ! module_ready; then
    STATUS=skipped; record "$name" skipped 0 "$MODULE_STATE"; say "$name: skipped ($MODULE_STATE)"; return 0
  fi
  local t=$((max < left ? max : left)) log="$WORK/logs/$name.log" start=$SECONDS
  say "$name (limit ${t}s): $*"
  timeout -k 10 "$t" "$@" > "$log" 2>&1
  local rc=$? took=$((SECONDS - start)) note
  note=$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$log" | tail -1 | sed 's/^=* *//; s/ *=*$//')
  if [ "$rc" -eq 0 ]; then
    STATUS=ok
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    STATUS=TIMEOUT; note="killed after ${t}s${note:+; $note}"
  else
    STATUS=FAILED
    [ -n "$note" ] || note="exit $rc: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-160)"
  fi
  record "$name" "$STATUS" "$took" "$note"
  { echo "---- $name: $STATUS in ${took}s (limit ${t}s): $*"; cat "$log"; } >> "$FULL_LOG"
  say "$name: $STATUS in ${took}s ${note:+($note)}"
}

# ---- preflight: what the machine has ----
{
  echo "ShardTensor gpu_check: DEVICE=$DEVICE QUICK=${QUICK:-0} BUDGET_S=$BUDGET_S STEPS=$STEPS" \
       "commit=${COMMIT:-unknown} $(date -u +%FT%TZ)"
  "$PYTHON" - <<'EOF' 2>&1
import platform, sys, torch
cuda = torch.cuda.is_available()
gpu = "no GPU"
if cuda:
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    gpu = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {gib:.0f} GiB"
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), {gpu}")
EOF
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
  fi
  echo "tools: cmake $(version_of "$CMAKE") (${CMAKE:-not found}), ninja $(version_of "$NINJA")," \
       "nvcc $(version_of "$NVCC") (${NVCC:-not found}), c++ $(version_of "$(command -v c++ || true)")," \
       "Python.h: ${PYTHON_H:-MISSING for python $PY_VER}; $(nproc) cores"
} > "$WORK/preflight.txt"
cat "$WORK/preflight.txt" | tee -a "$FULL_LOG"

# ---- build ----
MODULE_STATE=unknown  # unknown (not checked yet), ok, or why the Python steps cannot run
module_ready() {  # checked once, by the first step that needs the package
  if [ "$MODULE_STATE" = unknown ]; then
    if "$PYTHON" -c 'import shardtensor' > "$WORK/logs/import.log" 2>&1; then MODULE_STATE=ok
    else MODULE_STATE="shardtensor does not import: $(tail -1 "$WORK/logs/import.log" | cut -c1-140)"; fi
  fi
  [ "$MODULE_STATE" = ok ]
}
build() {
  local gen=() py_on=ON extra=()
  if [ -z "$CMAKE" ]; then
    echo "no cmake: neither on PATH nor the 'cmake' pip package of $PYTHON (pip install cmake ninja, or carry" \
         "them as wheels)"
    return 3
  fi
  [ -n "$NINJA" ] && gen=(-G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA")
  if [ -z "$PYTHON_H" ]; then
    py_on=OFF
    echo "no Python.h for python $PY_VER (looked in ${PYTHON_INCLUDE:-} $PY_INCLUDE /usr/include/python$PY_VER" \
         "/usr/local/include/python$PY_VER): building the C++ library only; set PYTHON_INCLUDE to a folder with the" \
         "headers of this Python version for the Python module"
  elif [ "$PYTHON_H" != "$PY_INCLUDE" ]; then
    extra+=(-DPython3_INCLUDE_DIR="$PYTHON_H")
  fi
  if [ "$DEVICE" = cuda ]; then
    if [ -z "$NVCC" ]; then
      echo "no nvcc: the CUDA kernels cannot be built (install the CUDA toolkit or put nvcc on PATH)"
      return 3
    fi
    extra+=(-DCMAKE_CUDA_COMPILER="$NVCC" -DSHARDTENSOR_WITH_CUDA=ON)
  fi
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    "$CMAKE" -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PYTHON" \
      -DSHARDTENSOR_BUILD_TESTS=OFF -DSHARDTENSOR_BUILD_BENCHMARKS=OFF -DSHARDTENSOR_BUILD_PYTHON=$py_on \
      "${extra[@]}" || return 1
  fi
  "$CMAKE" --build "$BUILD_DIR" -j "$(nproc)" || return 1
  grep -E '^(SHARDTENSOR_BUILD_PYTHON|Python3_EXECUTABLE|CMAKE_CUDA_COMPILER):' "$BUILD_DIR/CMakeCache.txt"
  grep -o -m1 'arch=compute_[0-9]*,code=sm_[0-9]*' "$BUILD_DIR/build.ninja" "$BUILD_DIR/Makefile" 2>/dev/null | head -1
  [ "$py_on" = ON ] || return 4
  "$PYTHON" -c 'import shardtensor, torch; print("imported", shardtensor.__file__)'
}
export -f build
export CMAKE NINJA NVCC PYTHON PYTHON_H PY_INCLUDE PY_VER DEVICE BUILD_DIR
run_step build 330 bash -c build
if [ "$STATUS" = FAILED ] && grep -q '^no Python.h' "$WORK/logs/build.log"; then
  MODULE_STATE="no Python.h for python $PY_VER: only the C++ library was built"
fi
NEEDS_MODULE=1

# ---- tests ----
PYTEST=("$PYTHON" -m pytest -p no:cacheprovider -v --tb=short -rfE)
CUDA_K=${PYTEST_K:-}
[ -z "$CUDA_K" ] && [ -n "$QUICK" ] && CUDA_K="[1] or [2] or scatter"
export SHARDTENSOR_TEST_DEVICE=$DEVICE
run_step cuda_tests 240 "${PYTEST[@]}" tests/python/test_cuda.py ${CUDA_K:+-k "$CUDA_K"}
run_step kernel_tests 150 "${PYTEST[@]}" tests/python/test_neighborhood_attention.py tests/python/test_point_search.py \
  -k cuda

# ---- benchmarks (several ranks share the GPU: Gloo with host staging; timings contended, memory per rank honest) ----
if [ -n "$QUICK" ]; then RING=(--sizes 64); else RING=(--quick); fi
run_step ring_attention 120 "$PYTHON" benchmarks/ring_attention/bench.py --device "$DEVICE" --ranks 2 "${RING[@]}" \
  --out "$WORK/results"
run_step halo_conv 90 "$PYTHON" benchmarks/halo_conv/bench.py --device "$DEVICE" --ranks 2 --quick \
  --out "$WORK/results"

if [ -n "$QUICK" ]; then WL=(--iters 1 --warmup 0); else WL=(--iters 3 --warmup 1); fi
WL+=(--device "$DEVICE" --out "$WORK/results/workloads" --no-weak)
# workload NAME KIND MAX SIZE...: one launch per size, smallest first; after a failure the larger sizes are skipped.
workload() {
  local wl=$1 kind=$2 max=$3 ranks=() s failed=""
  shift 3
  if [ "$kind" = baseline ]; then ranks=(--rank-counts 1); else ranks=(--ranks 2 --rank-counts 2); fi
  if [ -n "$QUICK" ]; then
    run_step "${wl}_${kind}_quick" "$max" "$PYTHON" "benchmarks/$wl/bench.py" "${WL[@]}" "${ranks[@]}" --quick \
      --tag "${kind}_quick"
    return
  fi
  for s in "$@"; do
    if [ -n "$failed" ]; then
      selected "${wl}_${kind}_$s" && record "${wl}_${kind}_$s" skipped 0 "after $failed"
      continue
    fi
    run_step "${wl}_${kind}_$s" "$max" "$PYTHON" "benchmarks/$wl/bench.py" "${WL[@]}" "${ranks[@]}" --sizes "$s" \
      --tag "${kind}_$s"
    case $STATUS in FAILED | TIMEOUT) failed="${wl}_${kind}_$s $STATUS" ;; esac
  done
}
# Single-device baselines (the T(1) anchors; a training step that does not fit is recorded as OOM).
workload vit baseline 90 1024 2048 4096
workload transolver baseline 90 300000 1200000
workload stormscope baseline 75 256x448 512x896
# Two ranks sharing the GPU: per-rank memory (the correctness check against one device runs first).
workload vit shared2 90 1024
workload transolver shared2 75 100000
workload stormscope shared2 75 256x448

# ---- summary, log, tar ----
BAD=$(awk -F'\t' '$2 == "FAILED" || $2 == "TIMEOUT" {print $1}' "$STEP_TABLE")
{
  cat "$WORK/preflight.txt"
  awk -F'\t' '{n[$2]++} END {printf "result:"; for (s in n) printf " %d %s", n[s], s; print ""}' "$STEP_TABLE"
  printf '%-34s %-8s %7s  %s\n' step status seconds note
  awk -F'\t' '{printf "%-34s %-8s %7s  %s\n", $1, $2, $3, $4}' "$STEP_TABLE"
  if [ -n "$BAD" ]; then
    echo "-- failures (full output: gpu_check.log, results.tar.gz logs/) --"
    for name in $BAD; do
      grep -E '^(FAILED|ERROR) |Error|error:' "$WORK/logs/$name.log" | head -8 | cut -c1-240 | sed "s/^/[$name] /"
    done
  fi
  echo "finished in ${SECONDS}s of ${BUDGET_S}s; full output: gpu_check.log; results and logs: results.tar.gz"
} > "$OUT/summary.txt"
cp "$OUT/summary.txt" "$WORK/summary.txt"
tar czf "$OUT/results.tar.gz" -C "$WORK" summary.txt preflight.txt logs results
rm -rf "$WORK"
echo
cat "$OUT/summary.txt"
[ -z "$BAD" ]
