#!/usr/bin/env bash
# Developer build of sparktune._C in place (no pip): tools/devbuild.sh [ARCHS] [KERNEL_PATTERNS] [PYTHON]
# Builds the m8n8k4 (Volta) family for newer GPUs too, so that it can be tested there.
# e.g. tools/devbuild.sh 90 'fwd_sm80_f16_d128_*' python3.12   -> sparktune/_C.*.so
set -euo pipefail
cd "$(dirname "$0")/.."
archs=${1:-auto}
filter=${2:-}
py=${3:-python3}
pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
bdir=build/dev-py${pyver}-${archs//;/_}
extra=()
if [ -n "${CUTLASS_INCLUDE:-}" ]; then extra+=("-DCUTLASS_INCLUDE=$CUTLASS_INCLUDE"); fi
if [ -n "${PYBIND11_DIR:-}" ]; then extra+=("-Dpybind11_DIR=$PYBIND11_DIR"); fi
cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARKTUNE_CUDA_ARCHS="$archs" \
  -DSPARKTUNE_KERNELS="$filter" -DPython_EXECUTABLE="$(command -v "$py")" -DSPARKTUNE_REQUIRE_CUDA=ON -DSPARKTUNE_VOLTA_EMULATED=ON "${extra[@]}"
cmake --build "$bdir" -j "${JOBS:-$(nproc)}"
cp "$bdir"/_C*.so sparktune/
ls -la sparktune/_C*.so
