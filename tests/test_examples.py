"""The worked examples of examples/ and the reward-model interface checks, run through `flowkit` as a user does."""

from __future__ import annotations

import csv
import json
import textwrap

import cli_errors
from test_extending import CONFIG, ONE_STEP, ROOT, flowkit

from flowkit.commands.plot import PANELS, _matching, read_metrics


def test_the_correctness_probe_example_trains_and_its_metrics_are_plotted(tmp_path):
    run_dir = tmp_path / "probe"
    result = flowkit(ROOT, "fit", "--config", str(CONFIG), *ONE_STEP, "--trainer.max_steps", "2",
                     "--trainer.default_root_dir", str(run_dir),
                     "--model.init_args.reward_model", "examples.correctness_probe_reward.CorrectnessProbe",
                     "--trainer.callbacks", "[{class_path: flowkit.modules.CompletionLogs, "
                                            "init_args: {every_n_steps: 1, rows: 2}}]")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run_dir / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f)]
    assert sorted({int(row["step"]) for row in rows}) == [1, 2]  # RL steps from 1, as the bar and summary count
    logged_completions = [json.loads(line) for line in (run_dir / "version_0" / "completions.jsonl").open()]
    for step in (1, 2):  # 2 rows of a step of 2 prompts × 2 samples: one of each prompt's group
        assert sorted(row["group"] for row in logged_completions if row["step"] == step) == [0, 1]
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"reward_model/probe_loss", "reward_model/probe_accuracy", "train/token_reward/mean",
            "train/token_reward/nonzero_frac", "time/reward_model_s"} <= logged, sorted(logged)
    assert "time/flow_s" not in logged
    # |r_t| ≤ beta / 2 = 0.025 on every token
    assert all(abs(float(row["train/token_reward/max"])) <= 0.025 for row in rows if row["train/token_reward/max"])
    panel = next(patterns for title, *patterns in PANELS if title == "reward model")
    drawn = _matching(read_metrics(run_dir), panel[0] + panel[1])
    assert {"reward_model/probe_loss", "reward_model/probe_accuracy", "train/token_reward/mean"} <= set(drawn)


def project(tmp_path, source: str):
    (tmp_path / "my_rewards.py").write_text("import torch\nfrom flowkit.rewards import TokenRewardModel\n\n"
                                            + textwrap.dedent(source))
    return tmp_path


def test_a_score_of_the_wrong_shape_is_one_line_naming_the_method(tmp_path):
    project(tmp_path, '''
        class PerRow(TokenRewardModel):
            def begin_step(self, step, batch):
                return PerRowStep()


        class PerRowStep:
            def score(self, micro, rows):
                return torch.zeros(len(rows))  # one reward per row, not per token
    ''')
    result = flowkit(tmp_path, "fit", "--config", str(CONFIG), *ONE_STEP, "--trainer.default_root_dir", "runs/shape",
                     "--model.init_args.reward_model", "my_rewards.PerRow")
    line = cli_errors.one_line_error(result, max_lines=None)
    assert line.startswith("error: PerRowStep.score must return a floating tensor of shape (4, "), line
    assert "(b×S, like micro.response_mask) on cpu; it returned a torch.float32 tensor of shape (4,) on cpu" in line


def test_a_reward_model_written_to_another_interface_is_one_line(tmp_path):
    project(tmp_path, '''
        class OldApi(TokenRewardModel):
            def bind(self, hidden_size, layer_positions):
                self.hidden_size = hidden_size

            def begin_step(self, step, batch):
                return None
    ''')
    result = flowkit(tmp_path, "fit", "--config", str(CONFIG), *ONE_STEP, "--trainer.default_root_dir", "runs/old",
                     "--model.init_args.reward_model", "my_rewards.OldApi")
    assert cli_errors.one_line_error(result) == (
        "error: OldApi.bind(hidden_size, layer_positions) cannot be called as bind(backbone, layer_positions, "
        "tokenizer) (flowkit.rewards.TokenRewardModel's interface)")
