"""LightningModules and DataModules (the only layer that imports Lightning, besides the CLI and strategies)."""

from flowkit.modules.callbacks import ExportArtifacts
from flowkit.modules.completions import CompletionLogs
from flowkit.modules.datamodule import RolloutDataModule
from flowkit.modules.explanation import ExplanationDataModule, ExplanationRewardModule, ExplanationRounds
from flowkit.modules.pretraining import FlowRewardModule
from flowkit.modules.policy import PolicyModule
from flowkit.modules.rule_data import RuleEnvDataModule
from flowkit.modules.selector import SelectorModule
from flowkit.modules.summary import ParameterSummary, RunSummary

__all__ = [
    "CompletionLogs",
    "ExplanationDataModule",
    "ExplanationRewardModule",
    "ExplanationRounds",
    "ExportArtifacts",
    "FlowRewardModule",
    "ParameterSummary",
    "PolicyModule",
    "RolloutDataModule",
    "RuleEnvDataModule",
    "RunSummary",
    "SelectorModule",
]
