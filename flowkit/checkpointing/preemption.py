"""A checkpoint on SIGTERM.

:class:`PreemptionCheckpoint` builds on Lightning's SIGTERM handling: Lightning notes the signal, lets the running
batch finish and stops with ``SIGTERMException`` (a ``SystemExit``); this callback writes ``last.ckpt`` (where
``--ckpt_path last`` finds it) before the process exits with status 0. Work that runs before training (offline flow
pretraining) handles SIGTERM itself with :func:`sigterm_stops`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from flowkit.distributed import all_reduce_int

log = logging.getLogger(__name__)

VALIDATION_INTERRUPTED_KEY = "validation_interrupted"  # in PreemptionCheckpoint's state

PRETRAINING_STATE_NAME = "flow_pretrain.ckpt"  # no "last" in it: `--ckpt_path last` must not pick it


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, write ``<checkpoint dir>/last.ckpt`` after the running batch; the process then exits 0.

    SIGTERM during a validation stops it after its running batch: the checkpoint then records that the validation
    did not finish, and the resumed fit runs it again, first thing (a run stopped in its final validation would
    otherwise resume with nothing left to train and end without its held-out numbers).
    """

    def __init__(self):
        self._validation_interrupted = False
        self._validation_pending = False
        self._step = 0  # of the checkpoint; the trainer's global_step is restored only later

    def state_dict(self) -> dict[str, Any]:
        return {VALIDATION_INTERRUPTED_KEY: self._validation_interrupted, "step": self._step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._validation_pending = bool(state_dict.get(VALIDATION_INTERRUPTED_KEY, False))
        self._step = int(state_dict.get("step", 0))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Strategies other than DeepSpeed restored the weights and this state already; a fit whose checkpoint met
        # max_steps skips the training loop, and with it on_train_start.
        self._validate_if_pending(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validate_if_pending(trainer)  # DeepSpeed restores after on_fit_start

    def _validate_if_pending(self, trainer: L.Trainer) -> None:
        if not self._validation_pending:
            return
        self._validation_pending = False
        log.warning("the checkpoint was saved in a validation that SIGTERM stopped: validating step %d again",
                    self._step)
        trainer.validating = True  # what the training loop does around its own validations
        trainer.fit_loop.epoch_loop.val_loop.run()
        trainer.training = True

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        if isinstance(exception, PretrainingPreempted):
            return  # stopped before training began; the pretraining saved its own state
        self._validation_interrupted, self._step = trainer.validating, trainer.global_step
        path = self.last_checkpoint_path(trainer)
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            # ModelCheckpoint's state inside this checkpoint then names it as the last one: after resuming,
            # ModelCheckpoint overwrites last.ckpt instead of writing last-v1.ckpt next to a stale last.ckpt.
            callback.last_model_path = str(path)
        log.warning("SIGTERM: saving %s at step %d before exiting", path, trainer.global_step)
        trainer.save_checkpoint(path)

    @staticmethod
    def pretraining_state_path(trainer: L.Trainer) -> Path:
        """Where work before training (offline flow pretraining) keeps its resumable state: beside ``last.ckpt``."""
        return PreemptionCheckpoint.last_checkpoint_path(trainer).with_name(PRETRAINING_STATE_NAME)

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


class PretrainingPreempted(SIGTERMException):
    """SIGTERM arrived before training began (e.g. in offline flow pretraining), whose state is saved already.

    A ``SystemExit`` like Lightning's own ``SIGTERMException``: the process exits with status 0.
    """


@contextlib.contextmanager
def sigterm_stops() -> Iterator[Callable[[], bool]]:
    """Within the block SIGTERM only raises a flag; yields ``stop()``: has any rank received it?

    For work that runs before Lightning installs its own SIGTERM handling (which happens only when training
    starts): check ``stop()`` once per step, save what resumes the work, and raise :class:`PretrainingPreempted`.
    ``stop()`` is a collective under a process group, so every rank must call it at every step; the ranks
    then stop at the same step even when the signal reached only one of them.
    """
    received = False

    def note(signum, frame) -> None:
        nonlocal received
        received = True
        log.warning("SIGTERM received: stopping after this step")

    def stop() -> bool:
        return bool(all_reduce_int(int(received), torch.distributed.ReduceOp.MAX))

    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield stop
        return
    previous = signal.signal(signal.SIGTERM, note)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)
