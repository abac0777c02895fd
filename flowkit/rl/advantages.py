"""Advantages: group-normalised outcome advantage plus the reward-to-go of dense token rewards (RLFR eq. 9)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ScaleRewards = Literal["group", "batch", "none"]


def group_normalized_advantage(outcome_rewards: Tensor, group_ids: Tensor, eps: float = 1e-6,
                               scale_rewards: ScaleRewards = "group") -> Tensor:
    """Â_o = (r_o − mean_group) / (std + ε), per row (GRPO; std with Bessel's correction).

    ``scale_rewards`` picks the std as TRL's option of that name does: ``group`` the std within the prompt's
    group (GRPO, the paper), ``batch`` the std of all rewards of the batch, ``none`` no scaling (Dr. GRPO).
    """
    rewards = outcome_rewards.float()
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(len(groups), device=rewards.device).index_add_(0, inverse, rewards) / count
    centered = rewards - mean[inverse]
    if scale_rewards == "none":
        return centered
    if scale_rewards == "batch":
        return centered / (rewards.std() + eps) if len(rewards) > 1 else centered / (1 + eps)
    if scale_rewards != "group":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
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
    scale_rewards: ScaleRewards = "group",
) -> Tensor:
    """A_k = Σ_{s≥k} γ^{s−k} r_s + Â_o on response tokens (eq. 9); no further whitening."""
    outcome = group_normalized_advantage(outcome_rewards, group_ids, eps, scale_rewards)
    return token_advantages(outcome, response_mask, token_rewards, gamma)


def token_advantages(outcome_advantages: Tensor, response_mask: Tensor, token_rewards: Tensor | None = None,
                     gamma: float = 1.0) -> Tensor:
    """The per-row part of eq. 9: Â_o (B, already normalised over the batch) on every response token plus
    the reward-to-go of the token rewards. Rows are independent, so micro-batches can call it on their rows."""
    mask = response_mask.float()
    advantages = outcome_advantages.float()[:, None] * mask
    if token_rewards is not None:
        advantages = advantages + reward_to_go(token_rewards, mask, gamma)
    return advantages


def outcome_at_last_token_advantages(outcome_advantages: Tensor, response_mask: Tensor,
                                     token_rewards: Tensor | None = None, gamma: float = 1.0) -> Tensor:
    """The official code's form of eq. 9: Â_o is a reward on the row's last response token (EOS when one was
    generated) and is discounted with the token rewards, A_k = Σ_{s≥k} γ^{s−k} (r_s + 𝕀[s = last]·Â_o).

    With γ = 1 this equals :func:`token_advantages` (Â_o on every token); with γ < 1 early tokens see a
    discounted outcome, γ^{K−k}·Â_o. Rows are independent, as in :func:`token_advantages`.
    """
    mask = response_mask.float()
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).amax(-1)  # −1: a row without response tokens
    rewards = torch.zeros_like(mask) if token_rewards is None else token_rewards.float() * mask
    rows = (last >= 0).nonzero().flatten()
    rewards[rows, last[rows]] += outcome_advantages.float()[rows]
    return reward_to_go(rewards, mask, gamma)


def entropy_shaped_advantages(advantages: Tensor, entropy: Tensor, response_mask: Tensor, alpha: float = 0.4,
                              kappa: float = 2.0) -> Tensor:
    """"Entropy Adv." (Cheng et al. 2025, *Reasoning with Exploration: An Entropy Perspective*, §3; the logit-space
    baseline of RLFR Table 2): A_t + min(α·H_t, |A_t|/κ) on response tokens, with H_t the policy's token entropy
    over the vocabulary, detached (the term shapes the advantage; no gradient flows through it).

    The term is ≥ 0 and at most |A_t|/κ, so for κ > 1 it never flips the sign of A_t: it enlarges a positive
    advantage and shrinks a negative one where the policy is uncertain. It vanishes where A_t = 0 — in a GRPO group
    whose samples are all wrong it adds nothing. α = 0.4 and κ = 2 are the values of Cheng et al.'s runs.
    """
    if alpha < 0 or kappa <= 1:
        raise ValueError(f"entropy advantage needs alpha ≥ 0 and kappa > 1 (so the sign of A_t holds), got "
                         f"alpha={alpha}, kappa={kappa}")
    advantages = advantages.float()
    bonus = torch.minimum(alpha * entropy.detach().float(), advantages.abs() / kappa)
    return (advantages + bonus) * response_mask.float()
