"""Advantages: group-normalised outcome advantage plus the reward-to-go of dense token rewards (RLFR eq. 9)."""

from __future__ import annotations

import torch
from torch import Tensor


def group_normalized_advantage(outcome_rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """Â_o = (r_o − mean_group) / (std_group + ε), per row (GRPO; std with Bessel's correction)."""
    rewards = outcome_rewards.float()
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(len(groups), device=rewards.device).index_add_(0, inverse, rewards) / count
    centered = rewards - mean[inverse]
    var = torch.zeros(len(groups), device=rewards.device).index_add_(0, inverse, centered**2) / (count - 1).clamp(min=1)
    return centered / (var.sqrt()[inverse] + eps)


def reward_to_go(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Σ_{s≥k} γ^{s−k} r_s along the sequence dimension, restricted to ``mask``."""
    rewards = token_rewards.float() * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for k in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, k] + gamma * running
        returns[:, k] = running
    return returns * mask


def rlfr_advantages(
    outcome_rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """A_k = Σ_{s≥k} γ^{s−k} r_s + Â_o on response tokens (eq. 9); no further whitening."""
    mask = response_mask.float()
    advantages = group_normalized_advantage(outcome_rewards, group_ids, eps)[:, None] * mask
    if token_rewards is not None:
        advantages = advantages + reward_to_go(token_rewards, mask, gamma)
    return advantages
