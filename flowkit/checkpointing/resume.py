"""What a fit resumes: the checkpoint ``--ckpt_path last`` (or a SLURM requeue) finds, its metadata, and a resumed
run saving into its own ``last.ckpt``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from flowkit.checkpointing.atomic_files import unreadable_checkpoint
from flowkit.errors import ConfigError

EXPORTED_KEY = "exported"  # in a checkpoint: the fit had written its artifacts (flowkit.modules.ExportArtifacts)

HPC_CHECKPOINT_GLOB = "hpc_ckpt_*.ckpt"  # Lightning's SLURM requeue (SIGUSR1) saves these in the run directory


def resume_checkpoint(trainer: L.Trainer) -> str | None:
    """The checkpoint this fit resumes, None for a fresh fit.

    Lightning sets ``trainer.ckpt_path`` only when it restores the checkpoint: after the module's ``setup``, and under
    DeepSpeed only after ``strategy.setup``; the flowkit CLI's trainer knows it from ``fit``'s argument on.
    """
    return trainer.ckpt_path or getattr(trainer, "requested_ckpt_path", None)


def newest_checkpoint(run_dir: Path, checkpoint_dirs: list[Path]) -> Path | None:
    """The newest of the run's ``last*.ckpt`` (in ``checkpoint_dirs``) and ``hpc_ckpt_N.ckpt`` (in ``run_dir``), by
    the time it was saved (Lightning's own ``last`` takes the newest ``last*.ckpt`` and never an hpc checkpoint)."""
    candidates = [path for directory in checkpoint_dirs if directory.is_dir() for path in directory.glob("last*.ckpt")]
    if run_dir.is_dir():
        candidates += run_dir.glob(HPC_CHECKPOINT_GLOB)
    return max(candidates, key=_saved_at, default=None)


def _saved_at(path: Path) -> int:
    # DeepSpeed rewrites a checkpoint directory's `latest` file at every save; the directory's own time stays.
    try:
        return (path / "latest" if path.is_dir() else path).stat().st_mtime_ns
    except OSError:
        return -1


def requeued_slurm_job() -> bool:
    """This process is a SLURM job step that ran before: requeued by Lightning's SIGUSR1 handler (``scontrol
    requeue``) or by SLURM after a pre-emption (``--requeue``), which count ``SLURM_RESTART_COUNT`` up."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect() and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0


def checkpoint_metadata(path: Path) -> dict[str, Any] | None:
    """A Lightning checkpoint's contents without its weights' data (memory-mapped), for checks before a resume;
    None when the file cannot be read (the resume itself then falls back to the checkpoint before it).

    A DeepSpeed checkpoint directory: its client state (rank 0's ``*model_states.pt``, which Lightning fills with
    everything but the sharded weights and optimizer).
    Raises :class:`~flowkit.errors.ConfigError` for a file that is no Lightning checkpoint.
    """
    if path.is_dir():
        tag = (path / "latest").read_text().strip() if (path / "latest").is_file() else None
        # mp_rank_00_model_states.pt (ZeRO-2), or rank 0's zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3)
        states = next(iter(sorted((path / tag).glob("*model_states.pt"))), None) if tag else None
        if states is None:
            raise ConfigError(f"--ckpt_path {path} is a directory but no DeepSpeed checkpoint (no 'latest' file "
                              "naming its model states)")
        return torch.load(states, map_location="cpu", weights_only=True, mmap=True)
    if path.is_file() and _is_safetensors(path):  # torch.load reads these too, as a plain dict of tensors
        raise ConfigError(f"--ckpt_path {path} is a safetensors file (weights only), not a Lightning checkpoint; "
                          "resume from the run's checkpoints/last.ckpt")
    try:
        metadata = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        if unreadable_checkpoint(err) is None:
            raise
        return None
    if not isinstance(metadata, dict) or "pytorch-lightning_version" not in metadata:
        what = ("the state of an offline flow pretraining, which a fit without --ckpt_path continues"
                if isinstance(metadata, dict) and "steps_done" in metadata else "not a training checkpoint")
        raise ConfigError(f"--ckpt_path {path} is no Lightning checkpoint ({what}); resume from the run's "
                          "checkpoints/last.ckpt")
    return metadata


def _is_safetensors(path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then that many bytes of JSON."""
    with path.open("rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


class ResumeInPlace(L.Callback):
    """A resumed run keeps saving into its own ``last.ckpt``, also after its directory moved (``mv runs/A runs/B``);
    a checkpoint records whether the fit had written its export (:data:`EXPORTED_KEY`) when it was saved.

    ModelCheckpoint restores the path of the last checkpoint only when the checkpoint directory is the one it was
    saved from; otherwise it finds ``last.ckpt`` present but not its own and writes ``last-v1.ckpt`` beside it.
    """

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[EXPORTED_KEY] = any(getattr(callback, "exported", False) for callback in trainer.callbacks)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if resume_checkpoint(trainer) is None:
            return
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint) or not callback.dirpath or not callback.save_last:
                continue
            own = Path(callback.dirpath) / (callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
            if own.exists() and Path(callback.last_model_path or "").parent.resolve() != own.parent.resolve():
                callback.last_model_path = str(own)
