"""Test helper callback: every rank writes its (gathered) weights at train start and end, and with ``every_step``
also after each RL step (``step{N}/``, N counting the RL steps that ran from 0).

Used through the CLI in subprocess runs (``--trainer.callbacks+=rank_weights.RankWeights``, with
``tests/`` on PYTHONPATH) to check that parameters changed (in which step) and that ranks agree.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from safetensors.torch import save_file

from flowkit.strategies import full_parameters


def snapshot(trainer: L.Trainer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    with full_parameters(trainer, module):
        return {name: p.detach().float().cpu().clone() for name, p in module.named_parameters()}


class RankWeights(L.Callback):
    def __init__(self, out: str, every_step: bool = False):
        self.out, self.every_step = Path(out), every_step
        self.start: dict[str, torch.Tensor] = {}
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module):
        self.start = snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.every_step and outputs:  # a skipped step returns nothing
            self.steps.append(snapshot(trainer, pl_module))

    def on_train_end(self, trainer, pl_module):
        end = snapshot(trainer, pl_module)
        self.out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        stepwise = {f"step{n}/{k}": v for n, weights in enumerate(self.steps) for k, v in weights.items()}
        save_file({f"start/{k}": v for k, v in self.start.items()} | {f"end/{k}": v for k, v in end.items()} | stepwise,
                  str(self.out / f"rank{rank}.safetensors"),
                  metadata={"global_step": str(trainer.global_step), "world_size": str(trainer.world_size)})
