"""Faults lose nothing: pre-emption in offline flow pretraining, resumes keep one ``last.ckpt``, a kill before the
export still ends with ``export/``, concurrent checkpoint writers, and outputs checked before the work."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lightning as L
import cli_errors
import pytest
import rlfr_run
import torch

from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from flowkit.checkpointing.atomic_files import AtomicCheckpointIO
from flowkit.checkpointing.run_lock import lock_run_directory
from flowkit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def run_script(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=rlfr_run.env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


# ------------------------------------------------------------------------------ SIGTERM in flow pretraining

class StreamReader:
    """Collects a child's output stream in a thread, so the test can wait for a progress line while it runs."""

    def __init__(self, stream):
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for chunk in iter(lambda: stream.read(64), ""):
            self.text += chunk

    def join(self) -> str:
        self._thread.join(timeout=60)
        return self.text


@pytest.mark.slow
def test_sigterm_during_flow_pretraining_saves_it_and_the_resume_continues(tmp_path):
    steps = 3000  # a progress line (stdout is not a terminal) every 300 steps; SIGTERM after the first
    pretrain = ["--model.init_args.flow_pretrain.steps", str(steps), "--model.init_args.flow_pretrain.batch_size", "4"]
    args = rlfr_run.command(tmp_path, 1, *pretrain)
    process = subprocess.Popen(args, env=rlfr_run.env(), cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    progress, reader = StreamReader(process.stdout), StreamReader(process.stderr)
    deadline = time.monotonic() + 240
    while not re.search(rf"flow pretraining \d+/{steps}\b", progress.text):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"pretraining never got going:\n{progress.join()[-1000:]}\n{reader.join()[-3000:]}")
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, reader.join()[-3000:]
    stderr = reader.join()
    assert "SIGTERM during flow pretraining: saved step" in stderr
    assert "Traceback" not in stderr

    state_path = tmp_path / "runs" / "rlfr_tiny" / "checkpoints" / "flow_pretrain.ckpt"
    saved = torch.load(state_path, weights_only=True)
    done = saved["steps_done"]
    assert 300 <= done < steps
    assert not (state_path.parent / "last.ckpt").exists()  # nothing of the RL run exists yet

    # The resume continues the pretraining from the saved step (2 more steps here), then trains.
    resumed = rlfr_run.run(tmp_path, 1, "--model.init_args.flow_pretrain.steps", str(done + 2),
                           "--model.init_args.flow_pretrain.batch_size", "4", "--ckpt_path", "last")
    assert f"continuing from {state_path} at step {done} of {done + 2}" in resumed.stderr
    finished = torch.load(state_path, weights_only=True)
    assert finished["steps_done"] == done + 2
    assert any(not torch.equal(finished["reward_model"][k], v) for k, v in saved["reward_model"].items()
               if isinstance(v, torch.Tensor) and v.is_floating_point())
    assert torch.load(state_path.parent / "last.ckpt", weights_only=True)["global_step"] == 1


def pretrained_flow(root: Path, steps: int, sigterm_in_step: int | None = None) -> dict[str, torch.Tensor]:
    """Offline flow pretraining of a fresh tiny PolicyModule (seed 0) whose checkpoint directory is ``root``;
    with ``sigterm_in_step`` the process sends itself SIGTERM during that (1-based) step."""
    from types import SimpleNamespace

    from flowkit.modules.datamodule import RolloutDataModule
    from flowkit.modules.policy import PolicyModule
    from flowkit.modules.policy_options import FlowPretrainOptions, SamplingOptions
    from flow_options import flow_reward

    L.seed_everything(0, verbose=False)
    module = PolicyModule(reward_model=flow_reward(percentiles=[0.5], depth=1, seed=0, pretrain_timesteps=1),
                          sampling=SamplingOptions(max_new_tokens=8),
                          flow_pretrain=FlowPretrainOptions(steps=steps, batch_size=4))
    data = RolloutDataModule(batch_size=4, val_path=None)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    module.trainer = SimpleNamespace(datamodule=data, is_global_zero=True, checkpoint_callback=None,
                                     default_root_dir=str(root))
    if sigterm_in_step is not None:
        losses, calls = module.reward_model.pretrain_losses, []

        def losses_then_sigterm(*args):
            calls.append(1)
            if len(calls) == sigterm_in_step:
                os.kill(os.getpid(), signal.SIGTERM)
            return losses(*args)

        module.reward_model.pretrain_losses = losses_then_sigterm
    module.pretrain_reward_model()
    return module.reward_model.state_dict()


def test_pretraining_stopped_by_sigterm_resumes_to_the_uninterrupted_result(tmp_path, single_thread):
    from flowkit.checkpointing.preemption import PretrainingPreempted

    straight = pretrained_flow(tmp_path / "straight", 5)
    with pytest.raises(PretrainingPreempted):
        pretrained_flow(tmp_path / "stopped", 5, sigterm_in_step=2)  # finishes step 2, saves, stops
    state_path = tmp_path / "stopped" / "checkpoints" / "flow_pretrain.ckpt"
    assert torch.load(state_path, weights_only=True)["steps_done"] == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the pretraining

    resumed = pretrained_flow(tmp_path / "stopped", 5)
    assert resumed.keys() == straight.keys()
    for name, tensor in straight.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(resumed[name], tensor), name
    assert torch.load(state_path, weights_only=True)["steps_done"] == 5


# ------------------------------------------------------------------------------ one last.ckpt after a resume

class Toy(L.LightningModule):
    """One linear layer; with ``sigterm_at`` it sends itself SIGTERM in that step (as a pre-emption would)."""

    def __init__(self, sigterm_at: int | None = None):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.sigterm_at = sigterm_at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def export_artifacts(self, directory: Path) -> dict[str, Path]:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.layer.state_dict(), directory / "layer.pt")
        return {"layer": directory / "layer.pt"}


class KillBeforeExport(L.Callback):
    def on_train_end(self, trainer, pl_module):
        os.kill(os.getpid(), signal.SIGKILL)


def toy_fit(root: Path, max_steps: int, every: int, mode: str) -> None:
    """``mode``: ``sigterm`` (at step 3), ``kill-before-export`` (SIGKILL after the final checkpoint) or ``resume``."""
    from flowkit.checkpointing.preemption import PreemptionCheckpoint
    from flowkit.modules.callbacks import ExportArtifacts

    root = Path(root)
    callbacks = [PreemptionCheckpoint(), ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=0,
                                                         every_n_train_steps=every)]
    callbacks += [KillBeforeExport()] if mode == "kill-before-export" else []
    trainer = L.Trainer(default_root_dir=root, max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                        callbacks=[*callbacks, ExportArtifacts()])
    trainer.fit(Toy(sigterm_at=3 if mode == "sigterm" else None),
                DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4),
                ckpt_path="last" if mode == "resume" else None)


def run_toy(root: Path, max_steps: int, every: int, mode: str) -> subprocess.CompletedProcess:
    return run_script(f"import test_faults; test_faults.toy_fit({str(root)!r}, {max_steps}, {every}, {mode!r})")


def test_resume_after_sigterm_keeps_one_last_checkpoint(tmp_path):
    # SIGTERM at step 3, before the first periodic checkpoint (step 5) has named last.ckpt in ModelCheckpoint's state.
    stopped = run_toy(tmp_path, 10, 5, "sigterm")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    checkpoints = tmp_path / "ckpt"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 4  # saved on SIGTERM

    toy_fit(tmp_path, 10, 5, "resume")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "last.ckpt.previous"]  # no last-v1.ckpt
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 10


def test_kill_after_the_final_checkpoint_still_ends_with_the_export(tmp_path):
    killed = run_toy(tmp_path, 4, 2, "kill-before-export")
    assert killed.returncode == -signal.SIGKILL
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert not (tmp_path / "export").exists()

    # The resume finds max_steps reached, trains nothing, and writes the artifacts of the checkpoint.
    toy_fit(tmp_path, 4, 2, "resume")
    exported = torch.load(tmp_path / "export" / "layer.pt", weights_only=True)
    final = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(exported["weight"], final["layer.weight"])


# ------------------------------------------------------------------------------ concurrent checkpoint writers

WRITER = """
import sys
import torch
from flowkit.checkpointing.atomic_files import AtomicCheckpointIO

target, writer, saves = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
io = AtomicCheckpointIO()
for n in range(saves):
    data = torch.rand(2_000 + 500 * ((writer + n) % 7))
    io.save_checkpoint({"writer": writer, "n": n, "data": data, "sum": float(data.sum())}, target)
print("done", flush=True)
"""


def test_processes_saving_to_one_directory_never_expose_a_partial_file(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"writer": -1, "n": 0, "data": torch.zeros(1), "sum": 0.0}, target)
    writers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(target), str(i), "50"],
                                env=rlfr_run.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    reads, seen = 0, set()
    while any(w.poll() is None for w in writers):
        checkpoint = torch.load(target, weights_only=True)  # any partial file fails to load
        assert checkpoint["sum"] == pytest.approx(float(checkpoint["data"].sum()))
        seen.add(checkpoint["writer"])
        reads += 1
        time.sleep(0.002)  # leave the CPU to the writers
    for writer in writers:
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0 and out.strip() == "done", err[-2000:]
    assert reads > 10 and len(seen) >= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.previous"]  # no temporary file left


# ------------------------------------------------------------------------------ export into a non-empty directory

class Exportable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def export_artifacts(self, directory: Path) -> dict[str, Path]:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_model.safetensors").write_text("new")
        return {"policy": directory / "adapter_model.safetensors"}


def test_export_refuses_a_non_empty_directory_unless_overwrite_then_replaces_it_whole(tmp_path, capsys):
    from flowkit.commands.export import export

    module, checkpoint, out = Exportable(), tmp_path / "a.ckpt", tmp_path / "export"
    torch.save({"state_dict": module.state_dict()}, checkpoint)
    out.mkdir()
    (out / "model.safetensors").write_text("old full model")

    with pytest.raises(ConfigError, match="is not empty: pass --overwrite"):
        export(None, module, None, checkpoint=str(tmp_path / "never-read.ckpt"), out=str(out))  # checked first
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]

    export(None, module, None, checkpoint=str(checkpoint), out=str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_model.safetensors"]
    assert f"exported policy: {out / 'adapter_model.safetensors'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "export"]  # no staging directory left

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        export(None, module, None, checkpoint=str(checkpoint), out=str(tmp_path / "file"), overwrite=True)
    export(None, module, None, checkpoint=str(checkpoint), out=str(tmp_path / "fresh"))  # empty or missing: fine
    assert (tmp_path / "fresh" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------------------ score outputs checked first

@pytest.fixture(scope="module")
def flow_policy():
    from flowkit.modules.policy import PolicyModule
    from flowkit.modules.policy_options import SamplingOptions
    from flow_options import flow_reward

    torch.manual_seed(0)
    return PolicyModule(reward_model=flow_reward(percentiles=[0.5], depth=1, seed=0),
                        sampling=SamplingOptions(max_new_tokens=8))


def test_score_creates_missing_output_directories_and_checks_outputs_before_work(tmp_path, flow_policy, single_thread):
    from flowkit.commands.score import score

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "47+38=", "response": "7+8=15,4+3+1=8\\boxed{85}"}) + "\n")
    output, page = tmp_path / "a" / "scores.jsonl", tmp_path / "missing" / "dir" / "scores.html"
    score(None, flow_policy, None, input=str(pairs), output=str(output), html_output=str(page))
    assert len(output.read_text().splitlines()) == 1
    assert page.read_text().startswith("<!doctype html>")

    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        score(None, flow_policy, None, input=str(tmp_path / "never-read.jsonl"), output=str(tmp_path / "b.jsonl"),
              html_output=str(tmp_path / "taken"))
    assert not (tmp_path / "b.jsonl").exists()


# ------------------------------------------------------------------------------ a full disk, two runs at once

EVERY_STEP = ("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
              "      init_args: {save_last: true, save_top_k: 0, every_n_train_steps: 1}\n")


@pytest.mark.slow  # two runs of the CLI: a checkpoint to keep, then the resume whose save fails
def test_a_write_that_fails_mid_checkpoint_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """Resumed with every file capped at 1 MiB (the checkpoint is 13 MB), the save fails with EFBIG as it would with
    ENOSPC on a full disk: one line naming the file, and the step-1 last.ckpt stays whole."""
    (tmp_path / "every_step.yaml").write_text(EVERY_STEP)
    every_step = ["--config", str(tmp_path / "every_step.yaml")]
    first = cli_errors.fit(tmp_path, 1, *every_step)
    assert first.returncode == 0, first.stderr[-3000:]
    last = tmp_path / "runs" / "rlfr_tiny" / "checkpoints" / "last.ckpt"
    saved = last.read_bytes()

    result = cli_errors.fit(tmp_path, 2, *every_step, "--ckpt_path", "last", file_size=1 << 20)
    assert cli_errors.one_line_error(result, max_lines=None) == (
        f"error: cannot write checkpoint {last}: File too large; last.ckpt there is unchanged")
    assert last.read_bytes() == saved
    assert torch.load(last, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # the partial temporary file is gone


def test_a_second_fit_in_a_run_directory_in_use_refuses_and_a_killed_runs_lock_blocks_nothing(tmp_path):
    run_dir = tmp_path / "runs" / "rlfr_tiny"
    first = subprocess.Popen(rlfr_run.command(tmp_path, 100_000, "--data.init_args.val_path", "null"),
                             env=rlfr_run.env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / ".flowkit.lock").is_file() or not (run_dir / ".flowkit.lock").read_text():
            if first.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the first run never locked its directory:\n{first.communicate()[1][-3000:]}")
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # it holds the lock while frozen, and leaves the CPU to the second run
        second = cli_errors.fit(tmp_path, 0)
        assert cli_errors.one_line_error(second).startswith(
            f"error: {run_dir} is in use by another run (process {first.pid} on ")
        assert first.poll() is None  # the refusal did not touch the first run
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert (run_dir / ".flowkit.lock").read_text().startswith(f"process {first.pid} ")  # left behind by the kill
    lock_run_directory(run_dir).release()  # yet it blocks nothing (this test is another process)
