"""Test helper callbacks for tests/test_resume_semantics.py, added to a ``flowkit fit`` run in a subprocess
(``--trainer.callbacks+=resume_probes.NAME``, with ``tests/`` on PYTHONPATH): they record where work ran, or send the
signals a cluster sends at chosen moments."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import lightning as L


class PretrainingPlacement(L.Callback):
    """Writes to ``out`` (JSON) how the strategy held the module when the offline flow pretraining ran: the type of
    ``trainer.strategy.model`` (DDP's wrapper once ``strategy.setup`` placed it), the device of the policy and the
    reward model, and the strategy's root device."""

    def __init__(self, out: str):
        self.out = Path(out)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pretrain = pl_module.pretrain_reward_model

        def recorded(*args, **kwargs):
            pretrain(*args, **kwargs)
            self.out.write_text(json.dumps({
                "strategy_model": type(trainer.strategy.model).__name__,
                "policy_device": str(next(pl_module.policy.parameters()).device),
                "reward_device": str(next(pl_module.reward_model.parameters()).device),
                "root_device": str(trainer.strategy.root_device),
            }))

        pl_module.pretrain_reward_model = recorded


class SigtermInValidation(L.Callback):
    """SIGTERM to this process after the first batch of the validation at step ``step`` (as a pre-emption would)."""

    def __init__(self, step: int):
        self.step = step

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.global_step == self.step and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


class SlurmTimeLimit(L.Callback):
    """At the end of RL step ``step``: SIGUSR1 (SLURM's warning before the time limit: Lightning saves
    ``hpc_ckpt_N.ckpt`` and requeues the job), then SIGKILL (the limit itself)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)
            while not list(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt")):  # the handler runs meanwhile
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
