import errno
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import flowkit.checkpointing.atomic_files as atomic_files
from flowkit.checkpointing.atomic_files import AtomicCheckpointIO
from flowkit.checkpointing.preemption import PreemptionCheckpoint
from flowkit.checkpointing.rng_state import RNGStateCheckpoint
from flowkit.checkpointing.run_lock import lock_run_directory
from flowkit.errors import RunError

ROOT = Path(__file__).resolve().parent.parent


def run_child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"child exited early ({process.returncode}):\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("child never reached the marker")
        time.sleep(0.05)


SLOW_WRITER = """
import sys, time
from pathlib import Path
import torch
import flowkit.checkpointing.atomic_files as atomic_files

target, marker = Path(sys.argv[1]), Path(sys.argv[2])
io = atomic_files.AtomicCheckpointIO()
io.save_checkpoint({"step": 1, "weights": torch.arange(1000.0)}, target)

real_save = torch.save
def slow_save(obj, f):
    # Half the bytes reach the file, then the writer stalls until it is killed.
    import io as _io
    buffer = _io.BytesIO()
    real_save(obj, buffer)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    marker.touch()
    time.sleep(600)
atomic_files.torch.save = slow_save
io.save_checkpoint({"step": 2, "weights": torch.arange(100000.0)}, target)
"""


def test_kill_during_atomic_write_leaves_previous_checkpoint_intact(tmp_path):
    target, marker = tmp_path / "last.ckpt", tmp_path / "half-written"
    child = run_child(SLOW_WRITER, str(target), str(marker))
    wait_for(marker, child)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)

    partial = tmp_path / f".last.ckpt.{socket.gethostname()}.{child.pid}.tmp"
    assert partial.exists() and partial.stat().st_size > 0, "the kill did not land during the write"
    checkpoint = torch.load(target, weights_only=True)
    assert checkpoint["step"] == 1
    assert torch.equal(checkpoint["weights"], torch.arange(1000.0))

    # The next save replaces the target and removes the dead writer's temporary file.
    AtomicCheckpointIO().save_checkpoint({"step": 3}, target)
    assert torch.load(target, weights_only=True) == {"step": 3}
    assert not partial.exists()


class NoisyModule(L.LightningModule):
    """Each step draws from the torch, numpy and Python RNGs and records the draws."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.draws: list[tuple[float, float, float]] = []

    def training_step(self, batch, batch_idx):
        self.draws.append((torch.rand(()).item(), float(np.random.rand()), random.random()))
        noise = torch.randn_like(batch[0])
        return self.layer(batch[0] + noise).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class EndlessBatches(torch.utils.data.IterableDataset):
    """The same batch forever (like the RL prompt stream, its iteration draws no random numbers)."""

    def __iter__(self):
        while True:
            yield (torch.ones(4, 2),)


def loader() -> DataLoader:
    return DataLoader(EndlessBatches(), batch_size=None)


def fit(root: Path, max_steps: int, callbacks: list, ckpt_path: str | None = None) -> NoisyModule:
    L.seed_everything(7, verbose=False)
    module = NoisyModule()
    trainer = L.Trainer(
        default_root_dir=root, max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[AtomicCheckpointIO()],
        callbacks=[*callbacks, L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_last=True,
                                                                    every_n_train_steps=3, save_top_k=0)],
    )
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize("with_rng_callback", [True, False])
def test_resumed_run_draws_the_same_random_numbers(tmp_path, with_rng_callback):
    callbacks = [RNGStateCheckpoint()] if with_rng_callback else []
    straight = fit(tmp_path / "straight", 6, callbacks)
    fit(tmp_path / "resumed", 3, callbacks)
    # A fresh process would start from other RNG states; scramble them to stand in for that.
    L.seed_everything(12345, verbose=False)
    resumed = fit(tmp_path / "resumed", 6, callbacks, ckpt_path=str(tmp_path / "resumed" / "ckpt" / "last.ckpt"))

    same_draws = resumed.draws == straight.draws[3:]
    same_weights = all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters()))
    assert len(resumed.draws) == 3
    assert same_draws == with_rng_callback
    assert same_weights == with_rng_callback


SIGTERM_JOB = """
import sys, time
from pathlib import Path
import lightning as L, torch
from torch.utils.data import DataLoader, TensorDataset
from flowkit.checkpointing.preemption import PreemptionCheckpoint

root, marker = Path(sys.argv[1]), Path(sys.argv[2])

class Slow(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            marker.touch()
        time.sleep(0.2)
        return self.layer(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(default_root_dir=root, max_steps=10_000, accelerator="cpu", logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[PreemptionCheckpoint(),
                               L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_top_k=0)])
trainer.fit(Slow(), DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4))
print("fit returned", flush=True)
"""


def test_sigterm_writes_last_checkpoint_and_exits_cleanly(tmp_path):
    marker = tmp_path / "step3"
    child = run_child(SIGTERM_JOB, str(tmp_path), str(marker))
    wait_for(marker, child)
    child.send_signal(signal.SIGTERM)
    output, _ = child.communicate(timeout=120)

    assert child.returncode == 0, output
    assert "fit returned" not in output  # it stopped, rather than training to max_steps
    last = tmp_path / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert 4 <= checkpoint["global_step"] < 10_000
    assert "SIGTERM: saving" in output


def test_preemption_checkpoint_path_without_model_checkpoint(tmp_path):
    trainer = L.Trainer(default_root_dir=tmp_path, enable_checkpointing=False, logger=False)
    assert PreemptionCheckpoint.last_checkpoint_path(trainer) == tmp_path / "checkpoints" / "last.ckpt"


# ------------------------------------------------------------------------------ the checkpoint before, a full disk


def test_a_save_keeps_the_checkpoint_it_replaces_and_a_load_falls_back_to_it(tmp_path, caplog):
    io, target = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    for step in (1, 2, 3):
        io.save_checkpoint({"global_step": step}, target)
    previous = tmp_path / "last.ckpt.previous"
    assert torch.load(previous, weights_only=True) == {"global_step": 2}
    assert io.load_checkpoint(target) == {"global_step": 3}

    target.write_bytes(target.read_bytes()[:50])  # truncated after it was written
    with caplog.at_level("WARNING", logger="flowkit.checkpointing"):
        assert io.load_checkpoint(target) == {"global_step": 2}
    assert f"{target} cannot be read (PytorchStreamReader failed reading zip archive" in caplog.text
    io.save_checkpoint({"global_step": 4}, target)  # over the truncated file: the good previous one stays
    assert torch.load(previous, weights_only=True) == {"global_step": 2}

    io.remove_checkpoint(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_without_keep_previous_nothing_is_kept_and_an_unreadable_checkpoint_is_one_line(tmp_path):
    io, target = AtomicCheckpointIO(keep_previous=False), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, target)
    io.save_checkpoint({"global_step": 2}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    target.write_bytes(b"")
    with pytest.raises(RunError, match=rf"^cannot resume from {target}: the file is empty or ends early, and no "
                                       r"previous checkpoint \(last.ckpt.previous\) is kept beside it"):
        io.load_checkpoint(target)
    with pytest.raises(RunError, match=f"^checkpoint {tmp_path / 'missing.ckpt'} does not exist$"):
        io.load_checkpoint(tmp_path / "missing.ckpt")


def test_a_checkpoint_holding_objects_is_refused_not_replaced_by_the_previous_one(tmp_path):
    from test_security import Payload

    from flowkit.checkpointing.safe_loading import UnsafeCheckpointError, tensors_only_loading

    io, target, marker = AtomicCheckpointIO(), tmp_path / "last.ckpt", tmp_path / "marker"
    io.save_checkpoint({"global_step": 1}, target)
    io.save_checkpoint({"global_step": 2}, target)
    torch.save({"global_step": 3, "payload": Payload(marker)}, target)
    with pytest.raises(UnsafeCheckpointError, match=r"holds a pickled io\.open"), tensors_only_loading(target):
        io.load_checkpoint(target)
    assert not marker.exists()


def test_a_failed_write_names_the_file_and_leaves_the_checkpoint_as_it_was(tmp_path, monkeypatch):
    io, target = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, target)
    real_save = torch.save

    def disk_full(obj, f):
        real_save({"partial": torch.zeros(10)}, f)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic_files.torch, "save", disk_full)
    with pytest.raises(RunError, match=rf"^cannot write checkpoint {target}: No space left on device; last.ckpt there "
                                       "is unchanged$"):
        io.save_checkpoint({"global_step": 2}, target)
    with pytest.raises(RunError, match=rf"^cannot write checkpoint {tmp_path / 'new.ckpt'}: No space left on device; "
                                       "nothing was saved$"):
        io.save_checkpoint({"global_step": 2}, tmp_path / "new.ckpt")
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"global_step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file, no .previous


def test_export_of_an_unreadable_checkpoint_is_one_line_naming_the_one_before_it(tmp_path):
    from flowkit.checkpointing.safe_loading import consolidated_state_dict

    io, target = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    for step in (1, 2):
        io.save_checkpoint({"state_dict": {"w": torch.full((2,), float(step))}}, target)
    target.write_bytes(b"")
    with pytest.raises(RunError, match=rf"^checkpoint '{target}' cannot be read: the file is empty or ends early; the "
                                       rf"one before it is {tmp_path / 'last.ckpt.previous'}$"):
        consolidated_state_dict(target)
    assert torch.equal(consolidated_state_dict(tmp_path / "last.ckpt.previous")["w"], torch.full((2,), 1.0))


# ------------------------------------------------------------------------------ run directory locks


def test_only_global_rank_zero_locks_the_run_directory(tmp_path, monkeypatch):
    for name in ("RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank Lightning launched for the same job
    assert lock_run_directory(tmp_path / "a") is None and not (tmp_path / "a").exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("NODE_RANK", "1")  # local rank 0 of the second node
    assert lock_run_directory(tmp_path / "a") is None
    monkeypatch.setenv("NODE_RANK", "0")
    lock = lock_run_directory(tmp_path / "a")
    try:
        assert (tmp_path / "a" / ".flowkit.lock").read_text() == f"process {os.getpid()} on {socket.gethostname()}\n"
    finally:
        lock.release()
