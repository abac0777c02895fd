"""What a resume restores, applies and refuses, tried as a user meets it (``flowkit fit`` / ``flowkit export`` in a
subprocess on the shrunk tiny RLFR job, 1-3 RL steps; the further cases of one refusal in this process, through the
same ``flowkit.cli.main``): offline flow pretraining on the placed model and never again on resume, changed settings
applied or refused before any work, a finished run left alone, SIGTERM in the final validation, SLURM requeue, a
moved run directory, and another number of DDP ranks."""

import json
import shutil
import subprocess
from pathlib import Path

import cli_errors
import pytest
import rlfr_run
import torch
from safetensors.torch import load_file

EVERY_STEP = ("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
              "      init_args: {save_last: true, save_top_k: 0, every_n_train_steps: 1}\n"
              "    - class_path: flowkit.modules.ExportArtifacts\n")
PRETRAIN = ["--model.init_args.flow_pretrain.steps", "2", "--model.init_args.flow_pretrain.batch_size", "4"]
DDP = ["--trainer.strategy", "ddp"]


def every_step(root: Path) -> list[str]:
    path = root / "every_step.yaml"
    path.write_text(EVERY_STEP)
    return ["--config", str(path)]


def run_dir(root: Path) -> Path:
    return root / "runs" / "rlfr_tiny"


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """One RL step after 2 steps of flow pretraining, under DDP (one rank), checkpointed at every step, exported;
    :class:`resume_probes.PretrainingPlacement` records how the strategy held the model when pretraining ran."""
    root = tmp_path_factory.mktemp("finished")
    result = cli_errors.fit(root, 1, *every_step(root), *PRETRAIN, *DDP,
                            "--trainer.callbacks+=resume_probes.PretrainingPlacement",
                            "--trainer.callbacks.out", str(root / "placement.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def copy_of(finished: Path, tmp_path: Path) -> Path:
    """The finished run's directory tree under ``tmp_path`` (its checkpoints still name the original directory, as
    after ``mv``)."""
    shutil.copytree(finished / "runs", tmp_path / "runs")
    return tmp_path


def test_flow_pretraining_runs_after_the_strategy_placed_the_model(finished_run):
    placement = json.loads((finished_run / "placement.json").read_text())
    # DDP wraps the module in strategy.setup, after moving it to its device: pretraining saw the wrapped module.
    assert placement["strategy_model"] == "DistributedDataParallel"
    assert placement["policy_device"] == placement["reward_device"] == placement["root_device"]
    state = load(run_dir(finished_run) / "checkpoints" / "flow_pretrain.ckpt")
    assert state["steps_done"] == 2 and state["finished"] is True


def test_a_resume_with_nothing_left_says_so_and_writes_nothing(finished_run, tmp_path):
    root = copy_of(finished_run, tmp_path)
    last = run_dir(root) / "checkpoints" / "last.ckpt"
    exported = run_dir(root) / "version_0" / "export" / "flow.safetensors"
    exported_at = exported.stat().st_mtime_ns
    # with validation data and an interval the fit would not reach: the run is over, so no note on validation
    result = cli_errors.fit(root, 1, *every_step(root), *PRETRAIN, "--ckpt_path", "last", "--data.init_args.val_path",
                            "bundled:arithmetic/val.jsonl", "--trainer.val_check_interval", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: no validation" not in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"nothing left to do: {last} is at step 1 of --trainer.max_steps 1, and its fit ended (not validated: no "
        "validation data; exported); raise --trainer.max_steps to train further")  # the run had none, this config has
    assert [p.name for p in rlfr_run.version_dirs(root)] == ["version_0"]  # no new version, no second export
    assert exported.stat().st_mtime_ns == exported_at
    assert "flow pretraining" not in result.stdout


def test_a_resume_applies_the_new_lr_and_keeps_the_finished_pretraining(finished_run, tmp_path):
    root = copy_of(finished_run, tmp_path)
    checkpoints = run_dir(root) / "checkpoints"
    result = cli_errors.fit(root, 2, *every_step(root), "--model.init_args.flow_pretrain.steps", "5",
                            "--model.init_args.optim.lr", "1e-4", "--ckpt_path", "last")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flow_pretrain.steps 5 (was 2) does not apply on resume" in result.stderr
    assert "the policy group's learning rate 5e-05 → 0.0001 (this config's)" in result.stderr
    assert "flow pretraining" not in result.stdout  # no pretraining progress: it ran before the checkpoint
    assert load(checkpoints / "flow_pretrain.ckpt")["steps_done"] == 2
    resumed = load(checkpoints / "last.ckpt")
    assert resumed["global_step"] == 2
    groups = {group["name"]: group["lr"] for group in resumed["optimizer_states"][0]["param_groups"]}
    assert groups == {"policy": 1e-4, "reward": 1e-3}
    shown = next(line for line in result.stdout.splitlines() if line.startswith("  metrics: "))
    assert (root / shown.removeprefix("  metrics: ")).is_file()  # the summary names an existing file


def test_a_finished_pretraining_is_kept_when_its_step_count_changes(finished_run, tmp_path):
    """Stopped after its pretraining, before the RL run's first checkpoint: the run again with another
    ``flow_pretrain.steps`` keeps the finished pretraining (a note, no re-run) and its file keeps its step count."""
    root = copy_of(finished_run, tmp_path)
    checkpoints = run_dir(root) / "checkpoints"
    for path in checkpoints.glob("last.ckpt*"):
        path.unlink()
    result = cli_errors.fit(root, 1, *every_step(root), "--model.init_args.flow_pretrain.steps", "5",
                            "--model.init_args.flow_pretrain.batch_size", "4", "--ckpt_path", "last")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"flow pretraining finished at step 2 ({checkpoints / 'flow_pretrain.ckpt'}); flow_pretrain.steps 5 is "
            "not applied: move the file away to pretrain afresh") in result.stderr
    assert "flow pretraining 1/5" not in result.stdout
    assert load(checkpoints / "flow_pretrain.ckpt")["steps_done"] == 2
    assert load(checkpoints / "last.ckpt")["global_step"] == 1



@pytest.mark.parametrize(("saved", "done"), [
    ("data: {init_args: {val_path: null}}\ntrainer: {val_check_interval: 1}", ["not validated: no validation data"]),
    ("trainer: {val_check_interval: 60, check_val_every_n_epoch: null}",
     ["not validated: trainer.val_check_interval 60 > 30 steps"]),
    ("trainer: {val_check_interval: 20, check_val_every_n_epoch: null}", ["last validated at step 20"]),
    ("trainer: {val_check_interval: 10, check_val_every_n_epoch: null}", ["validated at step 30"]),
    ("trainer: {val_check_interval: 0.5, check_val_every_n_epoch: 1}", []),  # an epoch schedule: nothing said
])
def test_the_nothing_left_line_says_what_the_newest_saved_config_validated(tmp_path, saved, done):
    from flowkit.lightning_cli import _validation_done

    for version, text in ((2, saved), (10, "trainer: {val_check_interval: 30}")):  # version_10 is the newest
        (tmp_path / f"version_{version}").mkdir()
        (tmp_path / f"version_{version}" / "config.yaml").write_text(text)
    assert _validation_done(tmp_path, 30) == ["validated at step 30"]
    (tmp_path / "version_10" / "config.yaml").unlink()
    assert _validation_done(tmp_path, 30) == done

REFUSED = {
    "percentiles": (["--model.init_args.reward_model.init_args.latents.percentiles", "[0.5]"],
                    "reward_model.percentiles is [0.25] there, [0.5] in this config"),
    "percentiles-count": (["--model.init_args.reward_model.init_args.latents.percentiles", "[0.25, 0.75]"],
                          "reward_model.percentiles is [0.25] there, [0.25, 0.75] in this config"),
    "depth": (["--model.init_args.reward_model.init_args.network.depth", "3"],
              "reward_model.depth is 2 there, 3 in this config"),
    "method": (["--model.init_args.reward_model", "null", "--model.init_args.flow_pretrain.steps", "0"],
               "reward_model is 'flowkit.rewards.flow.reward.FlowReward' there, 'none' in this config"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_resume_into_a_model_the_checkpoint_does_not_fit_is_one_line_before_any_work(finished_run, tmp_path, case,
                                                                                       capsys, monkeypatch):
    """``depth`` through the console script as a user meets it, the other cases in this process (the same
    :func:`flowkit.cli.main`, without a start-up of torch and Lightning each)."""
    root = copy_of(finished_run, tmp_path)
    args, problem = REFUSED[case]
    last = run_dir(root) / "checkpoints" / "last.ckpt"
    fit_args = (root, 2, *every_step(root), *PRETRAIN, *args, "--ckpt_path", "last")
    result = cli_errors.fit(*fit_args) if case == "depth" else \
        cli_errors.fit_in_process(*fit_args, capsys=capsys, monkeypatch=monkeypatch)
    assert cli_errors.one_line_error(result, max_lines=None) == (
        f"error: cannot resume {last}: {problem}; resume with the settings it was trained with, or start a new run "
        "with --trainer.default_root_dir runs/NEW_NAME")
    assert "flow pretraining" not in result.stdout
    assert load(last)["global_step"] == 1


def test_ckpt_path_at_a_file_that_is_no_lightning_checkpoint_is_one_line(finished_run, tmp_path, capsys, monkeypatch):
    """The first through the console script as a user meets it, the others in this process (the same
    :func:`flowkit.cli.main`, without a start-up of torch and Lightning each)."""
    root = copy_of(finished_run, tmp_path)
    pretraining = run_dir(root) / "checkpoints" / "flow_pretrain.ckpt"
    weights = run_dir(root) / "version_0" / "export" / "flow.safetensors"
    result = cli_errors.fit(root, 2, *every_step(root), *PRETRAIN, "--ckpt_path", str(pretraining))
    assert cli_errors.one_line_error(result, max_lines=None) == (
        f"error: --ckpt_path {pretraining} is no Lightning checkpoint (the state of an offline flow pretraining, which "
        "a fit without --ckpt_path continues); resume from the run's checkpoints/last.ckpt")
    result = cli_errors.fit_in_process(root, 2, *every_step(root), *PRETRAIN, "--ckpt_path", str(weights),
                                       capsys=capsys, monkeypatch=monkeypatch)
    assert cli_errors.one_line_error(result, max_lines=None) == (
        f"error: --ckpt_path {weights} is a safetensors file (weights only), not a Lightning checkpoint; resume from "
        "the run's checkpoints/last.ckpt")

    exported = cli_errors.run_flowkit_in_process(root, ["flowkit", "export", "--config", str(rlfr_run.CONFIG),
                                                        "--checkpoint", str(pretraining), "--out", str(root / "out")],
                                                 capsys, monkeypatch)
    assert cli_errors.one_line_error(exported, max_lines=None) == (
        f"error: checkpoint {str(pretraining)!r} is no Lightning training checkpoint (the state of an offline flow "
        "pretraining; its flow reaches export/ once the RL run that continues it saves a checkpoint); pass the run's "
        "checkpoints/last.ckpt")


# ------------------------------------------------------------------------------ cluster life

VALIDATION = ["--trainer.val_check_interval", "1", "--data.init_args.max_val_examples", "8",
              "--data.init_args.val_batch_size", "4", "--model.init_args.validation.num_samples", "2"]


def test_sigterm_in_the_final_validation_leaves_a_run_whose_resume_validates(tmp_path):
    stopped = cli_errors.run_flowkit(tmp_path, rlfr_run.command(
        tmp_path, 1, *every_step(tmp_path), *VALIDATION, "--trainer.callbacks+=resume_probes.SigtermInValidation",
        "--trainer.callbacks.step", "1"))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    last = run_dir(tmp_path) / "checkpoints" / "last.ckpt"
    assert load(last)["callbacks"]["PreemptionCheckpoint"] == {"validation_interrupted": True, "step": 1}
    assert not (run_dir(tmp_path) / "version_0" / "export").exists()

    resumed = cli_errors.run_flowkit(tmp_path, rlfr_run.command(tmp_path, 1, *every_step(tmp_path), *VALIDATION,
                                                                "--ckpt_path", "last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the checkpoint was saved in a validation that SIGTERM stopped: validating step 1 again" in resumed.stderr
    assert "  val/heldout: pass@1 " in resumed.stdout
    assert (run_dir(tmp_path) / "version_1" / "export" / "flow.safetensors").is_file()
    finished = cli_errors.run_flowkit(tmp_path, rlfr_run.command(tmp_path, 1, *every_step(tmp_path), *VALIDATION,
                                                                 "--ckpt_path", "last"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.splitlines()[-1] == (
        f"nothing left to do: {last} is at step 1 of --trainer.max_steps 1, and its fit ended (validated at step 1; "
        "exported); raise --trainer.max_steps to train further")


def slurm_env(restarts: int) -> dict[str, str]:
    """A SLURM job step of one task, as srun sets it (SLURM_RESTART_COUNT counts the requeues)."""
    return {**rlfr_run.env(), "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NAME": "rlfr",
            "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_NODELIST": "localhost", "SLURM_RESTART_COUNT": str(restarts)}


def slurm_fit(root: Path, restarts: int, *extra: str) -> subprocess.CompletedProcess:
    args = rlfr_run.command(root, 3, "--data.init_args.val_path", "null", *every_step(root), *extra)
    return subprocess.run(args, cwd=root, env=slurm_env(restarts), capture_output=True, text=True, timeout=600,
                          check=False)


def test_a_requeued_slurm_job_resumes_and_a_moved_run_resumes_into_its_own_last_checkpoint(tmp_path):
    first, moved = tmp_path / "first", tmp_path / "moved"
    first.mkdir()
    killed = slurm_fit(first, 0, "--trainer.callbacks+=resume_probes.SlurmTimeLimit", "--trainer.callbacks.step", "2")
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = run_dir(first) / "checkpoints"
    hpc = run_dir(first) / "hpc_ckpt_1.ckpt"
    assert load(hpc)["global_step"] == 2 and load(checkpoints / "last.ckpt")["global_step"] == 1
    shutil.copytree(first / "runs", moved / "runs")  # the same run, elsewhere (`mv runs/A runs/B`)

    requeued = slurm_fit(first, 1)  # the same command, requeued
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"resuming from the newest checkpoint, {hpc}" in requeued.stderr
    assert sorted(rlfr_run.metrics(rlfr_run.version_dirs(first)[-1])) == [3]  # only step 3 ran (metrics.csv counts from 1)
    assert load(checkpoints / "last.ckpt")["global_step"] == 3

    # Outside SLURM, `--ckpt_path last` also takes the newest, the hpc checkpoint; the moved run writes its own last.ckpt.
    resumed = cli_errors.fit(moved, 3, *every_step(moved), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from the newest checkpoint, {run_dir(moved) / 'hpc_ckpt_1.ckpt'}" in resumed.stderr
    moved_checkpoints = run_dir(moved) / "checkpoints"
    assert sorted(p.name for p in moved_checkpoints.iterdir()) == ["last.ckpt", "last.ckpt.previous"]
    assert load(moved_checkpoints / "last.ckpt")["global_step"] == 3


@pytest.mark.slow
def test_ddp_resumes_at_another_number_of_ranks(finished_run, tmp_path):
    """The one-rank DDP checkpoint continues on 2 ranks, and that 2-rank checkpoint on 1 rank."""
    root = copy_of(finished_run, tmp_path)
    last = run_dir(root) / "checkpoints" / "last.ckpt"
    two = cli_errors.fit(root, 2, *every_step(root), *DDP, "--trainer.devices", "2", "--ckpt_path", "last",
                         timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert load(last)["global_step"] == 2
    one = cli_errors.fit(root, 3, *every_step(root), *DDP, "--ckpt_path", "last", timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert load(last)["global_step"] == 3
    assert sorted(rlfr_run.metrics(rlfr_run.version_dirs(root)[-1])) == [3]  # the third RL step (metrics.csv counts from 1)


def zero_resume(root: Path, stage: int, ranks: int, steps: int, *extra: str) -> dict[str, torch.Tensor]:
    """The tiny job under ZeRO-``stage`` on ``ranks`` CPU processes up to ``steps``; rank 0's weights at the start of
    training (after any restore) by name."""
    import test_strategies

    test_strategies.run_rlfr(root, stage, ranks, *extra, steps=steps)
    weights = load_file(str(root / "weights" / "rank0.safetensors"))
    return {k.removeprefix("start/"): v for k, v in weights.items() if k.startswith("start/")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_resumes_at_another_number_of_ranks(tmp_path, stage):
    """2 → 1 → 2 ranks: each resume starts from the saved weights exactly (DeepSpeed's universal checkpoint carries
    the fp32 weights and Adam moments whole, whatever the number of ranks that saved them)."""
    from flowkit.checkpointing.resume import checkpoint_metadata
    from flowkit.checkpointing.safe_loading import consolidated_state_dict
    from flowkit.strategies import zero_checkpoint_ranks

    last = run_dir(tmp_path) / "checkpoints" / "last.ckpt"
    zero_resume(tmp_path, stage, 2, 1)
    for ranks, steps in ((1, 2), (2, 3)):
        saved = consolidated_state_dict(last)
        started = zero_resume(tmp_path, stage, ranks, steps, "--ckpt_path", "last")
        assert started.keys() <= saved.keys() and any(k.startswith("reward_model.") for k in started)
        for name, tensor in started.items():
            torch.testing.assert_close(tensor, saved[name].float(), rtol=0, atol=0, msg=name)
        assert checkpoint_metadata(last)["global_step"] == steps
        assert zero_checkpoint_ranks(last) == ranks
        assert len(list((last / "checkpoint").glob("*optim_states.pt"))) == ranks  # no partitions of other ranks left
    assert not list(last.parent.glob(".*universal"))  # the conversion is removed after the load


def test_a_checkpoint_that_recorded_the_flow_reward_under_its_old_module_resumes():
    """Checkpoints written before FlowReward moved to flowkit.rewards.flow record its class as
    flowkit.rewards.flow_reward.FlowReward: the same class, so the resume is not refused; another class still is."""
    from flowkit.errors import ConfigError
    from flowkit.modules.policy_checkpoints import REWARD_MODEL_KEY, check_resume, reward_model_settings
    from flowkit.rewards import FlowReward

    reward_model = FlowReward()
    recorded = {**reward_model_settings(reward_model), "class": "flowkit.rewards.flow_reward.FlowReward"}

    def resume(settings: dict) -> None:
        check_resume({REWARD_MODEL_KEY: settings, "hyper_parameters": {}}, "last.ckpt", backbone="tiny",
                     reward_model=reward_model, own_state={}, pretrain_steps=0)

    resume(recorded)
    with pytest.raises(ConfigError, match="reward_model is 'flowkit.rewards.ExplanationReward' there"):
        resume({**recorded, "class": "flowkit.rewards.ExplanationReward"})
