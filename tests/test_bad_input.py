"""Bad input through the ``flowkit`` CLI gets the CLI's own error or one line naming the problem, never a
traceback from deep inside; non-finite rewards skip the step (or fail, if configured) without touching
the weights; secrets from the environment never reach logs or saved configs."""

import csv
import json
import logging
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cli_errors
import lightning as L
import pytest
import rlfr_run
import torch
from transformers import T5Config

from flowkit.cli import main
from flowkit.data.records import load_records
from flowkit.errors import ConfigError, check_range
from flowkit.llm.backbone import ASSETS
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.explanation import ExplanationRewardModule, ExplanationRounds
from flowkit.modules.policy_options import OptimOptions, SamplingOptions
from flow_options import flow_reward
from flowkit.rewards.explanation import ExplanationReward
from backbone_stub import backbone_stub

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "rlfr_tiny.yaml")
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--model.init_args.flow_pretrain.steps", "0"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config logs to runs/ relative to the working directory
    return tmp_path


def cli_exit(args: list[str], capsys) -> tuple[object, str]:
    """Run ``flowkit ARGS`` in-process; return the exit code (or message) and stderr."""
    with pytest.raises(SystemExit) as info:
        main(args)
    return info.value.code, capsys.readouterr().err


def fit_args(*extra: str) -> list[str]:
    return ["fit", "--config", CONFIG, *QUIET, *extra]


# ----------------------------------------------------------------------------- the CLI's own errors


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--model.init_args.not_a_key", "1"], "flowkit.modules.PolicyModule has no option 'not_a_key'"),
        (["--trainer.max_steps", "abc"], "Expected a <class 'int'>. Got value: abc"),
        (["--model.init_args.sampling.num_samples", "many"], "num_samples"),
        (["--model.init_args.outcome_reward", "fuzzy"], "Expected a typing.Literal['official', 'binary'"),
        (["--model", "flowkit.modules.NoSuchModule"], "module 'flowkit.modules' has no attribute 'NoSuchModule'"),
        (["--data", "flowkit.modules.NoSuchData"], "module 'flowkit.modules' has no attribute 'NoSuchData'"),
    ],
    ids=["unknown-key", "wrong-type", "wrong-type-model", "bad-choice", "unknown-model-class", "unknown-data-class"],
)
def test_config_errors_come_from_the_cli_parser(in_tmp, capsys, extra, expected):
    code, err = cli_exit(fit_args(*extra), capsys)
    assert code == 2
    assert "error:" in err and expected in err
    assert "Traceback" not in err


def test_unknown_key_in_a_config_file(in_tmp, capsys):
    override = in_tmp / "typo.yaml"
    override.write_text("trainer:\n  max_stepz: 3\n")
    code, err = cli_exit(fit_args("--config", str(override)), capsys)
    assert code == 2
    assert f"{override}: unknown key 'trainer.max_stepz'; did you mean 'trainer.max_steps'?" in err


OLD_FLAT_KEYS = {  # the flat form before option groups → the one-line error naming the new key
    "temperature": ("0.5", "'temperature' is now 'sampling.temperature'"),
    "flow_pretrain_steps": ("3", "'flow_pretrain_steps' is now 'flow_pretrain.steps'"),
    "rollout_server_url": ("http://x:1", "'rollout_server_url' is now 'rollout.server_url'"),
    "advantage": ("gae", "'advantage' is now 'advantage.estimator'"),  # a scalar where the group now is
}


@pytest.mark.parametrize("old", OLD_FLAT_KEYS)
def test_an_old_flat_option_on_the_command_line_names_its_new_key(in_tmp, capsys, old):
    value, expected = OLD_FLAT_KEYS[old]
    code, err = cli_exit(fit_args(f"--model.init_args.{old}", value), capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"error: model.init_args: {expected} (the options of " \
                                           "flowkit.modules.PolicyModule are in groups)"


@pytest.mark.parametrize("old", OLD_FLAT_KEYS)
def test_an_old_flat_option_in_a_config_file_names_the_file_and_its_new_key(in_tmp, capsys, old):
    value, expected = OLD_FLAT_KEYS[old]
    override = in_tmp / "old.yaml"
    override.write_text(f"model:\n  init_args:\n    {old}: {value}\n")
    code, err = cli_exit(fit_args("--config", str(override)), capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == f"error: {override}: model.init_args: {expected} (the options of " \
                                           "flowkit.modules.PolicyModule are in groups)"


def test_a_misspelt_option_of_a_group_gets_the_nearest_key(in_tmp, capsys):
    code, err = cli_exit(fit_args("--model.init_args.sampling.temprature", "0.5"), capsys)
    assert code == 2
    assert err.strip().endswith("flowkit.modules.PolicyModule has no option 'sampling.temprature'; did you mean "
                                "'sampling.temperature'?")
    override = in_tmp / "typo.yaml"
    override.write_text("model:\n  init_args:\n    optim:\n      flow_rl: 1.0\n")
    code, err = cli_exit(fit_args("--config", str(override)), capsys)
    assert err.strip().endswith(f"{override}: model.init_args: flowkit.modules.PolicyModule has no option "
                                "'optim.flow_rl'; did you mean 'optim.flow_lr'?")


# ----------------------------------------------------------------------------- one-line errors


def error_lines(args: list[str], capsys) -> list[str]:
    """stderr of ``flowkit ARGS``, which exits with code 2 and its error as one line, the last of at most 3.

    In-process, capsys sees what flowkit and transformers write (the weights-loading bar), not Lightning's start-up
    log lines ("GPU available: ..."), whose handler holds the process's original stderr: a setup-time error in a
    terminal follows those 4 lines. The subprocess test below counts every line, for errors at construction.
    """
    code, err = cli_exit(args, capsys)
    lines = err.rstrip("\n").split("\n")  # a progress bar redraws with "\r" on one line
    assert code == 2, err
    assert "Traceback" not in err, err
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, err
    assert len(lines) <= 3, err
    return lines


def one_line_error(args: list[str], capsys) -> str:
    return error_lines(args, capsys)[-1]


def test_missing_model_path_is_one_line(in_tmp, capsys):
    message = one_line_error(fit_args("--model.init_args.backbone", str(in_tmp / "no_such_model")), capsys)
    assert message == f"error: model path '{in_tmp / 'no_such_model'}' does not exist"


def test_model_that_is_not_a_causal_lm_is_one_line(in_tmp, capsys):
    T5Config(d_model=8, d_ff=16, num_layers=1, num_heads=1, vocab_size=32).save_pretrained(in_tmp / "t5")
    message = one_line_error(fit_args("--model.init_args.backbone", str(in_tmp / "t5")), capsys)
    assert "is not a causal LM (config type 't5')" in message


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "12+34=", "answer": ', "malformed JSON"),
        ('{"prompt": "   ", "answer": "46", "solution": "x"}', "required field 'prompt' is empty"),
        ('{"answer": "46"}', "missing required field 'prompt'"),
    ],
)
def test_bad_training_record_is_one_line_naming_file_and_line(in_tmp, capsys, line, problem):
    data = in_tmp / "train.jsonl"
    good = json.dumps({"prompt": "12+34=", "answer": "46", "solution": "2+4=6,1+3=4\\boxed{46}"})
    data.write_text("\n".join([good] * 9 + [line] + [good] * 20) + "\n")
    message = one_line_error(fit_args("--data.init_args.train_path", str(data), "--trainer.max_steps", "0"), capsys)
    assert message.startswith(f"error: {data}:10: {problem}")


def test_skip_policy_from_the_config_drops_and_counts_bad_records(in_tmp, caplog):
    data = in_tmp / "train.jsonl"
    good = json.dumps({"prompt": "12+34=", "answer": "46", "solution": "2+4=6,1+3=4\\boxed{46}"})
    data.write_bytes(("\n".join([good] * 20 + ["{oops"]) + "\n").encode() + b'{"prompt": "\xff", "answer": "1"}\n')
    with caplog.at_level(logging.WARNING, logger="flowkit.data.records"):
        main(fit_args("--data.init_args.train_path", str(data), "--data.init_args.on_error", "skip",
                      "--trainer.max_steps", "0"))
    assert f"{data}: skipped 2 bad record(s) of 22" in caplog.text


def test_missing_data_path_lists_nearby_files(in_tmp, capsys):
    (in_tmp / "train.jsonl").write_text("")
    message = one_line_error(fit_args("--data.init_args.train_path", str(in_tmp / "trian.jsonl"),
                                      "--trainer.max_steps", "0"), capsys)
    assert "no such file or directory" in message and "train.jsonl" in message


# ----------------------------------------------------------------------------- the bad-input table (issue 11)
# Every case runs the real CLI on the tiny RLFR config: exit code 2, one line naming the option (or file:line),
# at most 3 lines on stderr, no traceback. Option cases fail at construction, before any model loads; data cases
# fail in setup, before flow pretraining (the config's flow_pretrain.steps is on for those that need it).

REWARD = "--model.init_args.reward_model.init_args."
GOOD = {"prompt": "12+34=", "answer": "46", "solution": "2+4=6,1+3=4\\boxed{46}"}


def model_args(*options: str) -> list[str]:
    """``--model.init_args.NAME VALUE`` pairs from ``NAME VALUE`` pairs (``reward.NAME`` for the FlowReward)."""
    args = []
    for name, value in zip(options[::2], options[1::2]):
        args += [REWARD + name.removeprefix("reward.") if name.startswith("reward.") else f"--model.init_args.{name}",
                 value]
    return args


OPTION_CASES = {
    "num_samples-0": (model_args("sampling.num_samples", "0"), "PolicyModule.sampling.num_samples must be >= 1, got 0"),
    "val_num_samples-0": (model_args("validation.num_samples", "0"), "PolicyModule.validation.num_samples must be >= 1, got 0"),
    "batch_size-0": (["--data.init_args.batch_size", "0"], "RolloutDataModule.batch_size must be >= 1, got 0"),
    "ppo_epochs-0": (model_args("update.ppo_epochs", "0"), "PolicyModule.update.ppo_epochs must be >= 1, got 0"),
    "num_minibatches-0": (model_args("update.num_minibatches", "0"), "PolicyModule.update.num_minibatches must be >= 1, got 0"),
    "max_new_tokens-0": (model_args("sampling.max_new_tokens", "0"), "PolicyModule.sampling.max_new_tokens must be >= 1, got 0"),
    "max_new_tokens-negative": (model_args("sampling.max_new_tokens", "-3"), "PolicyModule.sampling.max_new_tokens must be >= 1, got -3"),
    "greedy-with-a-group": (model_args("sampling.temperature", "0"), "PolicyModule.sampling.temperature 0 (greedy) makes the 8 samples"),
    "top_p-0": (model_args("sampling.top_p", "0"), "PolicyModule.sampling.top_p must be in (0, 1], got 0.0"),
    "top_k-0": (model_args("reward.scoring.top_k", "0"), "FlowReward.scoring.top_k must be >= 1, got 0"),
    "noise_draws-0": (model_args("reward.scoring.noise_draws", "0"), "FlowReward.scoring.noise_draws must be >= 1, got 0"),
    "max_rows_per_call-0": (model_args("reward.network.max_rows_per_call", "0"), "FlowReward.network.max_rows_per_call must be >= 1"),
    "kappa-0": (model_args("reward.online.kappa", "0"), "FlowReward.online.kappa must be >= 1, got 0"),
    "pretrain_logit_mean-9": (model_args("reward.pretraining.pretrain_logit_mean", "9"),
                              "FlowReward.pretraining.pretrain_logit_mean must be in [-5.0, 5.0], got 9.0"),
    "flow_pretrain_lr_decay-linear": (model_args("flow_pretrain.lr_decay", "linear"), "flow_pretrain.lr_decay"),
    "percentiles-empty": (model_args("reward.latents.percentiles", "[]"), "FlowReward.latents.percentiles must not be empty"),
    "timesteps-empty": (model_args("reward.scoring.timesteps", "[]"), "FlowReward.scoring.timesteps must not be empty"),
    "timestep-above-1": (model_args("reward.scoring.timesteps", "[1.5]"), "FlowReward.scoring.timesteps must lie in (0, 1)"),
    "timestep-weight-inf-in-fp32": (model_args("reward.scoring.timesteps", "[0.99999999]"),
                                    "finite t/(1−t) weight in float32, got 0.99999999 (1.0 in float32)"),
    "eta-above-1": (model_args("reward.scoring.eta", "1.5"), "FlowReward.scoring.eta must be in [0.0, 1.0], got 1.5"),
    "flow-weights-missing": (model_args("reward.weights", "no_such_flow.safetensors"),
                             "FlowReward.weights 'no_such_flow.safetensors' is not a file"),
    "dtype-int8": (model_args("dtype", "int8"),
                   "dtype must be one of bf16, bfloat16, float16, float32, fp16, fp32, got 'int8'"),
    "pretraining-without-reward-model": (model_args("reward_model", "null", "flow_pretrain.steps", "5"),
                                         "PolicyModule.flow_pretrain.steps 5 needs a reward_model"),
    "trainer-rejects-value": (["--trainer.max_steps", "-5"], "`max_steps` must be a non-negative integer or -1"),
    "nested-choice": (model_args("reward.latents.condition", "bogus"),
                      "model.init_args.reward_model.init_args.latents.condition: Expected a typing.Literal['next', "
                      "'previous'"),
    "reward-option-of-the-flat-form": (model_args("reward.eta", "0.5"),
                                       "'eta' is now 'scoring.eta' (the options of flowkit.rewards.FlowReward are in "
                                       "groups)"),
}


@pytest.mark.parametrize(("extra", "expected"), OPTION_CASES.values(), ids=OPTION_CASES.keys())
def test_bad_option_is_one_line_before_any_model_loads(in_tmp, capsys, extra, expected):
    message = one_line_error(fit_args("--trainer.max_steps", "0", *extra), capsys)
    assert expected in message


LONG_PROMPT = "1+" * 300 + "1="  # 602 characters, one token each: more than the tiny model's 512-token context
RECORD_CASES = {
    "empty-file": ([], None, "no records"),
    "fewer-records-than-a-batch": ([GOOD] * 3, None, "3 usable record(s) cannot fill one batch of "
                                                     "RolloutDataModule.batch_size 16"),
    "pretraining-without-solutions": ([{"prompt": "12+34=", "answer": "46"}] * 20, None,
                                      "offline flow pretraining (flow_pretrain.steps > 0) needs expert solutions"),
    "json-array-record": ([GOOD] * 20, "[]", ":21: expected a JSON object, got list"),
    "empty-object-record": ([GOOD] * 20, "{}", ":21: missing required field 'prompt'"),
    "prompt-is-a-list": ([GOOD] * 20, '{"prompt": [], "answer": "1"}',
                         ":21: field 'prompt' must be a string or a conversation"),
    "prompt-is-an-object": ([GOOD] * 20, '{"prompt": {}, "answer": "1"}', ":21: field 'prompt' must be a string"),
    "answer-is-a-list": ([GOOD] * 20, '{"prompt": "1+1=", "answer": [2]}',
                         ":21: field 'answer' must be a string (or a number), got list"),
    "lone-surrogate": ([GOOD] * 20, '{"prompt": "1+\\ud800=", "answer": "1"}',
                       ":21: field 'prompt' is not encodable text"),
    "prompt-beyond-context": ([GOOD] * 20, json.dumps({"prompt": LONG_PROMPT, "answer": "1"}),
                              ":21: the prompt is 603 tokens; with max_new_tokens 28 it exceeds the policy's context "
                              "of 512"),
    "megabyte-prompt": ([GOOD] * 20, json.dumps({"prompt": "1+" * 500_000 + "1=", "answer": "1"}),  # never tokenized
                        ":21: field 'prompt' is 1000002 characters, at least 200001 tokens: beyond the policy's context"),
    "long-solution": ([GOOD] * 20, json.dumps({**GOOD, "solution": "1" * 100_000}),  # every text field is bounded
                      ":21: field 'solution' is 100000 characters, at least 20000 tokens: beyond the policy's context"),
    "long-answer": ([GOOD] * 20, json.dumps({**GOOD, "answer": "1" * 100_000}),
                    ":21: field 'answer' is 100000 characters, at least 20000 tokens: beyond the policy's context"),
}


@pytest.mark.parametrize(("records", "bad_line", "expected"), RECORD_CASES.values(), ids=RECORD_CASES.keys())
def test_bad_records_are_one_line_naming_file_and_line_before_pretraining(in_tmp, capsys, records, bad_line, expected):
    data = in_tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records) + (bad_line + "\n" if bad_line else ""))
    lines = error_lines(fit_args("--data.init_args.train_path", str(data), "--data.init_args.val_path", "null",
                                 "--model.init_args.flow_pretrain.steps", "5", "--trainer.max_steps", "0"), capsys)
    assert lines[-1].startswith(f"error: {data}") and expected in lines[-1]
    assert not any("flow pretraining:" in line for line in lines)  # pretraining never started (no progress bar)


def tiny_adder_copy(tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(ASSETS / "tiny_adder", copy, ignore=shutil.ignore_patterns(*drop))
    return copy


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flow_weights(tmp_path: Path, depth: int) -> Path:
    reward = flow_reward(depth=depth)
    reward.bind(backbone_stub(128), [0.25, 0.5, 0.75])  # the tiny adder's width
    reward.save_field(tmp_path / f"flow_depth{depth}.safetensors")
    return tmp_path / f"flow_depth{depth}.safetensors"


def _no_tokenizer(tmp_path):
    return model_args("backbone", str(tiny_adder_copy(tmp_path, ("tokenizer*",)))), "has no tokenizer files"


def _backbone_is_a_file(tmp_path):
    return model_args("backbone", str(ASSETS / "tiny_adder" / "config.json")), "is a file; give the model's directory"


def _truncated_weights(tmp_path):
    model = tiny_adder_copy(tmp_path)
    truncate(model / "model.safetensors")
    return model_args("backbone", str(model)), "cannot load the weights of"


def _flow_of_another_depth(tmp_path):
    return (model_args("reward.weights", str(flow_weights(tmp_path, depth=1))),
            "do not fit this FlowReward (depth 2, width 128, hidden size 128): 7 missing, 0 unexpected")


def _truncated_flow(tmp_path):
    weights = flow_weights(tmp_path, depth=2)
    truncate(weights)
    return model_args("reward.weights", str(weights)), "are not a readable safetensors file"


MODEL_CASES = [_no_tokenizer, _backbone_is_a_file, _truncated_weights, _flow_of_another_depth, _truncated_flow]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[case.__name__.strip("_") for case in MODEL_CASES])
def test_bad_model_files_are_one_line(in_tmp, capsys, case):
    extra, expected = case(in_tmp)
    message = one_line_error(fit_args(*extra, "--trainer.max_steps", "0"), capsys)
    assert expected in message


@pytest.mark.parametrize(
    ("make", "expected"),
    [(lambda: ExplanationRewardModule(proxies=[]), "ExplanationRewardModule.proxies must not be empty"),
     (lambda: ExplanationRewardModule(num_decisions=1), "ExplanationRewardModule.num_decisions must be >= 2, got 1"),
     (lambda: ExplanationRounds(policy_epochs_per_round=0),
      "ExplanationRounds.policy_epochs_per_round must be >= 1, got 0"),
     (lambda: ExplanationReward(flow_epochs_per_round=0),
      "ExplanationReward.flow_epochs_per_round must be >= 1, got 0"),
     (lambda: ExplanationReward(sigma=0.0), r"ExplanationReward.sigma must be > 0, got 0.0")],
    ids=["reward-no-proxies", "reward-one-decision", "rounds-zero-epochs-per-round", "reward-zero-flow-epochs",
         "reward-sigma-0"],
)
def test_explanation_modules_check_options_before_loading_models(monkeypatch, make, expected):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before the options were checked")

    monkeypatch.setattr("flowkit.modules.explanation.load_backbone", no_loading)
    monkeypatch.setattr("flowkit.rewards.explanation.load_backbone", no_loading)
    with pytest.raises(ConfigError, match=expected):
        make()


def test_check_range_names_the_allowed_range():
    check_range("M", "x", None, 1)  # None is an option's "off" value
    check_range("M", "x", 0.5, 0, 1, open_low=True, open_high=True)
    for value, kwargs, allowed in [(0, {"low": 1}, ">= 1"), (0.0, {"low": 0, "open_low": True}, "> 0"),
                                   (2, {"high": 1}, "<= 1"), (float("nan"), {"low": 0}, "a finite number"),
                                   (float("inf"), {"low": 0}, "a finite number"),
                                   (1.0, {"low": 0, "high": 1, "open_high": True}, "in [0, 1)")]:
        with pytest.raises(ConfigError, match=re.escape(f"M.x must be {allowed}, got {value!r}")):
            check_range("M", "x", value, **kwargs)


def test_numbers_in_text_fields_become_text_and_null_optional_fields_are_absent(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2, "solution": null}\n{"prompt": "2+2=", "answer": 4.5}\n')
    records = load_records(data, ["prompt", "answer"], text=["answer", "solution"])
    assert list(records) == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4.5"}]


def test_skip_policy_covers_text_the_tokenizer_cannot_take(in_tmp, caplog):
    data = in_tmp / "train.jsonl"
    bad = ['{"prompt": "1+\\ud800=", "answer": "1"}', json.dumps({"prompt": LONG_PROMPT, "answer": "1"}),
           '{"prompt": [], "answer": "1"}']
    data.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(20)) + "\n".join(bad) + "\n")
    with caplog.at_level(logging.WARNING, logger="flowkit.data.records"):
        main(fit_args("--data.init_args.train_path", str(data), "--data.init_args.on_error", "skip",
                      "--trainer.max_steps", "0"))
    assert f"{data}: skipped 3 bad record(s) of 23; first: {data}:21: field 'prompt' is not encodable" in caplog.text


@pytest.mark.parametrize(
    ("extra", "expected"),
    [(model_args("sampling.num_samples", "0"), "error: PolicyModule.sampling.num_samples must be >= 1, got 0"),
     (model_args("reward.latents.condition", "bogus"),
      "error: model.init_args.reward_model.init_args.latents.condition: Expected"),
     (["--data.init_args.train_path", "bad.jsonl"], "error: bad.jsonl:2: field 'prompt'")],
    ids=["option", "parser", "record"],
)
def test_flowkit_command_prints_one_line_and_exits_2(in_tmp, extra, expected):
    """The installed entry point, as a user runs it: stderr is at most 3 lines, the error the last, no traceback —
    also for a bad record, which the CLI loads before the Trainer prints its start-up lines."""
    (in_tmp / "bad.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "prompt": ["a", "list"]}) + "\n")
    done = subprocess.run([sys.executable, "-m", "flowkit", *fit_args(*extra, "--trainer.max_steps", "0")],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.rstrip("\n").split("\n")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(lines) <= 3, done.stderr
    assert lines[-1].startswith(expected), done.stderr


# ----------------------------------------------------------------------------- non-finite rewards


def fit_one_batch(tmp_path: Path, nonfinite: str, bad_value: float) -> PolicyModule:
    L.seed_everything(0, verbose=False)
    reward = flow_reward(depth=1, kappa=2, rejection_metric="entropy")
    module = PolicyModule(reward_model=reward, outcome_reward="binary",
                          sampling=SamplingOptions(num_samples=2, max_new_tokens=28),
                          optim=OptimOptions(nonfinite=nonfinite))
    real_token_rewards = reward.token_rewards
    reward.token_rewards = lambda *args: real_token_rewards(*args).fill_(bad_value)
    data = RolloutDataModule(batch_size=2, val_path=None)
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, limit_train_batches=1,
                        logger=L.pytorch.loggers.CSVLogger(tmp_path), log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module.initial_weights = {k: v.detach().clone() for k, v in module.named_parameters()}
    trainer.fit(module, data)
    return module


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nonfinite_rewards_skip_the_step_without_touching_weights(tmp_path, caplog, bad_value):
    with caplog.at_level(logging.WARNING, logger="flowkit.modules.policy"):
        module = fit_one_batch(tmp_path, "skip", bad_value)
    assert module.guard.skipped_steps == 1
    assert "skipping RL step 1: non-finite advantages, token rewards" in caplog.text
    for name, weight in module.named_parameters():
        assert torch.equal(weight, module.initial_weights[name]), name
    assert not module.optimizers().optimizer.state  # no optimizer step was taken
    with (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open() as f:
        assert [float(row["train/skipped_steps"]) for row in csv.DictReader(f)] == [1.0]


def test_nonfinite_rewards_fail_when_configured(tmp_path):
    with pytest.raises(FloatingPointError, match=r"non-finite advantages, token rewards \(from FlowReward.score\) at step 1"):
        fit_one_batch(tmp_path, "fail", float("nan"))


# ----------------------------------------------------------------------------- secrets


SECRETS = {"HF_TOKEN": "hf_flowkitTestSecret123", "OPENAI_API_KEY": "sk-flowkitTestSecret456",
           "WANDB_API_KEY": "wandbFlowkitTestSecret789"}


def test_secrets_in_the_environment_never_reach_logs_or_saved_config(in_tmp, monkeypatch, capsys, caplog):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.DEBUG):
        main(fit_args("--trainer.max_steps", "1", "--model.init_args.sampling.num_samples", "2",
                      "--data.init_args.batch_size", "2", "--trainer.default_root_dir", str(in_tmp)))
    written = [p for p in in_tmp.rglob("*") if p.is_file()]
    assert {"config.yaml", "metrics.csv", "last.ckpt"} <= {p.name for p in written}  # a step ran and was saved
    captured = capsys.readouterr()
    texts = {"stdout": captured.out, "stderr": captured.err, "log records": caplog.text}
    texts |= {str(p): p.read_bytes().decode("utf-8", "replace") for p in written}
    for where, text in texts.items():
        for value in SECRETS.values():
            assert value not in text, f"secret leaked into {where}"


# ----------------------------------------------------------------------------- hostile input (issue 21)
# Each case runs the installed `flowkit` command in a subprocess, as a user meets it: exit code 2, at most 3 lines on
# stderr, the last the one error line naming the file or option, no traceback, and nothing of the run written.


def _nested_json(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + '{"prompt": "1+1=", "answer": "2", "meta": ' + "[" * 5000 + "]" * 5000
                    + "}\n")
    return ["--data.init_args.train_path", str(data)], f"error: {data}:2: JSON nested too deeply to parse"


def _pickle_backbone(tmp_path):
    """The weights as a pickle that would run code (write a marker) if anything unpickled it."""
    from test_security import Payload

    model = tiny_adder_copy(tmp_path, ("*.safetensors",))
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "payload": Payload(tmp_path / "marker")},
               model / "pytorch_model.bin")
    return (model_args("backbone", str(model)),
            f"error: model directory '{model}' holds its weights as pickle (pytorch_model.bin), which flowkit never "
            "loads (unpickling can run code); convert them to safetensors")


def _template_null(tmp_path):
    return (["--data.init_args.prompt_format", "text", "--data.init_args.prompt_template", "null"],
            "error: RolloutDataModule.prompt_template must be a string holding {prompt}, got None")


def _yaml_with_a_tab(tmp_path):
    config = tmp_path / "override.yaml"
    config.write_text("trainer:\n  max_steps: 0\n\tlog_every_n_steps: 1\n")
    return (["--config", str(config)],
            f"error: {config}:3:1: found character '\\t' that cannot start any token; YAML indents with spaces, never tabs")


def _percentile_past_the_last_block(tmp_path):
    return (model_args("reward.latents.percentiles", "[0.25, 1.0]"),
            "error: percentiles: 1.0 taps decoder block round(1.0·4) = 4, but the model's blocks are 0..3; the last "
            "block is percentile 0.75")


HOSTILE_CASES = [_nested_json, _pickle_backbone, _template_null, _yaml_with_a_tab, _percentile_past_the_last_block]


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=[case.__name__.strip("_") for case in HOSTILE_CASES])
def test_hostile_input_is_one_line_from_the_flowkit_command(tmp_path, case):
    extra, expected = case(tmp_path)
    result = cli_errors.fit(tmp_path, 0, "--model.init_args.flow_pretrain.steps", "5", *extra)
    assert cli_errors.one_line_error(result).startswith(expected), result.stderr
    assert not (tmp_path / "runs" / "rlfr_tiny" / "checkpoints").exists()  # no work began
    assert not (tmp_path / "marker").exists()  # nothing was unpickled


def test_convert_flow_of_a_plain_pickle_is_one_line(tmp_path):
    source = tmp_path / "flow_model.bin"
    source.write_bytes(pickle.dumps({"model.input_proj.weight": [[1.0]]}, protocol=4))
    result = cli_errors.run_flowkit(tmp_path, [shutil.which("flowkit") or "flowkit", "convert-flow", "--config", CONFIG,
                                               "--input", str(source), "--output", str(tmp_path / "flow.safetensors")])
    # A subcommand runs once the Trainer is built: Lightning's "GPU available" and "TPU available" lines come first.
    assert cli_errors.one_line_error(result, max_lines=4) == (
        f"error: convert-flow --input '{source}' is not a torch.save file of tensors (a pickle the tensors-only loader "
        "refuses: Unsupported operand 149); save the official flow's weights with torch.save(model.state_dict(), PATH)")
    assert not (tmp_path / "flow.safetensors").exists()


def huge_field_data(tmp_path: Path) -> Path:
    """20 good records, then a 64 MB solution (line 21) and a 100 000-character answer (line 22)."""
    data = tmp_path / "train.jsonl"
    with data.open("w") as f:
        f.write((json.dumps(GOOD) + "\n") * 20)
        f.write(json.dumps({**GOOD, "solution": "1" * 64_000_000}) + "\n")
        f.write(json.dumps({**GOOD, "answer": "1" * 100_000}) + "\n")
    return data


def test_a_64_mb_field_is_one_line_under_an_address_space_limit(tmp_path):
    """Tokenizing the 64 MB solution would need over 8 GB; the line is refused unread, under the limit."""
    data = huge_field_data(tmp_path)
    result = cli_errors.fit(tmp_path, 0, "--data.init_args.train_path", str(data),
                            address_space=cli_errors.address_space_limit())
    assert cli_errors.one_line_error(result).startswith(f"error: {data}:21: the line is longer than 1089536 bytes")


def test_huge_fields_are_skipped_under_an_address_space_limit_with_on_error_skip(tmp_path):
    data = huge_field_data(tmp_path)
    result = cli_errors.fit(tmp_path, 0, "--data.init_args.train_path", str(data), "--data.init_args.on_error", "skip",
                            address_space=cli_errors.address_space_limit())
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"{data}: skipped 2 bad record(s) of 22; first: {data}:21: the line is longer than 1089536 bytes"
            in result.stderr)


def test_expert_solutions_on_some_records_only_pretrain_on_those(tmp_path):
    """Training batches then mix records with and without a solution; pretraining draws from those that have one."""
    data = tmp_path / "train.jsonl"
    without = {k: v for k, v in GOOD.items() if k != "solution"}
    data.write_text("".join(json.dumps(GOOD if i else without) + "\n" for i in range(8)))
    result = cli_errors.fit(tmp_path, 1, "--data.init_args.train_path", str(data), "--data.init_args.batch_size", "8",
                            "--model.init_args.flow_pretrain.steps", "2", "--model.init_args.flow_pretrain.batch_size",
                            "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{data}: offline flow pretraining uses the 7 of 8 records that have a 'solution' field" in result.stderr
    # The RL step ran on a batch of all 8 records, the first of which (in the seed-0 order) has a solution.
    assert sorted(rlfr_run.metrics(rlfr_run.version_dirs(tmp_path)[-1])) == [1]
