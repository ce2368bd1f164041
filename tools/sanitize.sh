#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer: build the library, the Python module and the GoogleTests in their
# own build folder (precompiled headers and ccache as in the normal build), then run the GoogleTests and a Python
# subset under the sanitizers. Not part of `make test` (an hour's budget on 2 cores; docs/testing.md has the last
# result). Needs `make build` once (for .venv).
#
#   tools/sanitize.sh                      # GoogleTests + the default Python subset
#   tools/sanitize.sh tests/python/test_io.py -k roundtrip    # GoogleTests + the given pytest arguments
#
# BUILD_DIR (default build-asan). The sanitized package is assembled in $BUILD_DIR/python/shardtensor (the source
# tree's Python files linked, the sanitized _C and libshardtensor built there), so the development build is untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
[[ -x $PY ]] || { echo "no .venv: run make build first"; exit 1; }
BUILD=$ROOT/${BUILD_DIR:-build-asan}
PKG=$BUILD/python/shardtensor
SUBSET=(tests/python/test_fft_sharded.py tests/python/test_fallback.py tests/python/test_io.py
        tests/python/test_halo_plan.py tests/python/test_conv.py tests/python/test_pool.py
        tests/python/test_attention.py tests/python/test_neighborhood_attention.py)
[[ $# -gt 0 ]] && SUBSET=("$@")

start=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - start )) s so far)"; }

# The package's Python files, linked into the sanitized package folder (new files appear on every run).
mkdir -p "$PKG"
(cd python/shardtensor && find . -name '*.py' -not -name '_build_info.py') | while read -r f; do
  mkdir -p "$PKG/$(dirname "$f")"
  ln -sfn "$ROOT/python/shardtensor/$f" "$PKG/$f"
done

stamp "configuring $BUILD (ASan + UBSan)"
export PATH=$ROOT/.venv/bin:$PATH
if [[ ! -f $BUILD/build.ninja ]]; then
  cmake -S . -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$PY" -DSHARDTENSOR_SANITIZE=ON -DCMAKE_CXX_FLAGS=-g1 \
    -DSHARDTENSOR_PACKAGE_DIR="$PKG" -DSHARDTENSOR_BUILD_BENCHMARKS=OFF > "$BUILD.configure.log" 2>&1 ||
    { cat "$BUILD.configure.log"; exit 1; }
fi
stamp "building"
cmake --build "$BUILD"

# The sanitizers' runtimes must load before anything else in a Python process (the interpreter is not instrumented);
# CUDA's runtime needs the shadow gap unprotected. Leaks are not checked: torch and Python keep allocations alive on
# purpose at exit. Any ASan report or UBSan finding aborts the process (-fno-sanitize-recover), failing the test.
ASAN_RT=$(gcc -print-file-name=libasan.so)
UBSAN_RT=$(gcc -print-file-name=libubsan.so)
export ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0:abort_on_error=1:print_summary=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

stamp "GoogleTests under the sanitizers"
(cd "$BUILD" && ctest --output-on-failure -LE "package|cuda")

stamp "Python subset under the sanitizers: ${SUBSET[*]}"
LD_PRELOAD="$ASAN_RT:$UBSAN_RT" PYTHONPATH="$BUILD/python" SHARDTENSOR_TEST_TIMEOUT=${SHARDTENSOR_TEST_TIMEOUT:-900} \
  "$PY" -m pytest -q -p no:cacheprovider "${SUBSET[@]}"
stamp "done: no sanitizer finding"
