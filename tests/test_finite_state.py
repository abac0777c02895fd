"""The finite-state guard (issue 34): a non-finite loss or gradient of the policy or the flow skips the step before the
shared gradient clipping mixes the groups, on every rank together; weights that turn non-finite stop the run in one
line naming the last good checkpoint, and nothing (checkpoint, export) is written from them; ``inf`` is no option
value. Each case as a user meets it: through the ``flowkit`` CLI on the shrunk tiny RLFR job, 1-3 steps."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import cli_errors
import lightning as L
import pytest
import rlfr_run
import torch
from safetensors.torch import load_file

from flowkit.errors import ConfigError, NonFiniteTraining, check_range
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import OptimOptions, SamplingOptions
from flow_options import flow_reward

from flowkit.modules.step_guard import StepGuard
from fault_injection import NanLoss

EVERY_STEP = ("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
              "      init_args: {save_last: true, save_top_k: 0, every_n_train_steps: 1}\n")


@pytest.mark.parametrize("option", ["optim.lr", "sampling.temperature", "grader_timeout"])
def test_inf_is_refused_like_any_value_out_of_range(tmp_path, option, capsys, monkeypatch):
    """``lr: .inf`` used to train one step, print a normal summary and export 50/50 non-finite tensors;
    ``grader_timeout: .inf`` failed mid-run (``OverflowError: timestamp out of range``). ``optim.lr`` through the
    console script as a user meets it, the others in this process (the same :func:`flowkit.cli.main`)."""
    args = (tmp_path, 1, f"--model.init_args.{option}", ".inf")
    result = cli_errors.fit(*args) if option == "optim.lr" else \
        cli_errors.fit_in_process(*args, capsys=capsys, monkeypatch=monkeypatch)
    assert cli_errors.one_line_error(result) == f"error: PolicyModule.{option} must be a finite number, got inf"
    assert not (tmp_path / "runs" / "rlfr_tiny" / "checkpoints").exists()


def test_check_range_refuses_inf_and_nan_on_unbounded_sides():
    for value in (math.inf, -math.inf, math.nan):
        with pytest.raises(ConfigError, match="must be a finite number"):
            check_range("Owner", "option", value, None)
    check_range("Owner", "option", 1e300, 0)  # finite, however large


def test_a_nan_flow_loss_skips_the_step_and_leaves_the_policy_finite(tmp_path, caplog):
    """The flow's NaN loss used to be backpropagated; the clipping's one norm over both groups then turned every
    policy gradient into NaN and the step wrote NaN into all policy weights. Now the step is skipped and counted,
    and the next one trains both groups."""
    L.seed_everything(0, verbose=False)
    module = PolicyModule(reward_model=flow_reward(depth=1, kappa=2, rejection_metric="entropy"),
                          outcome_reward="binary", sampling=SamplingOptions(num_samples=4, max_new_tokens=16),
                          optim=OptimOptions(max_grad_norm=1.0, lr=1e-3))
    start = {name: p.detach().clone() for name, p in module.named_parameters()}
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[NanLoss(step=0, loss="flow")])
    with caplog.at_level(logging.WARNING, logger="flowkit.modules.policy"):
        trainer.fit(module, RolloutDataModule(batch_size=2, val_path=None))
    assert "skipping RL step 1: non-finite flow loss (1 skipped so far)" in caplog.text
    assert module.guard.skipped_steps == 1 and trainer.global_step == 1  # the skipped batch, then one that trained
    for group in ("policy.", "reward_model."):
        weights = {n: p for n, p in module.named_parameters() if n.startswith(group) and p.requires_grad}
        assert weights and all(bool(torch.isfinite(p).all()) for p in weights.values()), group
        assert any(not torch.equal(p, start[n]) for n, p in weights.items()), f"{group} did not train after the skip"


def test_nan_weights_at_the_start_stop_in_one_line_before_any_step(tmp_path):
    """A flow file or checkpoint holding NaN used to skip step after step until max_consecutive_skips."""
    module = PolicyModule(reward_model=flow_reward(depth=1), sampling=SamplingOptions(num_samples=2, max_new_tokens=8))
    with torch.no_grad():
        next(module.reward_model.parameters()).view(-1)[0] = float("nan")
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    with pytest.raises(FloatingPointError, match="^the flow weights are non-finite at the start of training; nothing "
                                                 "was saved from them, no checkpoint was saved before it"):
        trainer.fit(module, RolloutDataModule(batch_size=2, val_path=None))
    assert trainer.global_step == 0 and module.guard.skipped_steps == 0


@pytest.mark.slow  # three CLI runs: the run that breaks, the export of a poisoned checkpoint, the resume
def test_weights_that_turn_non_finite_stop_the_run_at_the_last_good_checkpoint_which_resume_uses(tmp_path):
    """From step 2 on (global_step 1) the learning rate is NaN (as a schedule dividing by zero makes it): the weights
    turn NaN. The run stops in one line naming last.ckpt (step 1, all finite), writes no checkpoint or export from the
    broken weights, and `--ckpt_path last` resumes from it. `flowkit export` of a checkpoint holding NaN (one written
    before this guard) is one line."""
    (tmp_path / "every_step.yaml").write_text(EVERY_STEP)
    every_step = ["--config", str(tmp_path / "every_step.yaml")]
    run_dir = tmp_path / "runs" / "rlfr_tiny"
    last = run_dir / "checkpoints" / "last.ckpt"
    broken = cli_errors.fit(tmp_path, 3, *every_step, "--trainer.callbacks+=fault_injection.LearningRateJump",
                            "--trainer.callbacks.step", "1", "--trainer.callbacks.lr", ".nan")
    assert cli_errors.one_line_error(broken, max_lines=None) == (
        "error: the optimizer step of RL step 2 made the policy weights, flow weights non-finite (a learning rate too "
        f"high?); nothing was saved from them, the last good checkpoint is {last}: resume it with --ckpt_path {last} "
        "once the cause is fixed")
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 1
    tensors = [t for t in checkpoint["state_dict"].values() if torch.is_tensor(t) and t.is_floating_point()]
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors)
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no temporary of a refused save
    assert not list(run_dir.glob("version_*/export"))

    checkpoint["state_dict"]["policy.model.embed_tokens.weight"][0, 0] = float("nan")
    torch.save(checkpoint, tmp_path / "poisoned.ckpt")
    export = cli_errors.run_flowkit(tmp_path, ["flowkit", "export", "--config", str(rlfr_run.CONFIG), "--checkpoint",
                                               str(tmp_path / "poisoned.ckpt"), "--out", str(tmp_path / "out")])
    assert cli_errors.one_line_error(export, max_lines=None) == (
        "error: refusing to export non-finite weights: 1 tensor(s) hold NaN or inf "
        "(e.g. policy.model.embed_tokens.weight); export an earlier checkpoint")
    assert not (tmp_path / "out").exists()

    resumed = cli_errors.fit(tmp_path, 2, *every_step, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(last, weights_only=True)["global_step"] == 2


@pytest.mark.slow  # two DDP ranks through the CLI
def test_ranks_skip_together_when_only_one_ranks_loss_is_nan(tmp_path):
    """Rank 1's policy loss is NaN at step 1, rank 0's is not: both ranks skip the step (a rank skipping alone would
    leave the other waiting in the gradient all-reduce), then train step 1 again and end with the same weights."""
    result = rlfr_run.run(tmp_path, 1, "--trainer.devices", "2", "--trainer.strategy", "ddp",
                          "--data.init_args.val_path", "null",
                          "--trainer.callbacks+=fault_injection.NanLoss", "--trainer.callbacks.step", "0",
                          "--trainer.callbacks.rank", "1",
                          "--trainer.callbacks+=rank_weights.RankWeights", "--trainer.callbacks.out",
                          str(tmp_path / "weights"), timeout=600)
    assert "skipping RL step 1: non-finite policy loss (1 skipped so far)" in result.stderr
    assert "skipping RL step 1: non-finite values on another rank (1 skipped so far)" in result.stderr
    rank0, rank1 = (load_file(str(tmp_path / "weights" / f"rank{rank}.safetensors")) for rank in (0, 1))
    moved = [name for name in rank0
             if name.startswith("end/") and not torch.equal(rank0[name], rank0[name.replace("end/", "start/")])]
    assert moved  # step 1, trained after the skip
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
        assert bool(torch.isfinite(rank0[name]).all()), name
    metrics = rlfr_run.metrics(rlfr_run.version_dirs(tmp_path)[-1])
    assert float(metrics[1]["train/skipped_steps"]) == 1.0  # metrics.csv counts RL steps from 1


def test_the_guard_counts_skips_and_stops_after_max_consecutive_skips():
    """StepGuard alone (no trainer run): skips count, a trained step ends the run of skips, the limit stops."""
    guard = StepGuard(OptimOptions(max_consecutive_skips=2))
    trainer = SimpleNamespace(checkpoint_callback=None, ckpt_path=None)
    guard.skip(trainer, ["policy loss"], step=4)
    guard.trained()
    guard.skip(trainer, ["policy loss"], step=6)
    assert (guard.skipped_steps, guard.consecutive_skips) == (2, 1)
    with pytest.raises(NonFiniteTraining, match=r"^2 RL steps in a row were skipped .*non-finite flow loss at step 7"):
        guard.skip(trainer, ["flow loss"], step=7)
    with pytest.raises(NonFiniteTraining, match=r"^non-finite policy loss at step 1$"):
        StepGuard(OptimOptions(nonfinite="fail")).skip(trainer, ["policy loss"], step=1)
