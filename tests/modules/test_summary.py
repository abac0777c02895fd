"""The end-of-fit summary and a quiet console: one short tiny-RLFR run through the CLI (a subprocess, so the
console is exactly what a user sees), then the summary of the other modules, fitted directly."""

import math

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from rlfr_run import metrics, run, version_dirs

from flowkit.modules import (ExplanationDataModule, ExplanationRewardModule, ExportArtifacts, FlowRewardModule,
                             RolloutDataModule, RunSummary)
from flow_options import flow_reward

STEPS = 4
EXTRA = ["--trainer.val_check_interval", str(STEPS), "--data.init_args.max_val_examples", "8",
         "--data.init_args.eval_paths", "{math500: bundled:math_eval/math500.jsonl}",
         "--data.init_args.on_error", "skip",                   # MATH500 prompts longer than the tiny context
         "--trainer.enable_model_summary", "true",              # shown, without its FLOPs
         "--model.init_args.gradient_checkpointing", "true"]    # enabled without transformers' deprecation warning


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("summary")
    result = run(root, STEPS, *EXTRA)
    return root, result.stdout, result.stderr


def test_fit_ends_with_heldout_metrics_reward_trend_and_paths_as_logged(tiny_run):
    root, out, _ = tiny_run
    summary = out[out.index("fit summary:"):].splitlines()
    assert summary[0].startswith(f"fit summary: {STEPS} steps (0 → {STEPS}) in ")
    lines = dict(line.strip().split(": ", 1) for line in summary[1:])
    version = version_dirs(root)[-1]
    rows = metrics(version)
    held_out = {key: float(value) for row in rows.values() for key, value in row.items() if key.startswith("val/")}
    for eval_set in ("heldout", "math500"):
        assert lines[f"val/{eval_set}"] == ", ".join(
            f"{key.rsplit('/', 1)[1]} {held_out[key]:.4g}" for key in sorted(held_out) if f"/{eval_set}/" in key)
    rewards = [float(row["train/outcome_reward"]) for _, row in sorted(rows.items()) if "train/outcome_reward" in row]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:2]) / 2, sum(rewards[2:]) / 2  # 4 steps: the first and the last 2
    assert lines["outcome reward"] == f"{first:.4g} over steps 1-2, {last:.4g} over steps 3-4"
    assert lines["skipped steps"] == "0"
    shown = {name: root / lines[name] for name in ("checkpoint", "export", "metrics")}  # relative to the run's cwd
    assert shown["checkpoint"] == root / "runs" / "rlfr_tiny" / "checkpoints" / "last.ckpt"
    assert shown["checkpoint"].is_file() and (shown["export"] / "flow.safetensors").is_file()
    assert shown["export"] == version / "export" and shown["metrics"] == version / "metrics.csv"


def test_console_has_no_litlogger_tip_flops_or_checkpointing_deprecation(tiny_run):
    root, out, err = tiny_run
    console = out + err
    assert "Trainable params" in console and "Params" in console  # the model summary is there ...
    for noise in ("litlogger", "FLOPs", "Total Flops", "gradient_checkpointing_enable",  # ... without the noise
                  "Skipping setting a default `ModelSummary`"):
        assert noise not in console, noise
    saved = yaml.safe_load((version_dirs(root)[-1] / "config.yaml").read_text())
    assert saved["model"]["init_args"]["gradient_checkpointing"] is True  # the deprecated path would have run


@pytest.mark.parametrize("steps, expected", [
    (25, "5.5 over steps 1-10, 20.5 over steps 16-25"),
    (3, "1 over step 1, 3 over step 3"),                 # fewer than 2 × window: the two ends do not overlap
    (1, "1 at step 1"),
])
def test_reward_trend_compares_the_first_and_last_window_of_steps(steps, expected):
    summary = RunSummary(window=10)
    assert summary._trend({step: float(step) for step in range(1, steps + 1)}) == expected  # step s's reward: s


def _fit_with_summary(module, data, tmp_path, *callbacks, **trainer_args):
    trainer = L.Trainer(accelerator="cpu", num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False, logger=CSVLogger(tmp_path, name=""),
                        callbacks=[*callbacks, RunSummary()], **trainer_args)
    trainer.fit(module, datamodule=data)


def test_summary_of_a_flow_pretraining_run_has_no_reward_or_heldout_lines(tmp_path, capsys, single_thread):
    torch.manual_seed(0)
    module = FlowRewardModule(reward_model=flow_reward(percentiles=[0.5], depth=1))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, save_top_k=0)
    _fit_with_summary(module, RolloutDataModule(batch_size=4, val_path=None), tmp_path, checkpoint, ExportArtifacts(),
                      max_steps=2, log_every_n_steps=1)  # as the CLI logs: metrics.csv then exists
    out = capsys.readouterr().out
    summary = out[out.index("fit summary:"):].splitlines()
    assert summary[0].startswith("fit summary: 2 steps (0 → 2)")
    assert [line.split(":")[0].strip() for line in summary[1:]] == ["checkpoint", "export", "metrics"]


def test_summary_of_the_explanation_reward_module_shows_its_validation(tmp_path, capsys, single_thread):
    torch.manual_seed(0)
    module = ExplanationRewardModule(ode_steps=3, num_draws=4, time_dim=16, projector_dim=32, lr=1e-3)
    data = ExplanationDataModule(num_train=32, num_test=16, batch_size=16)
    _fit_with_summary(module, data, tmp_path, max_steps=2, val_check_interval=2, limit_val_batches=1,
                      enable_checkpointing=False)
    out = capsys.readouterr().out
    lines = dict(line.strip().split(": ", 1) for line in out[out.index("fit summary:"):].splitlines()[1:])
    logged = {name: float(value) for name, value in (item.split(" ") for item in lines["val"].split(", "))}
    assert "flow_accuracy_positive" in logged and all(math.isfinite(v) for v in logged.values())
    assert set(lines) == {"val", "metrics"}  # no outcome reward, skipped steps, checkpoint or export
