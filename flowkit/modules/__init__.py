"""LightningModules and DataModules (the only layer that imports Lightning, besides the CLI and strategies)."""

from flowkit.modules.callbacks import ExportArtifacts
from flowkit.modules.datamodule import RolloutDataModule
from flowkit.modules.explanation import ExplanationDataModule, ExplanationPolicyModule, ExplanationRewardModule
from flowkit.modules.flow_reward import FlowRewardModule
from flowkit.modules.policy import PolicyModule
from flowkit.modules.selector import RuleEnvDataModule, SelectorModule
from flowkit.modules.summary import ParameterSummary, RunSummary

__all__ = [
    "ExplanationDataModule",
    "ExplanationPolicyModule",
    "ExplanationRewardModule",
    "ExportArtifacts",
    "FlowRewardModule",
    "ParameterSummary",
    "PolicyModule",
    "RolloutDataModule",
    "RuleEnvDataModule",
    "RunSummary",
    "SelectorModule",
]
