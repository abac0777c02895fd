"""Completion logs (flowkit.modules.CompletionLogs): the rollouts of a step with their outcome and per-token flow
rewards, as JSONL and an HTML heat map in the run directory, and as a W&B table (offline)."""

from __future__ import annotations

import json

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from flowkit.modules import CompletionLogs, PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import SamplingOptions
from flow_options import flow_reward


def fit_logging_completions(tmp_path, logger, steps: int = 2) -> PolicyModule:
    L.seed_everything(0, verbose=False)
    module = PolicyModule(reward_model=flow_reward(depth=1, kappa=2, rejection_metric="entropy"),
                          sampling=SamplingOptions(num_samples=2, max_new_tokens=16))
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        callbacks=[CompletionLogs(every_n_steps=1, rows=3)])
    trainer.fit(module, RolloutDataModule(batch_size=2, val_path=None))
    return module


def test_every_logged_step_writes_its_rollouts_with_one_flow_reward_per_response_token(tmp_path, single_thread):
    fit_logging_completions(tmp_path, CSVLogger(tmp_path, name=""))
    run = next(tmp_path.glob("version_*"))
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 1, 1, 2, 2, 2]
    for row in rows:
        assert row["prompt"] and row["tokens"]
        assert len(row["token_rewards"]) == len(row["tokens"]) > 0
        assert all(r <= 0 for r in row["token_rewards"])  # eq. 10 penalises: -β·score ≤ 0
        assert row["outcome_reward"] in (0.0, 1.0) and isinstance(row["correct"], bool)
    assert [row["group"] for row in rows[:3]] == [0, 1, 0]  # spread over the step's 2 prompts, not one group's samples
    assert any(r < 0 for row in rows for r in row["token_rewards"])  # some token was penalised
    pages = sorted((run / "completions").glob("step_*.html"))
    assert [p.name for p in pages] == ["step_000001.html", "step_000002.html"]
    assert "outcome reward" in pages[0].read_text() and "rgba(220,40,40," in pages[0].read_text()


def test_wandb_in_offline_mode_gets_a_completions_table(tmp_path, single_thread, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged: list[dict] = []
    real_log_table = WandbLogger.log_table

    def spy(self, key, columns=None, data=None, dataframe=None, step=None):
        logged.append({"key": key, "columns": columns, "data": data, "step": step})
        return real_log_table(self, key, columns=columns, data=data, dataframe=dataframe, step=step)

    monkeypatch.setattr(WandbLogger, "log_table", spy)
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="flowkit-test")
    fit_logging_completions(tmp_path, logger, steps=1)
    wandb.finish()
    (table,) = logged
    assert table["key"] == "completions" and table["columns"][:4] == ["step", "group", "prompt", "completion"]
    assert len(table["data"]) == 3 and isinstance(table["data"][0][-1], wandb.Html)
    assert all(row[-2] is not None and row[-2] <= 0 for row in table["data"])  # the summed dense reward
    assert next(tmp_path.rglob("*.wandb"), None) is not None  # the offline run was written


def test_rows_and_interval_are_checked():
    from flowkit.errors import ConfigError

    with pytest.raises(ConfigError, match="rows"):
        CompletionLogs(rows=0)
    with pytest.raises(ConfigError, match="every_n_steps"):
        CompletionLogs(every_n_steps=-1)
