"""LightningModules and DataModules (the only layer that imports Lightning, besides the CLI and strategies).

The rule-bottleneck (RBRL) and explanation methods' modules import on first use (``flowkit.modules.SelectorModule``
in a config imports :mod:`flowkit.modules.selector`), so that an RLFR run loads neither method nor gymnasium.
"""

import importlib

from flowkit.modules.callbacks import ExportArtifacts
from flowkit.modules.completions import CompletionLogs
from flowkit.modules.datamodule import RolloutDataModule
from flowkit.modules.pretraining import FlowRewardModule
from flowkit.modules.policy import PolicyModule
from flowkit.modules.summary import ParameterSummary, RunSummary

METHOD_MODULES = {
    "ExplanationDataModule": "flowkit.modules.explanation",
    "ExplanationRewardModule": "flowkit.modules.explanation",
    "ExplanationRounds": "flowkit.modules.explanation",
    "RuleEnvDataModule": "flowkit.modules.rule_data",
    "SelectorModule": "flowkit.modules.selector",
}

__all__ = [
    "CompletionLogs",
    "ExportArtifacts",
    "FlowRewardModule",
    "ParameterSummary",
    "PolicyModule",
    "RolloutDataModule",
    "RunSummary",
    *METHOD_MODULES,
]


def __getattr__(name: str):
    if name in METHOD_MODULES:
        return getattr(importlib.import_module(METHOD_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
