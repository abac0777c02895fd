"""Fault tolerance: atomic checkpoint files, RNG state in checkpoints, a checkpoint on SIGTERM.

* :class:`AtomicCheckpointIO` writes a checkpoint to a temporary file in the target's own directory,
  fsyncs it and ``os.replace``-s it over the target: a kill at any moment leaves either the old or the
  new checkpoint, never a truncated one. (Lightning's default writes through an fsspec transaction whose
  temporary file lives in the system temp dir; when that is another filesystem the final move is a
  copy, which a kill can interrupt.)
* :class:`RNGStateCheckpoint` stores the torch (CPU and CUDA), numpy and Python RNG states and restores
  them right before the first training batch after a resume — not at load time, because building the
  dataloader iterator draws from the torch RNG in between.
* :class:`PreemptionCheckpoint` builds on Lightning's SIGTERM handling: Lightning notes the signal, lets
  the running batch finish and stops with ``SIGTERMException`` (a ``SystemExit``); this callback writes
  ``last.ckpt`` (where ``--ckpt_path last`` finds it) before the process exits with status 0.

:func:`fault_tolerance_defaults` is what the ``flowkit`` CLI adds to every Trainer.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

RNG_KEY = "rng_states"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``.<name>.tmp`` beside the target, fsync, then ``os.replace`` onto the target."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        try:
            with temporary.open("wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX: a rename is persisted by syncing the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_states() -> dict[str, Any]:
    """All global RNG states: torch CPU, torch CUDA (if initialised), numpy, Python."""
    states = {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    numpy = states["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["cached_gaussian"]))
    random.setstate(_as_python_state(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _numpy_state() -> dict[str, Any]:
    # Plain tensors and numbers, so the checkpoint still loads with torch.load(weights_only=True).
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian)}


def _as_python_state(state: Any) -> tuple:
    # A weights_only load turns the (version, tuple, gauss) state into lists; random.setstate wants tuples.
    version, internal, gauss = state
    return version, tuple(internal), gauss


class RNGStateCheckpoint(L.Callback):
    """Saves every rank's RNG states in the checkpoint; restores them before the first resumed batch."""

    def __init__(self):
        self._pending: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        states = [rng_states()]
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            # Rank 0 may be the only writer, so it keeps every rank's states.
            states = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, rng_states())
        checkpoint[RNG_KEY] = states

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(RNG_KEY)
        if states is None:
            log.warning("checkpoint has no RNG states; the resumed run will not repeat the interrupted one exactly")
            return
        if len(states) != trainer.world_size:
            log.warning("checkpoint holds RNG states of %d ranks, this run has %d; not restoring them",
                        len(states), trainer.world_size)
            return
        self._pending = states[trainer.global_rank]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._pending is not None:
            set_rng_states(self._pending)
            self._pending = None


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, write ``<checkpoint dir>/last.ckpt`` after the running batch; the process then exits 0."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        path = self.last_checkpoint_path(trainer)
        log.warning("SIGTERM: saving %s at step %d before exiting", path, trainer.global_step)
        trainer.save_checkpoint(path)

    @staticmethod
    def last_checkpoint_path(trainer: L.Trainer) -> Path:
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            directory = Path(callback.dirpath)
            name = callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
        else:
            directory = Path(trainer.default_root_dir) / "checkpoints"
            name = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION
        return directory / name


def fault_tolerance_defaults() -> dict[str, Any]:
    """Trainer defaults the ``flowkit`` CLI sets: atomic checkpoint files, RNG states, SIGTERM checkpoint."""
    # The plugin as a class_path (unlike the callbacks it is a parser default, and lands in config.yaml).
    plugin = {"class_path": f"{AtomicCheckpointIO.__module__}.{AtomicCheckpointIO.__qualname__}"}
    return {"plugins": [plugin], "callbacks": [RNGStateCheckpoint(), PreemptionCheckpoint()]}


def consolidated_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a Lightning checkpoint: a DeepSpeed ZeRO directory or a ``.ckpt`` file."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir():
        if not (checkpoint / "latest").is_file():
            raise FileNotFoundError(f"{checkpoint}: a directory but not a DeepSpeed checkpoint (no 'latest' file)")
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
        # Checkpoints of Lightning < 2.1 wrapped the module in `_forward_module`.
        return {key.removeprefix("_forward_module."): value for key, value in state.items()}
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} does not exist")
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def load_trained_weights(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Load ``checkpoint``'s weights into ``model``; every trainable parameter must be in the checkpoint."""
    state = consolidated_state_dict(checkpoint)
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in state]
    if missing:
        raise KeyError(f"{checkpoint}: no weights for {len(missing)} trainable parameter(s), e.g. {missing[:3]}")
    # Non-parameter entries (e.g. the flow's rollout buffer in `_extra_state`) are training state, not weights.
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise KeyError(f"{checkpoint}: weights the model does not have, e.g. {unexpected[:3]}")
