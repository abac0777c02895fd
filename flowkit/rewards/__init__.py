"""Reward models and graders (plain PyTorch / HF, no Lightning)."""

from flowkit.rewards.base import TokenRewardModel
from flowkit.rewards.explanation import ExplanationReward
from flowkit.rewards.flow_reward import FlowReward

__all__ = ["ExplanationReward", "FlowReward", "TokenRewardModel"]
