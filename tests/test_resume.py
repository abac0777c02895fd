"""Exact resume of the tiny RLFR job after a hard kill, and a clean stop on SIGTERM.

Everything a step depends on must come back from the checkpoint: policy, flow, optimizer moments,
the flow's rejection-sampling buffer, the RNG states (sampling draws from torch's), the prompt
stream's position, and the step counter that seeds the flow noise. The comparison is bitwise
(CPU, ``deterministic: true``).
"""

import signal
import subprocess
import time
from pathlib import Path

import cli_errors
import pytest
import rlfr_run
import torch

STEPS, KILL_AFTER = 4, 2
# About 8 of the 16 rollouts per step pass the entropy criterion: the flow's first update comes at step 2,
# right after the checkpoint, from rollouts buffered before it.
KAPPA = ["--model.init_args.reward_model.init_args.online.kappa", "20"]
COMPARED = ["train/outcome_reward", "train/policy_loss", "train/entropy", "flow/loss", "flow/buffer_size",
            "flow/deviation_mean", "flow/reward_mean"]


def checkpoint_override(root: Path) -> Path:
    """A checkpoint every 2 steps (the config saves every 20), in the config's checkpoint directory."""
    path = root / "override.yaml"
    path.write_text(
        "trainer:\n"
        "  deterministic: true\n"
        "  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {dirpath: runs/rlfr_tiny/checkpoints, save_last: true, save_top_k: 0, every_n_train_steps: 2}\n"
    )
    return path


def last_path(root: Path) -> Path:
    return root / "runs" / "rlfr_tiny" / "checkpoints" / "last.ckpt"  # runs are started in root


def last_checkpoint(root: Path) -> dict:
    return torch.load(last_path(root), map_location="cpu", weights_only=True)


def kill_after_checkpoint(root: Path) -> int:
    root.mkdir(parents=True)
    args = rlfr_run.command(root, STEPS, *KAPPA, "--config", str(checkpoint_override(root)))
    process = subprocess.Popen(args, env=rlfr_run.env(), cwd=root, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not last_path(root).exists():
        if process.poll() is not None:
            pytest.fail(f"run ended before its first checkpoint:\n{process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("no checkpoint within 300 s")
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    return process.returncode


@pytest.mark.slow
def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    rlfr_run.run(straight, STEPS, *KAPPA, "--config", str(checkpoint_override(straight)))

    assert kill_after_checkpoint(killed) == -signal.SIGKILL
    interrupted = last_checkpoint(killed)
    assert interrupted["global_step"] == KILL_AFTER
    assert "rng_states" in interrupted and interrupted["RolloutDataModule"]["next_index"] == KILL_AFTER
    assert interrupted["skipped_steps"] == 0
    assert len(interrupted["state_dict"]["reward_model._extra_state"]["buffer"]["latents"]) > 0

    rlfr_run.run(killed, STEPS, *KAPPA, "--config", str(checkpoint_override(killed)), "--ckpt_path", "last")

    expected, actual = last_checkpoint(straight), last_checkpoint(killed)
    assert actual["global_step"] == expected["global_step"] == STEPS
    assert actual["state_dict"].keys() == expected["state_dict"].keys()
    for name, tensor in expected["state_dict"].items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(actual["state_dict"][name], tensor), name
    assert_same_nested(actual["state_dict"]["reward_model._extra_state"],
                       expected["state_dict"]["reward_model._extra_state"])
    assert_same_nested(actual["optimizer_states"], expected["optimizer_states"])

    straight_metrics = rlfr_run.metrics(rlfr_run.version_dirs(straight)[-1])
    resumed_metrics = rlfr_run.metrics(rlfr_run.version_dirs(killed)[-1])
    resumed_steps = sorted(resumed_metrics)
    assert resumed_steps == list(range(KILL_AFTER + 1, STEPS + 1))  # metrics.csv counts from 1
    assert any("flow/loss" in straight_metrics[step] for step in resumed_steps)  # the restored buffer is used
    for step in resumed_steps:
        for key in COMPARED:
            assert resumed_metrics[step].get(key) == straight_metrics[step].get(key), (step, key)


def assert_same_nested(actual, expected, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_same_nested(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_nested(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


# ------------------------------------------------------------------------------ an unreadable last.ckpt

EVERY_STEP = ("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
              "      init_args: {save_last: true, save_top_k: 0, every_n_train_steps: 1}\n")


@pytest.mark.slow  # two runs of the CLI: a checkpoint to damage, then the resume
def test_a_truncated_last_checkpoint_resumes_from_the_one_before_it(tmp_path):
    (tmp_path / "every_step.yaml").write_text(EVERY_STEP)
    every_step = ["--config", str(tmp_path / "every_step.yaml")]
    first = cli_errors.fit(tmp_path, 2, *every_step)
    assert first.returncode == 0, first.stderr[-3000:]
    last = last_path(tmp_path)
    previous = last.with_name("last.ckpt.previous")
    assert torch.load(previous, weights_only=True)["global_step"] == 1  # the step-1 save, kept by the step-2 save
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])  # e.g. an interrupted copy of the run directory

    resumed = cli_errors.fit(tmp_path, 3, *every_step, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"{last} cannot be read (PytorchStreamReader failed reading zip archive: failed finding central "
            f"directory): resuming from the checkpoint before it, {previous} (step 1)\n") in resumed.stderr
    assert sorted(rlfr_run.metrics(rlfr_run.version_dirs(tmp_path)[-1])) == [2, 3]  # steps 2 and 3 ran again
    assert torch.load(last, weights_only=True)["global_step"] == 3
    assert torch.load(previous, weights_only=True)["global_step"] == 2  # the truncated file was never kept


def test_an_empty_last_checkpoint_without_one_before_it_is_one_line(tmp_path):
    last = last_path(tmp_path)
    last.parent.mkdir(parents=True)
    last.write_bytes(b"")
    result = cli_errors.fit(tmp_path, 1, "--ckpt_path", "last")
    assert cli_errors.one_line_error(result, max_lines=None) == (
        f"error: cannot resume from {last}: the file is empty or ends early, and no previous checkpoint "
        "(last.ckpt.previous) is kept beside it; pass another --ckpt_path, or start a new run with "
        "--trainer.default_root_dir")
    assert not (last.parent.parent / "version_0" / "metrics.csv").exists()  # no step ran
