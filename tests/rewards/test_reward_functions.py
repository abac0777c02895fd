"""TRL-style reward functions `f(prompts, completions, **columns) -> list[float]` as a weighted list."""

import csv
import math
from pathlib import Path

import pytest
import torch

from flowkit.batch import RolloutBatch
from flowkit.cli import main
from flowkit.errors import ConfigError
from flowkit.modules import PolicyModule
from flowkit.modules.policy_options import SamplingOptions
from flowkit.rewards.functions import boxed_format_reward, build_reward_functions, weighted_rewards

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "rlfr_tiny.yaml")
HERE = "test_reward_functions"  # this module, importable by name under pytest (its directory is on sys.path)


def digits_reward(prompts, completions, answer, **kwargs):
    """A TRL-style function using a dataset column: the fraction of the answer's digits the completion contains."""
    return [sum(d in c for d in a) / len(a) for c, a in zip(completions, answer)]


def only_short(prompts, completions, **kwargs):
    """None where it does not apply (TRL's convention)."""
    return [1.0 if len(c) < 5 else None for c in completions]


class LengthPenalty:
    """A reward function with settings, built from class_path + init_args."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars

    def __call__(self, prompts, completions, **kwargs):
        return [-max(0, len(c) - self.max_chars) / self.max_chars for c in completions]


def test_weighted_sum_of_functions_classes_and_none():
    functions = build_reward_functions([
        {"function": f"{HERE}.digits_reward", "weight": 2.0},
        {"class_path": f"{HERE}.LengthPenalty", "init_args": {"max_chars": 4}, "weight": 0.5, "name": "length"},
        {"function": f"{HERE}.only_short"},
    ])
    assert [(f.name, f.weight) for f in functions] == [("digits_reward", 2.0), ("length", 0.5), ("only_short", 1.0)]
    completions = ["85", "\\boxed{25}", "abcdefgh"]
    total, values = weighted_rewards(functions, ["47+38="] * 3, completions, answer=["85", "25", "10"])
    # digits: 1, 1, 0 · 2; length: 0, −(10−4)/4, −(8−4)/4 · 0.5; short: 1, None, None
    assert total.tolist() == pytest.approx([2.0 + 0.0 + 1.0, 2.0 - 0.75, 0.0 - 0.5])
    assert values["only_short"][0] == 1.0 and values["only_short"][1:].isnan().all()
    assert boxed_format_reward(completions) == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("spec, message", [
    ({"weight": 1.0}, "exactly one of 'function' or 'class_path'"),
    ({"function": "x.y", "class_path": "x.Y"}, "exactly one of 'function' or 'class_path'"),
    ({"function": f"{HERE}.digits_reward", "weights": 1}, "unknown keys"),
    ({"function": "no_such_module.f"}, "cannot import 'no_such_module.f'"),
    ({"function": f"{HERE}.digits_reward", "weight": "high"}, r"weight must be a finite number"),
    ({"class_path": f"{HERE}.LengthPenalty", "init_args": {"max_len": 3}}, "cannot build"),
])
def test_bad_specs_are_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        build_reward_functions([spec])


def test_a_function_returning_the_wrong_number_of_values_is_named():
    functions = build_reward_functions([{"function": f"{HERE}.digits_reward"}])
    with pytest.raises(ValueError, match="'digits_reward' returned 1 values for 2 completions"):
        weighted_rewards(functions, ["p", "p"], ["1", "2"], answer=["1"])


def test_the_grader_adds_the_functions_to_the_outcome_reward(single_thread):
    module = PolicyModule(outcome_reward="binary",
                          reward_functions=[{"function": "flowkit.rewards.functions.boxed_format_reward", "weight": 0.5}],
                          sampling=SamplingOptions(num_samples=2, max_new_tokens=4))
    rows = 3
    batch = RolloutBatch(input_ids=torch.zeros(rows, 2, dtype=torch.long), attention_mask=torch.ones(rows, 2),
                         response_mask=torch.ones(rows, 2), group_ids=torch.zeros(rows, dtype=torch.long),
                         prompts=["47+38="] * rows, responses=["\\boxed{85}", "\\boxed{84}", "85"], answers=["85"] * rows)
    metrics = module.rl_step.experience.grader(batch)
    assert batch.outcome_rewards.tolist() == [1.5, 0.5, 0.0]
    assert metrics == {"train/reward/boxed_format_reward": pytest.approx(2 / 3)}
    assert batch.correct.tolist() == [True, False, False]  # accuracy stays the grader's verdict

    with pytest.raises(ConfigError, match="outcome_reward 'none' needs a reward_model, episodes or at least one "
                                          "entry in reward_functions"):
        PolicyModule(outcome_reward="none")


def test_a_trl_style_reward_list_trains_the_tiny_job(tmp_path, monkeypatch, single_thread):
    """Grader off, two reward functions: the logged outcome reward is exactly their weighted sum, and steps train."""
    monkeypatch.chdir(tmp_path)
    functions = (f"[{{function: {HERE}.digits_reward, weight: 0.5}}, "
                 f"{{class_path: {HERE}.LengthPenalty, init_args: {{max_chars: 20}}, weight: 2.0, name: length}}]")
    main(["fit", "--config", CONFIG, "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "2",
          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
          "--model.init_args.flow_pretrain.steps", "0", "--model.init_args.sampling.num_samples", "2",
          "--data.init_args.batch_size", "2", "--model.init_args.outcome_reward", "none",
          "--model.init_args.reward_functions", functions])
    with (tmp_path / "run" / "version_0" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/outcome_reward")]
    assert len(rows) == 2
    for row in rows:
        expected = 0.5 * float(row["train/reward/digits_reward"]) + 2.0 * float(row["train/reward/length"])
        assert float(row["train/outcome_reward"]) == pytest.approx(expected, abs=1e-6)
        assert math.isfinite(float(row["train/policy_loss"]))  # the policy update ran on these rewards
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_reward_functions_receive_the_datas_other_columns_as_trl_passes_them():
    from flowkit.rewards.functions import WeightedReward, outcome_rewards

    seen = {}

    def recording(prompts, completions, answer, **columns):
        seen.update(columns, answer=answer)
        return [float(len(c)) for c in completions]

    rewards, correct, values = outcome_rewards(["\\boxed{3}", "x"], ["3", "3"], ["1+2=", "1+2="], "binary",
                                               [WeightedReward("length", recording, 0.5)], 1.0,
                                               {"solution": ["1+2=3", "1+2=3"]})
    assert seen == {"solution": ["1+2=3", "1+2=3"], "answer": ["3", "3"]}
    assert correct.tolist() == [True, False] and rewards.tolist() == [1.0 + 0.5 * 9, 0.5 * 1]
    assert values["length"].tolist() == [9.0, 1.0]
