#!/usr/bin/env bash
# GPU check for a lent H200, in blocks that run alone or together; one failing step fails its block, never the others.
#
#   bash benchmarks/gpu_check.sh [--dry-run] [kernels|rehearsal|deepspeed|all]...   (default: all)
#   bash benchmarks/gpu_check.sh download        # on a machine with internet: fill build/wheels (see WHEELS)
#
# setup, before the first block (seconds when repeated on a warm machine): nvidia-smi and torch.cuda, nvcc, the
#   packages of WHEELS the machine lacks (from build/wheels: it is offline), flowkit itself (pip install --no-deps -e .
#   with FLOWKIT_BUILD_NATIVE=0), then the one build of flowkit._C with its CUDA kernels (setup.py build_ext
#   --inplace; ninja rebuilds only what changed). ≤ 7.7 minutes in its limits.
# kernels (≤ 7.5 min): the GPU-marked kernel tests (native CUDA and Triton vs the reference, opcheck, gradcheck) and the
#   kernel benchmarks, rows appended to results.csv (draw them here: python benchmarks/plot.py --csv results.csv).
# rehearsal (≤ 7.5 min): the RL scale rehearsal (bench_rl_scale.py: a random 1.5B-shaped Qwen2, 2 RL steps of
#   64 prompts x 8 x 1024 tokens, step phases and peak memory), then configs/rlfr_qwen.yaml as shipped on 1 GPU
#   (ZeRO-3, bf16-mixed) with the bundled tiny model and data, HF rollouts, short lengths, 3 steps and the export.
# deepspeed (≤ 5 min): the tiny RLFR config for 3 steps under GPU DeepSpeed ZeRO-2 in bf16, then `flowkit export`
#   of its sharded checkpoint.
# build/wheels is git-ignored: a machine that receives the checkout needs it copied along (a device tool that sends
# the working tree: carry=["build/wheels"]). Starting one block per call keeps each call short; a second call on the
# same machine finds the packages installed and flowkit._C built.
# Writes under $OUT (default benchmarks/results/gpu): gpu_check.log, results.csv, status.txt (one line per block);
# scratch (runs, compiler caches) under build/gpu_check. Exit status 0 only when every block passed.
set -uo pipefail
cd "$(dirname "$0")/.."

# Python packages the GPU image lacks or may lack, pinned to the versions CI runs: pytest (kernels), flowkit's own
# dependencies that the image lacks (jsonargparse for `flowkit fit`, math-verify for the `official` outcome reward,
# gymnasium: `import flowkit.modules` needs it), deepspeed with its dependencies (rehearsal, deepspeed).
# Pure-Python wheels except pydantic_core (CPython 3.12, the image's Python); deepspeed is an sdist, built there
# without ops (DeepSpeed JIT-compiles the ops it needs).
WHEELS=(pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 packaging==26.2 pygments==2.20.0
        jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
        gymnasium==1.4.0 farama-notifications==0.0.6
        hjson==3.1.0 py-cpuinfo==9.0.0 einops==0.8.2 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0
        typing-inspection==0.4.2)
SDISTS=(deepspeed==0.19.8)
WHEEL_DIR="${GPU_CHECK_WHEELS:-build/wheels}"
PYTHON="${PYTHON:-python3}"

if [[ "${1:-}" == download ]]; then
  set -e
  mkdir -p "$WHEEL_DIR"
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEEL_DIR" "${WHEELS[@]}"
  "$PYTHON" -m pip download --no-deps --no-binary=:all: --no-build-isolation -d "$WHEEL_DIR" "${SDISTS[@]}"
  du -sh "$WHEEL_DIR"
  exit 0
fi

DRY_RUN=0
BLOCKS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    all) BLOCKS+=(kernels rehearsal deepspeed) ;;
    kernels | rehearsal | deepspeed) BLOCKS+=("$arg") ;;
    *) echo "usage: $0 [--dry-run] [kernels|rehearsal|deepspeed|all]...  |  $0 download" >&2; exit 2 ;;
  esac
done
[[ ${#BLOCKS[@]} -gt 0 ]] || BLOCKS=(kernels rehearsal deepspeed)

OUT="${OUT:-benchmarks/results/gpu}"
WORK="${GPU_CHECK_WORK:-$PWD/build/gpu_check}"
CSV="$OUT/results.csv"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" TRITON_CACHE_DIR="$WORK/triton"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [[ $DRY_RUN -eq 0 ]]; then
  mkdir -p "$OUT" "$WORK"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi

declare -A FAILED=()  # block -> its failed steps
step() {  # step BLOCK NAME LIMIT_S CMD...: runs CMD under a time limit; a failure marks BLOCK failed and goes on
  local block=$1 name=$2 limit=$3
  shift 3
  if [[ $DRY_RUN -eq 1 ]]; then
    echo "  $block/$name (limit ${limit}s): $(printf '%q ' "$@")"
    return 0
  fi
  echo "=== $block/$name ($(date -u +%H:%M:%S), limit ${limit}s)"
  timeout --kill-after=15 "$limit" "$@"
  local rc=$?
  if [[ $rc -eq 0 ]]; then
    echo "=== $block/$name: ok"
  else
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
      echo "=== $block/$name: timed out after ${limit}s"
    else
      echo "=== $block/$name: failed (rc=$rc)"
    fi
    FAILED[$block]+=" $name"
  fi
}

# The setup's checks run as `bash -c NAME` under `timeout`, so they are exported functions reading exported values.
check_gpu() {
  if ! command -v nvidia-smi >/dev/null; then
    echo "nvidia-smi not found: this machine has no NVIDIA driver" >&2
    return 1
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || return 1
  "$PYTHON" -c "
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda)
assert torch.cuda.is_available(), 'torch sees no CUDA device'"
}

find_nvcc() {  # where the CUDA build will look for nvcc (torch.utils.cpp_extension: CUDA_HOME, PATH, /usr/local/cuda)
  local nvcc
  for nvcc in "${CUDA_HOME:-}/bin/nvcc" "$(command -v nvcc)" /usr/local/cuda/bin/nvcc; do
    if [[ -x "$nvcc" ]]; then
      "$nvcc" --version | tail -n 1
      return 0
    fi
  done
  echo "nvcc not found (CUDA_HOME, PATH, /usr/local/cuda): flowkit._C gets no CUDA kernels, so the kernels block" \
    "fails and the other blocks run on Triton; install the CUDA toolkit or set CUDA_HOME" >&2
  return 1
}

install_wheels() {  # the packages of WHEELS and SDISTS this Python lacks, from $WHEEL_DIR only
  local specs missing
  read -ra specs <<<"$GPU_CHECK_PACKAGES"
  mapfile -t missing < <("$PYTHON" - "${specs[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for spec in sys.argv[1:]:
    try:
        version(spec.split("==")[0])
    except PackageNotFoundError:
        print(spec)
EOF
  )
  if [[ ${#missing[@]} -eq 0 ]]; then
    echo "every package of WHEELS and SDISTS is installed"
    return 0
  fi
  if [[ ! -d "$WHEEL_DIR" ]]; then
    echo "missing ${missing[*]}, and there is no $WHEEL_DIR: run 'bash benchmarks/gpu_check.sh download' on a" \
      "machine with internet and carry build/wheels" >&2
    return 1
  fi
  echo "installing from $WHEEL_DIR: ${missing[*]}"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --find-links "$WHEEL_DIR" "${missing[@]}"
}
export -f check_gpu find_nvcc install_wheels
export PYTHON WHEEL_DIR GPU_CHECK_PACKAGES="${WHEELS[*]} ${SDISTS[*]}"

setup() {
  echo "--- setup"
  step setup gpu 30 bash -c check_gpu
  step setup nvcc 10 bash -c find_nvcc
  step setup wheels 120 bash -c install_wheels
  step setup install-flowkit 60 env FLOWKIT_BUILD_NATIVE=0 "$PYTHON" -m pip install -q --no-deps --no-build-isolation \
    -e .
  step setup build 240 "$PYTHON" setup.py -q build_ext --inplace
}

kernels() {
  echo "--- kernels"
  step kernels cuda-registered 60 "$PYTHON" -c "
import flowkit.kernels.backends as b
assert b.native_has('cuda'), 'flowkit._C has no CUDA kernels (see setup/nvcc and setup/build)'
print('backends for cuda:', b.available_backends('cuda'))"
  step kernels gpu-tests 150 "$PYTHON" -m pytest tests/kernels -m gpu -q -p no:cacheprovider
  step kernels bench-velocity-deviation 140 "$PYTHON" benchmarks/bench_velocity_deviation.py --device cuda \
    --sizes 8192x1536,32768x4096 --path-sizes 1024x512,8192x1536 --train --epilogue --reps 20 --csv "$CSV"
  step kernels bench-velocity-deviation-one-call 40 "$PYTHON" benchmarks/bench_velocity_deviation.py --device cuda \
    --sizes 8192x1536,32768x4096 --path-sizes "" --impls native,triton --max-rows 0 --reps 20 --csv "$CSV"
  step kernels bench-flow-attention 35 "$PYTHON" benchmarks/bench_flow_attention.py --device cuda --csv "$CSV"
  step kernels bench-flow-attention-bwd 25 "$PYTHON" benchmarks/bench_flow_attention.py --device cuda --backward \
    --reps 5 --csv "$CSV"
}

rehearsal() {
  echo "--- rehearsal"
  # Prints each step as it ends, so a run stopped at its limit still shows the finished steps.
  step rehearsal rl-scale 300 "$PYTHON" benchmarks/bench_rl_scale.py --micro-batch-size 8 --rollout-batch-size 512 \
    --csv "$CSV"
  # The paper's job as shipped, but for what one GPU without vLLM and a 1 M-parameter model need: the bundled tiny
  # model and its data (bare prompts: it was trained on them), HF rollouts, 28 new tokens, 16 prompts, 3 steps, κ 8 so
  # that the online flow step runs.
  [[ $DRY_RUN -eq 1 ]] || rm -rf "$WORK/rlfr_qwen"
  step rehearsal rlfr-qwen-config 150 "$PYTHON" -m flowkit fit --config configs/rlfr_qwen.yaml --trainer.devices 1 \
    --trainer.max_steps 3 --trainer.enable_progress_bar false --trainer.default_root_dir "$WORK/rlfr_qwen" \
    --model.init_args.backbone bundled:tiny_adder --model.init_args.rollout_engine hf \
    --model.init_args.max_new_tokens 28 --model.init_args.reward_model.init_args.kappa 8 \
    --data.init_args.train_path bundled:arithmetic/train.jsonl --data.init_args.eval_paths '{}' \
    --data.init_args.prompt_key prompt --data.init_args.prompt_template '{prompt}' --data.init_args.batch_size 16
}

deepspeed() {
  echo "--- deepspeed"
  local run="$WORK/deepspeed"
  [[ $DRY_RUN -eq 1 ]] || rm -rf "$run"
  step deepspeed bf16-fit 240 "$PYTHON" -m flowkit fit --config configs/rlfr_tiny.yaml --trainer.accelerator gpu \
    --trainer.devices 1 --trainer.precision bf16-mixed --trainer.max_steps 3 --trainer.enable_progress_bar false \
    --trainer.strategy flowkit.strategies.FlowkitDeepSpeedStrategy \
    --trainer.strategy.config configs/deepspeed/zero2.json --model.init_args.flow_pretrain_steps 10 \
    --trainer.default_root_dir "$run"
  step deepspeed export 60 "$PYTHON" -m flowkit export --config configs/rlfr_tiny.yaml \
    --checkpoint "$run/checkpoints/last.ckpt" --out "$run/export"
}

echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ): blocks ${BLOCKS[*]}; results under $OUT"
setup
for block in "${BLOCKS[@]}"; do
  start=$SECONDS
  "$block"
  [[ $DRY_RUN -eq 1 ]] || echo "--- $block took $((SECONDS - start)) s"
done
[[ $DRY_RUN -eq 1 ]] && exit 0

{
  for block in setup "${BLOCKS[@]}"; do
    if [[ -n "${FAILED[$block]:-}" ]]; then echo "$block: FAILED (${FAILED[$block]# })"; else echo "$block: ok"; fi
  done
} | tee "$OUT/status.txt"
status=0
[[ ${#FAILED[@]} -eq 0 ]] || status=1
echo "gpu_check finished with status $status; log $OUT/gpu_check.log, CSV $CSV"
exit $status
