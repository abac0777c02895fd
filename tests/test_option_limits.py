"""Option values the run's dtypes cannot hold, and option combinations that cannot make progress, are one line from
the ``flowkit`` command before any model loads; dynamic sampling that finds no variance still stops on SIGTERM."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning  # noqa: F401  (imported here, its log handler holds the process's stderr, not one test's capture)
import pytest
import rlfr_run
import torch

from flowkit.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "grpo_tiny.yaml")

CASES = {
    "overlong_penalty-1e300": (["controls.overlong_buffer_length", "4", "controls.overlong_penalty", "1e300"],
                               "PolicyModule.controls.overlong_penalty 1e+300 overflows float32, where it is used "
                               "(its square and a batch's sum must stay finite): at most 1e+15 in magnitude"),
    "lr-1e20": (["optim.lr", "1e20"], "PolicyModule.optim.lr 1e+20 overflows float32"),
    "kl_coef-1e-45": (["loss.kl_coef", "1e-45"], "PolicyModule.loss.kl_coef 1e-45 is subnormal or 0 in float32, where "
                                                  "it is used: 0 or at least 1.2e-38 in magnitude"),
    "max_new_tokens-1e10": (["sampling.max_new_tokens", "10000000000"],
                            "PolicyModule.sampling.max_new_tokens 10000000000 overflows int32, where it is used: at "
                            "most 2147483647 in magnitude"),
    "off_policy_mask-1e39": (["loss.rollout_correction.off_policy_mask", "1e39"],
                             "PolicyModule.loss.rollout_correction.off_policy_mask 1e+39 overflows float32"),
    "dynamic-sampling-one-sample": (["controls.dynamic_sampling_max_draws", "5", "sampling.num_samples", "1"],
                                    "PolicyModule.controls.dynamic_sampling_max_draws keeps the groups whose outcomes "
                                    "differ, which a group of PolicyModule.sampling.num_samples 1 never has: use "
                                    "num_samples >= 2, or dynamic_sampling_max_draws null"),
}


@pytest.mark.parametrize(("options", "expected"), CASES.values(), ids=CASES.keys())
def test_a_value_its_dtype_cannot_hold_is_one_line(tmp_path, monkeypatch, capsys, options, expected):
    monkeypatch.chdir(tmp_path)
    args = [arg for name, value in zip(options[::2], options[1::2]) for arg in (f"--model.init_args.{name}", value)]
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", CONFIG, "--trainer.max_steps", "0", *args])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: PolicyModule.") and expected in line, err
    assert not [*tmp_path.rglob("*.ckpt"), *tmp_path.rglob("metrics.csv")]  # refused before the run began


CONSTANT_REWARD = """
from pathlib import Path


def constant(completions, **columns):
    with Path("graded").open("a") as calls:  # one mark per graded draw
        calls.write("x")
    return [0.0] * len(completions)
"""


def test_dynamic_sampling_that_never_finds_variance_stops_on_sigterm(tmp_path):
    """Every group's outcome is 0, so no draw ever fills the step: SIGTERM ends the draws, the step trains on its
    first draw and the pre-emption checkpoint follows it, exit 0."""
    (tmp_path / "rewards.py").write_text(CONSTANT_REWARD)
    options = {"outcome_reward": "none", "reward_functions": '[{function: "rewards.py:constant"}]',
               "controls.dynamic_sampling_max_draws": "1000000", "sampling.num_samples": "2",
               "sampling.max_new_tokens": "4"}
    args = [str(Path(sys.executable).parent / "flowkit"), "fit", "--config", CONFIG, "--trainer.max_steps", "3",
            "--trainer.default_root_dir", "runs/stuck", "--data.init_args.batch_size", "2",
            "--data.init_args.val_path", "null", "--trainer.enable_progress_bar", "false",
            *(arg for name, value in options.items() for arg in (f"--model.init_args.{name}", value))]
    with (tmp_path / "stderr").open("w") as stderr:
        process = subprocess.Popen(args, cwd=tmp_path, env=rlfr_run.env(), stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 300  # a bound on the wait, not a timing claim
        graded = tmp_path / "graded"
        while not (graded.exists() and len(graded.read_text()) >= 3):  # in the third draw of step 1
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"no draws: {(tmp_path / 'stderr').read_text()[-3000:]}")
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=120)
        finally:
            process.kill()  # a no-op once it exited
    err = (tmp_path / "stderr").read_text()
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert "SIGTERM: saving" in err
    checkpoint = torch.load(tmp_path / "runs" / "stuck" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 1
    metrics = rlfr_run.metrics(tmp_path / "runs" / "stuck" / "version_0")
    assert float(metrics[1]["train/groups_kept"]) == 0 and float(metrics[1]["train/sampling_draws"]) >= 3
