"""Reward models and graders (plain PyTorch / HF, no Lightning).

:class:`ExplanationReward` (the explanation method's) imports on first use, so that an RLFR run does not load
:mod:`flowkit.explain`.
"""

from flowkit.rewards.base import (
    EvaluatesPolicy, ExportsWeights, LearnsOnline, PadsScoring, PretrainsOnLatents, ReportsMetrics, StepScorer,
    TokenRewardModel,
)
from flowkit.rewards.flow import FlowReward

__all__ = ["EvaluatesPolicy", "ExplanationReward", "ExportsWeights", "FlowReward", "LearnsOnline",
           "PadsScoring", "PretrainsOnLatents", "ReportsMetrics", "StepScorer", "TokenRewardModel"]


def __getattr__(name: str):
    if name == "ExplanationReward":
        from flowkit.rewards.explanation import ExplanationReward

        return ExplanationReward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
