"""benchmarks/gpu_check.sh without a GPU: its dry run's checks (time budget, size, wheels), and its step runner.

The runner is driven here with stand-ins: a fake ``python3`` (via $PYTHON) that logs its arguments and fails when they
contain $FAKE_FAIL, and a fake ``nvidia-smi``. What the real commands do is checked on the GPU machine.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEP_BUDGET_S = 8 * 60  # issue 35: everything that matters inside 8 of the 10 minutes one command may take

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
[[ "${1:-}" == - ]] && cat > /dev/null
[[ -n "${FAKE_FAIL:-}" && "$*" == *"$FAKE_FAIL"* ]] && exit 3
exit 0
"""


def run_script(tmp_path, *args, fail="", python=None, **env_extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {"python3": FAKE_PYTHON, "nvidia-smi": "#!/usr/bin/env bash\necho 'NVIDIA H200, 143771 MiB'\n"}.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    (wheels / "gymnasium-1.4.0-py3-none-any.whl").write_bytes(b"")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": python or str(bin_dir / "python3"),
           "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"), "GPU_CHECK_WHEELS": str(wheels),
           "FAKE_LOG": str(tmp_path / "calls.log"), "FAKE_FAIL": fail, **env_extra}
    result = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL, cwd=ROOT)
    calls = (tmp_path / "calls.log").read_text().splitlines() if (tmp_path / "calls.log").exists() else []
    return result, calls


def dry_run(tmp_path, **env):
    return run_script(tmp_path, "--dry-run", python=sys.executable, GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"), **env)[0]


def test_dry_run_lists_the_steps_in_priority_order_within_the_budget(tmp_path):
    result = dry_run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = re.findall(r"^  (\w+)/([\w.-]+) \(limit (\d+)s\)", result.stdout, re.M)
    assert [block for block, _, _ in steps] == ["setup"] * 2 + ["kernels"] * 3 + ["rl"] + ["figures"] * 2
    assert sum(int(limit) for _, _, limit in steps) <= STEP_BUDGET_S
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written
    assert "deepspeed" not in result.stdout  # the device image has none
    assert re.search(r"tree \d+ B \+ wheels [1-9]\d* B of 50331648 B", result.stdout)


def test_dry_run_fails_on_an_unresolvable_wheel_or_an_oversized_tree(tmp_path):
    lock = (ROOT / "benchmarks" / "gpu_wheels.lock").read_text()
    unresolved = tmp_path / "unresolved.lock"
    unresolved.write_text(lock + "  requires not-on-the-image>=1\n")
    result = dry_run(tmp_path, GPU_CHECK_WHEEL_LOCK=str(unresolved))
    assert result.returncode == 1 and "FAIL: not-on-the-image>=1" in result.stdout, result.stdout

    oversized = tmp_path / "oversized.lock"
    oversized.write_text(re.sub(r"^(wheel gymnasium\S+) \d+", r"\1 60000000", lock, flags=re.M))
    result = dry_run(tmp_path, GPU_CHECK_WHEEL_LOCK=str(oversized))
    assert result.returncode == 1 and "FAIL: the tree and the wheels exceed 48 MiB" in result.stdout, result.stdout

    old_torch = tmp_path / "image.txt"
    image = (ROOT / "benchmarks" / "gpu_image_packages.txt").read_text()
    old_torch.write_text(image.replace("torch==2.11.0", "torch==2.10.0"))
    result = dry_run(tmp_path, GPU_CHECK_IMAGE_PACKAGES=str(old_torch))
    assert result.returncode == 1 and "torch 2.10.0 is what the device has" in result.stdout, result.stdout


def test_a_failing_step_does_not_hide_the_others(tmp_path):
    result, calls = run_script(tmp_path, "all", fail="bench_rl_scale.py")
    assert result.returncode == 1
    assert (tmp_path / "out" / "status.txt").read_text() == "setup: ok\nkernels: ok\nrl: FAILED (rl-step-1.5b)\nfigures: ok\n"
    failed_at = next(i for i, call in enumerate(calls) if "bench_rl_scale.py" in call)
    assert any("bench_flow_attention.py" in call for call in calls[failed_at + 1:])
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "rl/rl-step-1.5b: failed (rc=3" in log and "figures/bench-flow-attention: ok" in log


def test_one_block_runs_alone_after_the_setup(tmp_path):
    result, calls = run_script(tmp_path, "figures")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "out" / "status.txt").read_text() == "setup: ok\nfigures: ok\n"
    assert any("pip install -q --no-index --no-deps" in call for call in calls)
    assert not any("-m pytest" in call or "bench_rl_scale" in call or "build_ext" in call for call in calls)


def test_a_failing_build_is_reported_and_the_rest_still_runs(tmp_path):
    result, calls = run_script(tmp_path, "kernels", "rl", fail="build_ext")
    assert result.returncode == 1
    assert (tmp_path / "out" / "status.txt").read_text() == "setup: ok\nkernels: FAILED (build)\nrl: ok\n"
    assert any("-k not triton" in call for call in calls) and any("bench_rl_scale.py" in call for call in calls)


def test_an_image_without_nvcc_is_named_in_one_line(tmp_path):
    """torch's CUDA wheels carry no nvcc: where the image has no toolkit either, the build step says so and fails
    before setup.py would quietly build flowkit._C without its CUDA kernels. A stand-in torch finds no toolkit."""
    fake = tmp_path / "fake_torch" / "torch"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '2.11.0'\n")
    (fake / "utils" / "__init__.py").write_text("")
    (fake / "utils" / "cpp_extension.py").write_text("CUDA_HOME = None\n")
    result, _ = run_script(tmp_path, "kernels", python=sys.executable, PYTHONPATH=str(fake.parent))
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    no_nvcc = [line for line in log.splitlines() if line.startswith("no nvcc here")]
    assert len(no_nvcc) == 1 and "flowkit._C cannot build its CUDA kernels" in no_nvcc[0], log
    assert "kernels/build: failed (rc=1" in log and "setup.py" not in log
    assert result.returncode == 1
