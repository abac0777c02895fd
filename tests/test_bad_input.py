"""Bad input through the ``flowkit`` CLI gets the CLI's own error or one line naming the problem, never a
traceback from deep inside; non-finite rewards skip the step (or fail, if configured) without touching
the weights; secrets from the environment never reach logs or saved configs."""

import csv
import json
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import T5Config

from flowkit.cli import main
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.rewards import FlowReward

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "rlfr_tiny.yaml")
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--model.init_args.flow_pretrain_steps", "0"]


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
        (["--model.init_args.not_a_key", "1"], "Option 'not_a_key' is not accepted"),
        (["--trainer.max_steps", "abc"], "Expected a <class 'int'>. Got value: abc"),
        (["--model.init_args.num_samples", "many"], "num_samples"),
        (["--model.init_args.outcome_reward", "fuzzy"], "Expected a typing.Literal['official', 'binary']"),
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
    assert "does not accept option 'trainer.max_stepz'" in err


# ----------------------------------------------------------------------------- one-line errors


def one_line_error(args: list[str], capsys) -> str:
    code, err = cli_exit(args, capsys)
    assert isinstance(code, str) and code.startswith("error: "), code
    assert "\n" not in code and "Traceback" not in err
    return code


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


# ----------------------------------------------------------------------------- non-finite rewards


def fit_one_batch(tmp_path: Path, nonfinite: str, bad_value: float) -> PolicyModule:
    L.seed_everything(0, verbose=False)
    reward = FlowReward(depth=1, kappa=2, rejection_metric="entropy")
    module = PolicyModule(reward_model=reward, num_samples=2, max_new_tokens=28, outcome_reward="binary",
                          nonfinite=nonfinite)
    real_token_rewards = reward.token_rewards
    reward.token_rewards = lambda batch, step: real_token_rewards(batch, step).fill_(bad_value)
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
    assert module.skipped_steps == 1
    assert "skipping RL step 0: non-finite advantages, token rewards" in caplog.text
    for name, weight in module.named_parameters():
        assert torch.equal(weight, module.initial_weights[name]), name
    assert not module.optimizers().optimizer.state  # no optimizer step was taken
    with (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open() as f:
        assert [float(row["train/skipped_steps"]) for row in csv.DictReader(f)] == [1.0]


def test_nonfinite_rewards_fail_when_configured(tmp_path):
    with pytest.raises(FloatingPointError, match="non-finite advantages, token rewards at step 0"):
        fit_one_batch(tmp_path, "fail", float("nan"))


# ----------------------------------------------------------------------------- secrets


SECRETS = {"HF_TOKEN": "hf_flowkitTestSecret123", "OPENAI_API_KEY": "sk-flowkitTestSecret456",
           "WANDB_API_KEY": "wandbFlowkitTestSecret789"}


def test_secrets_in_the_environment_never_reach_logs_or_saved_config(in_tmp, monkeypatch, capsys, caplog):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.DEBUG):
        main(fit_args("--trainer.max_steps", "1", "--model.init_args.num_samples", "2",
                      "--data.init_args.batch_size", "2", "--trainer.default_root_dir", str(in_tmp)))
    written = [p for p in in_tmp.rglob("*") if p.is_file()]
    assert {"config.yaml", "metrics.csv", "last.ckpt"} <= {p.name for p in written}  # a step ran and was saved
    captured = capsys.readouterr()
    texts = {"stdout": captured.out, "stderr": captured.err, "log records": caplog.text}
    texts |= {str(p): p.read_bytes().decode("utf-8", "replace") for p in written}
    for where, text in texts.items():
        for value in SECRETS.values():
            assert value not in text, f"secret leaked into {where}"
