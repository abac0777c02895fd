"""Agent episodes through ``fit``: PolicyModule with ``episodes`` trains on the bundled long-addition environment
with the bundled ``tiny_chat`` model; the step's metrics, the completion logs and the summary show the episodes."""

from __future__ import annotations

import csv
import json

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from flowkit.agents import EpisodeOptions
from flowkit.errors import ConfigError
from flowkit.modules import CompletionLogs, PolicyModule, RolloutDataModule, RunSummary
from flowkit.step import SamplingOptions


def episode_module(**options):
    return PolicyModule(backbone="bundled:tiny_chat", outcome_reward="none",
                        sampling=SamplingOptions(num_samples=2, max_new_tokens=12),
                        episodes=EpisodeOptions("long_addition", max_turns=3, max_tokens=48), **options)


def test_fit_over_episodes_logs_them_turn_by_turn_and_sums_them_up(tmp_path, capsys, single_thread):
    L.seed_everything(0)
    data = RolloutDataModule(train_path="bundled:long_addition/k2/train.jsonl", val_path=None, prompt_format="text",
                             batch_size=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1, logger=CSVLogger(tmp_path, name=""),
                        callbacks=[CompletionLogs(every_n_steps=1, rows=2), RunSummary()])
    trainer.fit(episode_module(), datamodule=data)
    logged = list(csv.DictReader(open(tmp_path / "version_0" / "metrics.csv")))
    assert {"episodes/success_rate", "episodes/turns_mean", "episodes/tool_error_rate",
            "train/reward/environment"} <= logged[0].keys()
    assert float(logged[-1]["episodes/turns_mean"]) >= 1.0
    rows = [json.loads(line) for line in open(tmp_path / "version_0" / "completions.jsonl")]
    assert len(rows) == 4
    for row in rows:
        turns = row["episode"]["turns"]
        assert turns[0]["role"] == "policy" and len(row["roles"]) == len(row["tokens"])
        assert row["roles"] == [turn["role"] for turn in turns for _ in range(turn["tokens"])]
        assert row["episode"]["stop_reason"] in ("done", "max_turns", "max_tokens")
    page = (tmp_path / "version_0" / "completions" / "step_000002.html").read_text()
    assert "policy turns, ended:" in page
    summary = capsys.readouterr().out
    assert "  episodes: success rate " in summary and "turns per episode" in summary


def test_episode_options_are_checked_before_the_model_loads():
    with pytest.raises(ConfigError, match="PolicyModule.episodes rewards an episode with its environment's reward"):
        PolicyModule(backbone="bundled:tiny_chat", episodes=EpisodeOptions("long_addition"))
    with pytest.raises(ConfigError, match="PolicyModule.episodes.max_turns must be >= 1"):
        PolicyModule(backbone="bundled:tiny_chat", outcome_reward="none",
                     episodes=EpisodeOptions("long_addition", max_turns=0))
