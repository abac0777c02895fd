"""LightningModules and DataModules (the only layer that imports Lightning, besides the CLI)."""

from flowkit.modules.callbacks import ExportArtifacts
from flowkit.modules.datamodule import RolloutDataModule
from flowkit.modules.flow_reward import FlowRewardModule
from flowkit.modules.policy import PolicyModule

__all__ = ["ExportArtifacts", "FlowRewardModule", "PolicyModule", "RolloutDataModule"]
