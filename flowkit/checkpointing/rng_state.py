"""RNG state in checkpoints: the torch (CPU and CUDA), numpy and Python RNG states, restored right before the first
training batch after a resume — not at load time, because building the dataloader iterator draws from the torch RNG
in between.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import numpy as np
import torch

log = logging.getLogger(__name__)

RNG_KEY = "rng_states"


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
