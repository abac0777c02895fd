"""Test helper callback: every rank writes its (gathered) weights at train start and end.

Used through the CLI in subprocess runs (``--trainer.callbacks+=rank_weights.RankWeights``, with
``tests/`` on PYTHONPATH) to check that parameters changed and that ranks agree.
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
    def __init__(self, out: str):
        self.out = Path(out)
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        self.start = snapshot(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        end = snapshot(trainer, pl_module)
        self.out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        save_file({f"start/{k}": v for k, v in self.start.items()} | {f"end/{k}": v for k, v in end.items()},
                  str(self.out / f"rank{rank}.safetensors"),
                  metadata={"global_step": str(trainer.global_step), "world_size": str(trainer.world_size)})
