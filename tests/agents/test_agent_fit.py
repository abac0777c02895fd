"""Agent episodes through ``fit``: PolicyModule with ``episodes`` trains on the bundled long-addition environment
with the bundled ``tiny_chat`` model; the step's metrics, the completion logs and the summary show the episodes."""

from __future__ import annotations

import csv
import json
import re

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from flowkit.agents import ENVIRONMENTS, EpisodeOptions
from flowkit.agents.envs.guess_number import GuessNumber
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



class RecordedGames(GuessNumber):
    """``guess_number`` that keeps each game it is handed (class-level: the runner builds one per episode)."""

    games: list[dict] = []

    def reset(self, record):
        RecordedGames.games.append(dict(record))
        return super().reset(record)


def test_a_stateful_environment_reads_the_game_its_record_carries(tmp_path, monkeypatch, single_thread):
    """``guess_number`` through ``fit``: the data module keeps each record's game (``record_fields``) and the
    environment plays that game: its secret, which the data's ``answer`` repeats; the answers to the guesses follow."""
    monkeypatch.setitem(ENVIRONMENTS, "test_recorded_games", RecordedGames)
    monkeypatch.setattr(RecordedGames, "games", [])
    L.seed_everything(0)
    data = RolloutDataModule(train_path="bundled:guess_number/train.jsonl", val_path=None, prompt_format="text",
                             batch_size=2, record_fields=["secret", "low", "high", "max_guesses"])
    module = PolicyModule(backbone="bundled:tiny_guesser", outcome_reward="none",
                          sampling=SamplingOptions(num_samples=2, max_new_tokens=16),
                          episodes=EpisodeOptions("test_recorded_games", max_turns=7, max_tokens=256))
    trainer = L.Trainer(accelerator="cpu", max_steps=1, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False, logger=CSVLogger(tmp_path, name=""),
                        callbacks=[CompletionLogs(every_n_steps=1, rows=4)])
    trainer.fit(module, datamodule=data)
    games = RecordedGames.games
    assert len(games) == 4 and all(str(game["secret"]) == game["answer"] for game in games), games
    assert {(game["low"], game["high"], game["max_guesses"]) for game in games} == {(1, 100, 7)}
    rows = [json.loads(line) for line in open(tmp_path / "version_0" / "completions.jsonl")]
    secrets = sorted(int(game["secret"]) for game in games)
    answered = 0
    for row in rows:
        turns = row["episode"]["turns"]
        # the secrets the row's answers allow: one of its game's, whichever of the batch's games it was
        allowed = set(secrets)
        for guess, answer in zip(turns[::2], turns[1::2]):
            number = re.search(r"\\boxed\{(\d+)\}", guess["text"])
            if number and answer["role"] != "policy" and ("higher" in answer["text"] or "lower" in answer["text"]):
                answered += 1
                higher = "higher" in answer["text"]
                allowed = {s for s in allowed if (s > int(number.group(1))) == higher}
        assert allowed, f"no game of the batch gives these answers: {turns}"
    assert answered, "no guess was answered: the test no longer sees what it checks"
