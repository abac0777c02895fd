"""Reward models and graders (plain PyTorch / HF, no Lightning)."""

from flowkit.rewards.base import (
    EvaluatesPolicy, ExportsWeights, LearnsOnline, PadsScoring, PretrainsOnLatents, ReportsMetrics, StepScorer,
    TokenRewardModel,
)
from flowkit.rewards.explanation import ExplanationReward
from flowkit.rewards.flow import FlowReward

__all__ = ["EvaluatesPolicy", "ExplanationReward", "ExportsWeights", "FlowReward", "LearnsOnline",
           "PadsScoring", "PretrainsOnLatents", "ReportsMetrics", "StepScorer", "TokenRewardModel"]
