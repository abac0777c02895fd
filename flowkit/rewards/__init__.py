"""Reward models and graders (plain PyTorch / HF, no Lightning)."""

from flowkit.rewards.base import TokenRewardModel
from flowkit.rewards.flow_reward import FlowReward

__all__ = ["FlowReward", "TokenRewardModel"]
