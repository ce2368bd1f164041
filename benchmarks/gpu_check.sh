#!/usr/bin/env bash
# One script for a single-GPU machine (target: under 8 minutes): build, run the CUDA tests (several ranks share
# the GPU over Gloo with host staging), the single-device baselines of the three workloads at large sizes and
# their per-rank memory with several ranks sharing the GPU, then the CUDA micro-benchmarks; results land in $OUT
# (default benchmarks/results/local/gpu_check, git-ignored).
#   bash benchmarks/gpu_check.sh
# Every step is skipped once the 8-minute budget cannot hold it (BUDGET_S, default 470 s), so the script
# always ends in time with what it has.
# Dry run of the workload steps on the CPU with CI sizes (checks every python command line works):
#   DEVICE=cpu QUICK=1 SKIP_BUILD=1 bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/local/gpu_check}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-}
BUDGET_S=${BUDGET_S:-470}
PY=${PY:-.venv/bin/python}
WL_OUT="$OUT/workloads"
mkdir -p "$OUT" "$WL_OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/gpu_check.log"; }
# run_step NAME MAX_SECONDS CMD...: runs CMD under a timeout of min(MAX, time left), or skips it.
run_step() {
  local name=$1 max=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 30 ]; then log "skip $name (${left}s left of ${BUDGET_S}s)"; return 0; fi
  local t=$((max < left ? max : left))
  log "$name (timeout ${t}s, ${SECONDS}s elapsed)"
  timeout "$t" "$@" 2>&1 | grep -v "case/s" | tail -25 | tee -a "$OUT/gpu_check.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || log "$name: exit code $rc"
}
# Large sizes on the GPU; the CLIs' CI sizes under QUICK=1 (for the dry run on CPU).
q() { if [ -n "$QUICK" ]; then echo --quick; else echo "$@"; fi; }
WL=(--device "$DEVICE" --out "$WL_OUT" --iters 3 --warmup 1)

if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_check.log"
fi
if [ -z "${SKIP_BUILD:-}" ]; then
  log "build"
  timeout 300 make build > "$OUT/gpu_build.log" 2>&1 || { tail -40 "$OUT/gpu_build.log"; exit 1; }
fi
if [ "$DEVICE" = cuda ]; then
  run_step "CUDA tests" 150 "$PY" -m pytest -q tests/python/test_cuda.py
  run_step "neighbourhood attention and point search CUDA kernels (first GPU run)" 90 "$PY" -m pytest -q \
    tests/python/test_neighborhood_attention.py tests/python/test_point_search.py -k cuda
fi

# Single-device baselines (the paper's T(1) anchors): ViT inference to 4096^2 and training to 2048^2 (4096^2
# training is recorded as OOM), Transolver to 1.2M points, the StormScope DiT (its `small` config on larger grids).
run_step "ViT single-device baselines" 120 "$PY" benchmarks/vit/bench.py "${WL[@]}" --rank-counts 1 --no-weak \
  $(q --sizes 1024,2048,4096) --tag baseline
run_step "Transolver single-device baselines" 90 "$PY" benchmarks/transolver/bench.py "${WL[@]}" --rank-counts 1 \
  --no-weak $(q --sizes 300000,1200000) --tag baseline
run_step "StormScope single-device baselines" 75 "$PY" benchmarks/stormscope/bench.py "${WL[@]}" --rank-counts 1 \
  --no-weak $(q --sizes 256x448,512x896) --tag baseline
# Per-rank memory with 2 ranks sharing the GPU (Gloo, host-staged collectives; the correctness check runs first
# on the GPU). Timings here are contended: the reports mark them, never read them as speed-ups.
run_step "ViT 2 ranks on one GPU" 75 "$PY" benchmarks/vit/bench.py "${WL[@]}" --ranks 2 --rank-counts 2 --no-weak \
  $(q --sizes 2048) --tag shared2
run_step "Transolver 2 ranks on one GPU" 60 "$PY" benchmarks/transolver/bench.py "${WL[@]}" --ranks 2 --rank-counts 2 \
  --no-weak $(q --sizes 300000) --tag shared2
run_step "StormScope 2 ranks on one GPU" 60 "$PY" benchmarks/stormscope/bench.py "${WL[@]}" --ranks 2 --rank-counts 2 \
  --no-weak $(q --sizes 512x896) --tag shared2
tar czf "$OUT/workloads.tar.gz" -C "$WL_OUT" . 2>/dev/null || true
# A device run brings back only a few files from $OUT: keep the tarball, drop the folder (kept in the repo default).
[ -n "${KEEP_WL_DIR:-}" ] || rm -rf "$WL_OUT"

if [ "$DEVICE" = cuda ]; then
  run_step "halo conv, 2 ranks on one GPU" 60 "$PY" benchmarks/halo_conv/bench.py --device cuda --ranks 2 --quick --out "$OUT"
  run_step "ring attention, 2 ranks on one GPU" 60 "$PY" benchmarks/ring_attention/bench.py --device cuda --ranks 2 --quick --out "$OUT"
fi
log "done in ${SECONDS}s"
