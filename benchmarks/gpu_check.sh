#!/usr/bin/env bash
# GPU check for one lent H200 in one command (≤ 10 minutes; 15 minutes of device time in all, its start included).
#
#   bash benchmarks/gpu_check.sh [--dry-run] [kernels|rl|figures]...   (default: all three, in that order)
#   bash benchmarks/gpu_check.sh download        # where pip reaches PyPI: fill build/wheels, rewrite WHEEL_LOCK
#
# Steps run in priority order, each under its own time limit, and the limits add up to ≤ STEP_BUDGET_S (8 minutes),
# so the command ends inside its 10 with the machine's start and the transfers beside it:
#   setup    the GPU, then the wheels the image lacks (WHEELS, installed from build/wheels into $WORK/site: the device
#            has no network, so build/wheels travels with the tree: carry=["build/wheels"]).
#   kernels  Triton vs the reference (fp32 and bf16, the paper's d 3584 among the shapes), then the one build of
#            flowkit._C's CUDA kernels and the native kernels vs the reference.
#   rl       one RL step of a random 1.5B-shaped Qwen2 with the RLFR flow reward on the one GPU, no DeepSpeed (the
#            image has none): step phases and peak memory (bench_rl_scale.py).
#   figures  throughput and memory of the kernels (bench_velocity_deviation.py, bench_flow_attention.py).
# Written as it goes under $OUT (default benchmarks/results/gpu): gpu_check.log, results.csv (the benchmarks' rows;
# python benchmarks/plot.py --csv draws them), status.txt (one line per block). Scratch under $WORK. Exit status 0
# only when every step passed; a failing step fails its block, never the others.
#
# --dry-run (CI, tests/kernels/test_gpu_check_script.py) runs nothing on a GPU: it lists the steps, and fails when
# their limits add up to more than STEP_BUDGET_S, when the tree that travels plus the wheels is over TREE_BUDGET_MIB,
# or when the wheels do not resolve against the image's packages (GPU_IMAGE_PACKAGES) and flowkit's needs.
set -uo pipefail
cd "$(dirname "$0")/.."

STEP_BUDGET_S=480
TREE_BUDGET_MIB=48
# The device image (torch 2.11, transformers 5.17, triton 3.6, lightning 2.6, peft, torchmetrics 1.9; no deepspeed,
# no vLLM): its package list, and the wheels carried for what it lacks (gymnasium: `import flowkit.modules`).
GPU_IMAGE_PACKAGES="${GPU_CHECK_IMAGE_PACKAGES:-benchmarks/gpu_image_packages.txt}"
WHEEL_LOCK="${GPU_CHECK_WHEEL_LOCK:-benchmarks/gpu_wheels.lock}"
WHEELS=(gymnasium==1.4.0 farama-notifications==0.0.6)
# What the steps import beyond the standard library, with flowkit's own version bounds (pyproject.toml).
NEEDS=("torch>=2.11" "lightning>=2.6,<3" "transformers>=5.0,<6" "tokenizers>=0.21" "peft>=0.15" "torchmetrics>=1.9"
       "triton>=3.6" gymnasium pytest numpy)
WHEEL_DIR="${GPU_CHECK_WHEELS:-build/wheels}"
PYTHON="${PYTHON:-python3}"

if [[ "${1:-}" == download ]]; then
  set -e
  rm -rf "$WHEEL_DIR" && mkdir -p "$WHEEL_DIR"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEEL_DIR" "${WHEELS[@]}"
  # the lock: one line per wheel (file, bytes), then its Requires-Dist lines, so the dry run checks without wheels
  "$PYTHON" - "$WHEEL_DIR" >"$WHEEL_LOCK" <<'EOF'
import sys, zipfile
from pathlib import Path

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    print(f"wheel {wheel.name} {wheel.stat().st_size}")
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        for line in archive.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                print("  requires " + line.split(":", 1)[1].strip())
EOF
  du -sh "$WHEEL_DIR"
  echo "wrote $WHEEL_LOCK"
  exit 0
fi

DRY_RUN=0
BLOCKS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    all) BLOCKS+=(kernels rl figures) ;;
    kernels | rl | figures) BLOCKS+=("$arg") ;;
    *) echo "usage: $0 [--dry-run] [kernels|rl|figures|all]...  |  $0 download" >&2; exit 2 ;;
  esac
done
[[ ${#BLOCKS[@]} -gt 0 ]] || BLOCKS=(kernels rl figures)

OUT="${OUT:-benchmarks/results/gpu}"
WORK="${GPU_CHECK_WORK:-$PWD/build/gpu_check}"
CSV="$OUT/results.csv"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" TRITON_CACHE_DIR="$WORK/triton" TRITON_DEFAULT_FP_FUSION=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
if [[ $DRY_RUN -eq 0 ]]; then
  mkdir -p "$OUT" "$WORK"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi

declare -A FAILED=()  # block -> its failed steps
TOTAL_LIMIT_S=0
step() {  # step BLOCK NAME LIMIT_S CMD...: runs CMD under a time limit; a failure marks BLOCK failed and goes on
  local block=$1 name=$2 limit=$3
  shift 3
  TOTAL_LIMIT_S=$((TOTAL_LIMIT_S + limit))
  if [[ $DRY_RUN -eq 1 ]]; then
    echo "  $block/$name (limit ${limit}s): $(printf '%q ' "$@")"
    return 0
  fi
  echo "=== $block/$name ($(date -u +%H:%M:%S), limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  if [[ $rc -eq 0 ]]; then
    echo "=== $block/$name: ok ($((SECONDS - start)) s)"
  else
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
      echo "=== $block/$name: timed out after ${limit}s"
    else
      echo "=== $block/$name: failed (rc=$rc, $((SECONDS - start)) s)"
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
import torch, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
}

install_wheels() {  # WHEELS into $WORK/site, from $WHEEL_DIR only (PYTHONPATH has $WORK/site)
  if [[ ! -d "$WHEEL_DIR" ]]; then
    echo "no $WHEEL_DIR: run 'bash benchmarks/gpu_check.sh download' where pip reaches PyPI, and carry it" >&2
    return 1
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$WHEEL_DIR"/*.whl && "$PYTHON" -c "import flowkit.modules, flowkit.rewards; print('flowkit imports')"
}
build_native() {  # flowkit._C; setup.py builds the CUDA kernels only where torch finds a CUDA toolkit
  # torch's CUDA wheels carry no nvcc; the image's own toolkit (nvcc 13.0, device KINDS.md) is what builds them
  "$PYTHON" -c "
import sys, torch
from torch.utils.cpp_extension import CUDA_HOME
if CUDA_HOME is None:
    sys.exit('no nvcc here (PATH, CUDA_HOME, /usr/local/cuda): flowkit._C cannot build its CUDA kernels; '
             'the native checks fail, the Triton ones stand')
print('CUDA toolkit', CUDA_HOME, 'for torch', torch.__version__, 'CUDA', torch.version.cuda)" &&
    "$PYTHON" setup.py -q build_ext --inplace
}
export -f check_gpu install_wheels build_native
export PYTHON WHEEL_DIR WORK

setup() {
  echo "--- setup"
  step setup gpu 15 bash -c check_gpu
  step setup wheels 20 bash -c install_wheels
}

kernels() {
  echo "--- kernels"
  # Triton needs no build: it goes first. -k triton: the Triton cases and the Triton opcheck.
  step kernels triton-vs-reference 90 "$PYTHON" -m pytest tests/kernels/test_kernels_gpu.py -m gpu -k triton -q \
    -p no:cacheprovider
  step kernels build 150 bash -c build_native
  step kernels native-vs-reference 45 "$PYTHON" -m pytest tests/kernels/test_kernels_gpu.py -m gpu -k "not triton" \
    -q -p no:cacheprovider
}

rl() {
  echo "--- rl"
  # One step of 16 prompts x 8 samples x 512 new tokens, micro-batches of 8: every phase (generate, score, update,
  # the online flow step: --kappa 32 of the 64 accepted rollouts) at the 1.5B shape; prints each phase as it ends.
  step rl rl-step-1.5b 120 "$PYTHON" benchmarks/bench_rl_scale.py --steps 1 --prompts 16 --samples 8 \
    --new-tokens 512 --micro-batch-size 8 --rollout-batch-size 128 --csv "$CSV"
}

figures() {
  echo "--- figures"
  step figures bench-velocity-deviation 25 "$PYTHON" benchmarks/bench_velocity_deviation.py --device cuda --steps 1 \
    --sizes 8192x3584 --path-sizes "" --impls native,triton --epilogue --reps 10 --csv "$CSV"
  step figures bench-flow-attention 15 "$PYTHON" benchmarks/bench_flow_attention.py --device cuda --backward \
    --reps 5 --csv "$CSV"
}

dry_run_checks() {  # the budget, the size of what travels, and that the wheels resolve; 0 when all hold
  local status=0 tree_bytes wheel_bytes
  echo "step limits: ${TOTAL_LIMIT_S} s of ${STEP_BUDGET_S}"
  if [[ $TOTAL_LIMIT_S -gt $STEP_BUDGET_S ]]; then echo "FAIL: step limits exceed ${STEP_BUDGET_S} s"; status=1; fi
  # what the device tool sends: tracked and untracked-not-ignored files, plus the carried wheel folder
  tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  wheel_bytes=$(awk '$1 == "wheel" {s += $3} END {print s + 0}' "$WHEEL_LOCK")
  echo "tree ${tree_bytes} B + wheels ${wheel_bytes} B of $((TREE_BUDGET_MIB << 20)) B"
  if [[ $((tree_bytes + wheel_bytes)) -gt $((TREE_BUDGET_MIB << 20)) ]]; then
    echo "FAIL: the tree and the wheels exceed ${TREE_BUDGET_MIB} MiB"
    status=1
  fi
  "$PYTHON" - "$GPU_IMAGE_PACKAGES" "$WHEEL_LOCK" "$WHEEL_DIR" "${WHEELS[*]}" "${NEEDS[@]}" <<'EOF' || status=1
"""Every need and every wheel's Requires-Dist is met by the image or the wheels; each wheel is pinned, locked,
absent from the image, and (where build/wheels exists) the file the lock names."""
import re
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

image_path, lock_path, wheel_dir, wheels, *needs = sys.argv[1:]
image = {}
for line in Path(image_path).read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
        name, _, version = line.partition("==")
        image[canonicalize_name(name)] = version or None
locked, requires, current = {}, [], None
for line in Path(lock_path).read_text().splitlines():
    kind, rest = line.split(None, 1)
    if kind == "wheel":
        current, size = rest.split()
        name, version = current.split("-")[:2]
        locked[canonicalize_name(name)] = (version, current, int(size))
    else:
        requires.append((current, Requirement(rest)))
env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
errors = []
for spec in wheels.split():
    name, _, version = spec.partition("==")
    key = canonicalize_name(name)
    if key not in locked or locked[key][0] != version:
        errors.append(f"{spec} is not in {lock_path} (run: bash benchmarks/gpu_check.sh download)")
    elif key in image:
        errors.append(f"{spec} is carried but the image has {name} already")
    elif Path(wheel_dir).is_dir() and not (Path(wheel_dir) / locked[key][1]).is_file():
        errors.append(f"{wheel_dir} lacks {locked[key][1]} (run: bash benchmarks/gpu_check.sh download)")
available = {**image, **{k: v[0] for k, v in locked.items()}}
for needed_by, req in [("the GPU check", Requirement(n)) for n in needs] + requires:
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    key = canonicalize_name(req.name)
    if key not in available:
        errors.append(f"{req} (needed by {needed_by}) is neither in the image nor among the wheels")
    elif available[key] is not None and req.specifier and not req.specifier.contains(available[key], prereleases=True):
        errors.append(f"{req} (needed by {needed_by}) but {req.name} {available[key]} is what the device has")
print(f"wheels: {len(locked)} locked, {len(requires)} requirements checked against {len(image)} image packages")
for error in errors:
    print("FAIL: " + error)
sys.exit(1 if errors else 0)
EOF
  return $status
}

echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ): blocks ${BLOCKS[*]}; results under $OUT"
setup
for block in "${BLOCKS[@]}"; do
  start=$SECONDS
  "$block"
  [[ $DRY_RUN -eq 1 ]] || echo "--- $block took $((SECONDS - start)) s"
done
if [[ $DRY_RUN -eq 1 ]]; then
  dry_run_checks
  exit $?
fi

{
  for block in setup "${BLOCKS[@]}"; do
    if [[ -n "${FAILED[$block]:-}" ]]; then echo "$block: FAILED (${FAILED[$block]# })"; else echo "$block: ok"; fi
  done
} | tee "$OUT/status.txt"
status=0
[[ ${#FAILED[@]} -eq 0 ]] || status=1
echo "gpu_check finished with status $status; log $OUT/gpu_check.log, CSV $CSV"
exit $status
