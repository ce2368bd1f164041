#!/usr/bin/env bash
# One script for a single-GPU machine (target: under 8 minutes): build, run the CUDA tests (several ranks share
# the GPU over Gloo with host staging), then the CUDA benchmarks; results land in $OUT (or benchmarks/results).
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
log() { echo "== $*" | tee -a "$OUT/gpu_check.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_check.log"
log "build"
timeout 300 make build > "$OUT/gpu_build.log" 2>&1 || { tail -40 "$OUT/gpu_build.log"; exit 1; }
log "CUDA tests"
timeout 240 .venv/bin/python -m pytest -q tests/python/test_cuda.py 2>&1 | tail -20 | tee -a "$OUT/gpu_check.log"
log "neighbourhood attention CUDA kernel (first GPU run)"
timeout 240 .venv/bin/python -m pytest -q tests/python/test_neighborhood_attention.py -k cuda 2>&1 | tail -20 | tee -a "$OUT/gpu_check.log"
log "halo conv, 2 ranks on one GPU"
timeout 240 .venv/bin/python benchmarks/halo_conv/bench.py --device cuda --ranks 2 --quick 2>&1 | tail -12 | tee -a "$OUT/gpu_check.log"
log "ring attention, 2 ranks on one GPU"
timeout 240 .venv/bin/python benchmarks/ring_attention/bench.py --device cuda --ranks 2 --quick 2>&1 | tail -12 | tee -a "$OUT/gpu_check.log"
cp benchmarks/results/*cuda* "$OUT"/ 2>/dev/null || true
log "done"
