"""Callbacks that write a run's artifacts."""

from __future__ import annotations

from pathlib import Path

import lightning as L

from flowkit.checkpointing.artifacts import replaced_directory
from flowkit.strategies import full_parameters


class ExportArtifacts(L.Callback):
    """At the end of fit, write the module's deployable artifacts into ``<log_dir>/export``.

    The module must define ``export_artifacts(directory) -> dict[str, Path]`` (the policy in HF format
    and the flow in safetensors for :class:`~flowkit.modules.policy.PolicyModule`). The directory is
    replaced whole (:func:`~flowkit.checkpointing.artifacts.replaced_directory`). A fit that trains nothing because it
    resumed a finished run (killed after its final checkpoint, before the export) exports too, at its end.
    """

    def __init__(self, subdir: str = "export"):
        self.subdir = subdir
        self._exported = False

    @property
    def exported(self) -> bool:
        """This fit wrote its artifacts (a checkpoint saved after that records it: a resume then has none to write)."""
        return self._exported

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._exported = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.export(trainer, pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning skips the training loop, and with it on_train_end, when the restored run already met its
        # stopping condition ("max_steps reached").
        if not self._exported:
            self.export(trainer, pl_module)

    def export(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every rank must take part: `log_dir` is a broadcast, and ZeRO-3 gathers the sharded weights.
        directory = Path(trainer.log_dir or trainer.default_root_dir) / self.subdir
        self._exported = True
        with full_parameters(trainer, pl_module):
            if not trainer.is_global_zero:
                return
            with replaced_directory(directory) as staging:
                paths = pl_module.export_artifacts(staging)
        for name, path in paths.items():
            print(f"exported {name}: {directory / path.relative_to(staging)}", flush=True)  # on stdout, as the summary
