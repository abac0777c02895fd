#!/usr/bin/env bash
# Compile-checks every csrc/**/*.cu to an object with nvcc and torch's include dirs (no link, no GPU needed).
# The kernels include only c10/cuda headers (a CPU torch ships them; ATen/cuda/CUDAContext.h would need cuSPARSE
# and cuBLAS headers that a bare nvcc toolkit lacks), so the full sources are checked; a CPU torch lacks the
# generated c10/cuda/impl/cuda_cmake_macros.h (export macros only), hence C10_CUDA_NO_CMAKE_CONFIGURE_FILE; the
# objects are discarded. Usage: csrc/check_cuda_compile.sh [extra nvcc flags]; exits non-zero on the first error.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then echo "nvcc not found; nothing checked" >&2; exit 2; fi
mapfile -t INCLUDES < <(python -c "
import sysconfig
from torch.utils.cpp_extension import include_paths
for p in include_paths() + [sysconfig.get_paths()['include']]: print('-I' + p)")
OUT_DIR="$(mktemp -d)"
trap 'rm -rf "$OUT_DIR"' EXIT
status=0
while IFS= read -r src; do
  echo "nvcc -c $src"
  if ! "$NVCC" -c "$src" -o "$OUT_DIR/$(basename "$src").o" -std=c++20 -O1 --use_fast_math -arch=sm_90 \
      --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
      -DFLOWKIT_WITH_CUDA -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -D_GLIBCXX_USE_CXX11_ABI=1 -Xcompiler -fPIC "${INCLUDES[@]}" "$@"; then
    status=1
  fi
done < <(find csrc -name '*.cu' | sort)
exit $status
