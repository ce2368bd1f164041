#!/usr/bin/env bash
# Build and run both dispatch-overhead benchmarks and write dispatch_overhead{_cpp.txt,.json,.md} into --out DIR
# (default benchmarks/results/local, git-ignored; --out benchmarks/results updates the committed results, which
# needs a clean tree or --snapshot).
#
#   benchmarks/dispatch_overhead/run.sh             # the working tree: cmake -S . -B build-bench
#   benchmarks/dispatch_overhead/run.sh --snapshot  # committed HEAD: git archive into build-bench/head
#   benchmarks/dispatch_overhead/run.sh --snapshot --reuse   # measure the existing snapshot build again
#   benchmarks/dispatch_overhead/run.sh --snapshot --out benchmarks/results   # update the committed results
#
# Working tree: the C++ bench is built in build-bench (Python module off, so python/shardtensor, which the main
# `build` owns, is not touched); the Python bench imports python/shardtensor as built by `make build`.
# --snapshot: HEAD (plus this folder's bench sources) is exported to build-bench/head and built, Python module
# included, into build-bench/head-build; both benchmarks measure that build. Use it while src/ is being edited.
# Short runs (about a minute on 2 cores); torch intra-op threads = 1.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
export PATH=$ROOT/.venv/bin:$PATH
snapshot=0 reuse=0 RESULTS=benchmarks/results/local
args=("$@")
while [ $# -gt 0 ]; do
  case $1 in
    --snapshot) snapshot=1 ;;
    --reuse) reuse=1 ;;
    --out) RESULTS=${2:?--out needs a directory}; shift ;;
    *) echo "usage: $0 [--snapshot [--reuse]] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
set -- "${args[@]}"
# Created here, and refused up front for the committed results from a dirty working tree.
"$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import results_dir; results_dir.prepare(sys.argv[1], measures_a_snapshot=sys.argv[2] == '1')" "$RESULTS" "$snapshot"
commit=$(git rev-parse HEAD)

if [ $snapshot = 1 ]; then
  SRC=build-bench/head BLD=build-bench/head-build
  if [ $reuse = 1 ] && [ -f "$SRC/COMMIT" ]; then
    commit=$(cat "$SRC/COMMIT")
  else
    rm -rf "$SRC" && mkdir -p "$SRC"
    git archive HEAD | tar -x -C "$SRC"
    echo "$commit" > "$SRC/COMMIT"
  fi
  cp benchmarks/dispatch_overhead/CMakeLists.txt benchmarks/dispatch_overhead/bench.cpp "$SRC/benchmarks/dispatch_overhead/"
  build=("cmake -S $SRC -B $BLD -G Ninja -DPython3_EXECUTABLE=$PY -DSHARDTENSOR_BUILD_TESTS=OFF"
         "cmake --build $BLD --target shardtensor_python dispatch_overhead_bench")
  pypath=$SRC/python
  commit_arg=(--commit "$commit")
  note="Measured on a snapshot of commit ${commit:0:10} (\`git archive HEAD\` into $SRC, built in $BLD); the Python run imports that build."
else
  SRC=. BLD=build-bench
  build=("cmake -S . -B $BLD -G Ninja -DPython3_EXECUTABLE=$PY -DSHARDTENSOR_BUILD_PYTHON=OFF -DSHARDTENSOR_BUILD_TESTS=OFF"
         "cmake --build $BLD --target dispatch_overhead_bench")
  pypath=
  commit_arg=()
  note="Measured on the working tree (C++ in $BLD; Python imports python/shardtensor as built by \`make build\`)."
fi
for c in "${build[@]}"; do echo "+ $c"; eval "$c" > /dev/null; done

cmd="$BLD/benchmarks/dispatch_overhead/dispatch_overhead_bench --benchmark_min_time=0.2 --benchmark_repetitions=5 --torch_threads=1"
echo "+ $cmd"
{
  echo "# command: $cmd"
  for c in "${build[@]}"; do echo "# build: $c"; done | sed "s#$ROOT/#\$PWD/#g"
  echo "# library commit: $commit$([ $snapshot = 0 ] && [ -n "$(git status --porcelain -- src include)" ] && echo ' + uncommitted changes')"
  echo "# date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); nproc: $(nproc); cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); torch $($PY -c 'import torch;print(torch.__version__)')"
  echo "# Google Benchmark $(dpkg-query -W -f='${Version}' libbenchmark-dev 2>/dev/null || echo '?'): a 'Library was built as DEBUG' warning below is about that library's own build; libshardtensor is Release"
  $cmd 2>&1
} > "$RESULTS/dispatch_overhead_cpp.txt"
sed -n '/^Summary/,$p' "$RESULTS/dispatch_overhead_cpp.txt"

echo "+ python bench"
PYTHONPATH=$pypath "$PY" benchmarks/dispatch_overhead/bench.py --threads 1 --md --out "$RESULTS" "${commit_arg[@]}" \
  --driver "benchmarks/dispatch_overhead/run.sh $*" --note "$note"
