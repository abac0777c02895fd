#!/usr/bin/env bash
# One-shot GPU check for a lent H200 (≤ 8 minutes): builds flowkit._C with CUDA kernels, runs the GPU-marked
# kernel tests (native CUDA and compiled Triton vs the reference, opcheck, gradcheck) and both benchmarks.
# Writes gpu_check.log, results.csv and PNGs under $OUT (default benchmarks/results/gpu). Run from anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
CSV="$OUT/results.csv"
exec > >(tee -a "$LOG") 2>&1
status=0
step() {  # step NAME TIMEOUT_S CMD...: runs with a time limit, logs the outcome, remembers failures
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc"
  [[ $rc -eq 0 ]] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda); assert torch.cuda.is_available()" || exit 1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
export TORCHINDUCTOR_CACHE_DIR="$OUT/.inductor" TRITON_CACHE_DIR="$OUT/.triton"
step build 170 python setup.py build_ext --inplace -q
step cuda-registered 20 python -c "
import flowkit.kernels.backends as b
assert b.native_has('cuda'), 'flowkit._C has no CUDA kernels'
print('backends for cuda:', b.available_backends('cuda'))"
step gpu-tests 110 python -m pytest tests/kernels -m gpu -q -p no:cacheprovider
step bench-velocity-deviation 90 python benchmarks/bench_velocity_deviation.py --device cuda \
  --sizes 8192x1536,32768x4096 --path-sizes 1024x512,8192x1536 --train --epilogue --reps 20 --csv "$CSV"
step bench-flow-attention 40 python benchmarks/bench_flow_attention.py --device cuda --csv "$CSV"
step bench-flow-attention-bwd 30 python benchmarks/bench_flow_attention.py --device cuda --backward --reps 5 --csv "$CSV"
step plot 15 python benchmarks/plot.py --csv "$CSV" --out "$OUT"
rm -rf "$OUT/.inductor" "$OUT/.triton"
echo "gpu_check finished with status $status; log $LOG, CSV $CSV"
exit $status
