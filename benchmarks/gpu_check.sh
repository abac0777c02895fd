#!/usr/bin/env bash
# One-shot GPU check for a lent H200 (≤ 8 minutes): builds flowkit._C with CUDA kernels, runs the GPU-marked
# kernel tests (native CUDA and compiled Triton vs the reference, opcheck, gradcheck) and both benchmarks; the RL
# scale rehearsal at the end adds up to 7 minutes (one device session of 15 cannot hold everything: see its block).
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
step build 150 python setup.py build_ext --inplace -q
step cuda-registered 20 python -c "
import flowkit.kernels.backends as b
assert b.native_has('cuda'), 'flowkit._C has no CUDA kernels'
print('backends for cuda:', b.available_backends('cuda'))"
step gpu-tests 90 python -m pytest tests/kernels -m gpu -q -p no:cacheprovider
step bench-velocity-deviation 140 python benchmarks/bench_velocity_deviation.py --device cuda \
  --sizes 8192x1536,32768x4096 --path-sizes 1024x512,8192x1536 --train --epilogue --reps 20 --csv "$CSV"
step bench-velocity-deviation-one-call 40 python benchmarks/bench_velocity_deviation.py --device cuda \
  --sizes 8192x1536,32768x4096 --path-sizes "" --impls native,triton --max-rows 0 --reps 20 --csv "$CSV"
step bench-flow-attention 35 python benchmarks/bench_flow_attention.py --device cuda --csv "$CSV"
step bench-flow-attention-bwd 25 python benchmarks/bench_flow_attention.py --device cuda --backward --reps 5 --csv "$CSV"
step plot 15 python benchmarks/plot.py --csv "$CSV" --out "$OUT"

# ---- DeepSpeed bf16 (issue 6; added by the fault-tolerance engineer, separate from the kernel checks) ----
# The tiny RLFR config for 3 steps under GPU DeepSpeed ZeRO-2 in bf16, then the sharded checkpoint exported.
# The GPU image lacks deepspeed: carry its wheel and pure-Python deps in build/wheels (run with
# carry=["build/wheels"]; fill it with `pip download --no-deps -d build/wheels deepspeed==0.19.8 hjson
# py-cpuinfo einops`); msgpack must already be installed there.
if ! python -c "import deepspeed" 2>/dev/null; then
  step deepspeed-install 45 python -m pip install -q --no-deps --no-index --find-links build/wheels \
    deepspeed hjson py-cpuinfo einops
fi
DS_RUN="$OUT/deepspeed"
step deepspeed-bf16-fit 100 flowkit fit --config configs/rlfr_tiny.yaml --trainer.accelerator gpu \
  --trainer.devices 1 --trainer.precision bf16-mixed --trainer.max_steps 3 --trainer.enable_progress_bar false \
  --trainer.strategy flowkit.strategies.FlowkitDeepSpeedStrategy \
  --trainer.strategy.config configs/deepspeed/zero2.json --model.init_args.flow_pretrain_steps 10 \
  --trainer.default_root_dir "$DS_RUN" --trainer.logger.init_args.save_dir "$DS_RUN/runs"
step deepspeed-export 45 flowkit export --config configs/rlfr_tiny.yaml \
  --checkpoint "$DS_RUN/runs/rlfr_tiny/version_0/checkpoints/last.ckpt" --out "$DS_RUN/export"
# ---- end of the DeepSpeed block ----

# ---- RL scale rehearsal (issue 10; added by the benchmarks engineer) ----
# Random-weight Qwen2.5-1.5B-shaped policy (built from a config, no download), bf16, HF rollouts, RLFR flow reward:
# 2 RL steps of 64 prompts x 8 samples x 1024 new tokens, micro-batch 8, one generate call of 512 sequences.
# Prints the step-time breakdown (generate / update incl. flow token rewards / flow) and the peak GPU memory.
# It needs most of a device session by itself: alone it is
#   python benchmarks/bench_rl_scale.py --csv benchmarks/results/gpu/results.csv
# and on CPU the same path runs at toy size with --shape toy --device cpu --dtype float32 (see its docstring).
step rl-scale-rehearsal 420 python benchmarks/bench_rl_scale.py --micro-batch-size 8 --rollout-batch-size 512 \
  --csv "$CSV"
# ---- end of the scale rehearsal ----

rm -rf "$OUT/.inductor" "$OUT/.triton"
echo "gpu_check finished with status $status; log $LOG, CSV $CSV"
exit $status
