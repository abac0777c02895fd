"""Callbacks that write a run's artifacts."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from flowkit.strategies import full_parameters


class ExportArtifacts(L.Callback):
    """At the end of fit, write the module's deployable artifacts into ``<log_dir>/export``.

    The module must define ``export_artifacts(directory) -> dict[str, Path]`` (the policy in HF format
    and the flow in safetensors for :class:`~flowkit.modules.policy.PolicyModule`).
    """

    def __init__(self, subdir: str = "export"):
        self.subdir = subdir

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every rank must take part: `log_dir` is a broadcast, and ZeRO-3 gathers the sharded weights.
        directory = Path(trainer.log_dir or trainer.default_root_dir) / self.subdir
        with full_parameters(trainer, pl_module):
            if not trainer.is_global_zero:
                return
            paths = pl_module.export_artifacts(directory)
        for name, path in paths.items():
            rank_zero_info(f"exported {name}: {path}")
