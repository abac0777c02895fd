"""benchmarks/gpu_check.sh without a GPU: its blocks, their time limits, and that a failing block hides no other.

The script runs here against stand-ins: a fake ``python3`` (via $PYTHON) that logs its arguments and fails when they
contain $FAKE_FAIL, and fake ``nvidia-smi`` / ``nvcc``. What the real commands do is checked on the GPU machine.
"""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
BLOCK_LIMIT_S = 8 * 60

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
[[ "${1:-}" == - ]] && cat > /dev/null
[[ -n "${FAKE_FAIL:-}" && "$*" == *"$FAKE_FAIL"* ]] && exit 3
exit 0
"""


def run_script(tmp_path, *args, fail=""):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {"python3": FAKE_PYTHON, "nvidia-smi": "echo 'NVIDIA H200, 143771 MiB'",
                       "nvcc": "echo 'Build cuda_13.0'"}.items():
        (bin_dir / name).write_text(body if body.startswith("#!") else f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3"),
           "CUDA_HOME": str(tmp_path), "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"),
           "FAKE_LOG": str(tmp_path / "calls.log"), "FAKE_FAIL": fail}
    result = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    calls = (tmp_path / "calls.log").read_text().splitlines() if (tmp_path / "calls.log").exists() else []
    return result, calls


def test_dry_run_lists_every_block_within_its_time_limit(tmp_path):
    result, calls = run_script(tmp_path, "--dry-run", "all")
    assert result.returncode == 0, result.stderr
    steps = re.findall(r"^  (\w+)/([\w-]+) \(limit (\d+)s\)", result.stdout, re.M)
    limits = {}
    for block, _, limit in steps:
        limits[block] = limits.get(block, 0) + int(limit)
    assert list(limits) == ["setup", "kernels", "rehearsal", "deepspeed"]
    assert all(total <= BLOCK_LIMIT_S for total in limits.values()), limits
    assert calls == [] and not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_a_failing_block_does_not_hide_the_others(tmp_path):
    result, calls = run_script(tmp_path, "all", fail="bench_rl_scale.py")
    assert result.returncode == 1
    status = (tmp_path / "out" / "status.txt").read_text()
    assert status == "setup: ok\nkernels: ok\nrehearsal: FAILED (rl-scale)\ndeepspeed: ok\n"
    failed_at = next(i for i, call in enumerate(calls) if "bench_rl_scale.py" in call)
    later = " ".join(calls[failed_at + 1:])
    assert "configs/rlfr_qwen.yaml" in later and "flowkit export" in later  # the rest of its block and the next
    assert "rehearsal/rl-scale: failed (rc=3)" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_one_block_runs_alone_after_the_setup(tmp_path):
    result, calls = run_script(tmp_path, "deepspeed")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "out" / "status.txt").read_text() == "setup: ok\ndeepspeed: ok\n"
    assert any("pip install -q --no-deps --no-build-isolation -e ." in call for call in calls)
    assert sum("build_ext --inplace" in call for call in calls) == 1
    assert not any("-m pytest" in call or "bench_rl_scale" in call for call in calls)


def test_a_failing_setup_is_reported_and_the_blocks_still_run(tmp_path):
    result, calls = run_script(tmp_path, "kernels", fail="build_ext")
    assert result.returncode == 1
    assert (tmp_path / "out" / "status.txt").read_text() == "setup: FAILED (build)\nkernels: ok\n"
    assert any("pytest tests/kernels -m gpu" in call for call in calls)
