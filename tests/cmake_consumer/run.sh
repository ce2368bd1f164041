#!/usr/bin/env bash
# Install a built ShardTensor tree into a temporary prefix, build tests/cmake_consumer against it with
# find_package(ShardTensor CONFIG) and run the result. Registered as the ctest test cmake_package_consumer.
#
#   run.sh PYTHON BUILD_DIR [GENERATOR] [CMAKE] [CXX_COMPILER]
#
# PYTHON: the interpreter whose torch the project was built against; BUILD_DIR: the configured and built
# project. The consumer finds libshardtensor and libtorch through the RPATH CMake gives it (no LD_LIBRARY_PATH).
set -euo pipefail

PYTHON=${1:?usage: run.sh PYTHON BUILD_DIR [GENERATOR] [CMAKE] [CXX_COMPILER]}
BUILD_DIR=${2:?usage: run.sh PYTHON BUILD_DIR [GENERATOR] [CMAKE] [CXX_COMPILER]}
GENERATOR=${3:-Ninja}
CMAKE=${4:-cmake}
CXX_COMPILER=${5:-}
SRC_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardtensor-consumer.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PREFIX=$WORK/prefix

echo "-- installing $BUILD_DIR into $PREFIX"
"$CMAKE" --install "$BUILD_DIR" --prefix "$PREFIX" > "$WORK/install.log" || { cat "$WORK/install.log"; exit 1; }

# The install tree: headers, the library, the CMake package.
LIBDIR=$PREFIX/lib
[[ -d $PREFIX/lib64 ]] && LIBDIR=$PREFIX/lib64 # GNUInstallDirs on some distributions
for f in include/shardtensor/shard_tensor.h include/shardtensor/mesh.h include/shardtensor/spec.h \
         include/shardtensor/placement.h include/shardtensor/comm_stats.h include/shardtensor/handler_registry.h; do
  [[ -f $PREFIX/$f ]] || { echo "missing from the install tree: $f"; exit 1; }
done
for f in libshardtensor.so cmake/ShardTensor/ShardTensorConfig.cmake cmake/ShardTensor/ShardTensorConfigVersion.cmake \
         cmake/ShardTensor/ShardTensorTargets.cmake; do
  [[ -f $LIBDIR/$f ]] || { echo "missing from the install tree: ${LIBDIR#$PREFIX/}/$f"; exit 1; }
done
ls "$LIBDIR"/cmake/ShardTensor/ShardTensorTargets-*.cmake > /dev/null

TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')

# Torch's CMake config: no GPU to detect at configure time, and the local CUDA toolkit (as the top-level build).
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
ARGS=(-G "$GENERATOR" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$PREFIX;$TORCH_PREFIX")
[[ -n $CXX_COMPILER ]] && ARGS+=("-DCMAKE_CXX_COMPILER=$CXX_COMPILER")
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  ARGS+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCUDAToolkit_ROOT=/usr/local/cuda)
fi
if command -v ccache > /dev/null; then ARGS+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

echo "-- configuring the consumer"
"$CMAKE" -S "$SRC_DIR" -B "$WORK/build" "${ARGS[@]}" > "$WORK/configure.log" 2>&1 || { cat "$WORK/configure.log"; exit 1; }
echo "-- building the consumer"
"$CMAKE" --build "$WORK/build" > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }

echo "-- running the consumer"
"$WORK/build/consumer"
