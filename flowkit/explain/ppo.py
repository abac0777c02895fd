"""PPO pieces of the explanation LLM's training (seed 000 §3.2, App. F: PPO with LoRA, as TRL's PPO trainer):
per-token KL-shaped rewards, GAE, the clipped value loss and masked whitening, on B×S tensors aligned with
``input_ids`` and restricted to a response mask (each row's response tokens are contiguous).
"""

from __future__ import annotations

import torch
from torch import Tensor


def kl_shaped_rewards(token_rewards: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                      kl_coef: float) -> Tensor:
    """r_t − β·(log π_old(y_t) − log π_ref(y_t)) on response tokens (TRL: the KL penalty is in the reward)."""
    return (token_rewards - kl_coef * (logprobs - ref_logprobs)) * mask


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) along each row's response tokens.

    δ_t = r_t + γ V_{t+1} − V_t with V = 0 after the last response token; A_t = δ_t + γλ A_{t+1}; the
    value targets are A_t + V_t. Returns (advantages, returns), both 0 off the mask.
    """
    mask = mask.float()
    values = values * mask
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0], dtype=torch.float32)
    for t in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        # Off the mask (padding after the response) the recursion restarts from V = A = 0.
        next_value, next_advantage = values[:, t], advantages[:, t]
    return advantages, (advantages + values) * mask


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> Tensor:
    """½·mean over the mask of max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²) (TRL's cliprange_value)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = torch.maximum((values - returns).square(), (clipped - returns).square())
    mask = mask.float()
    return 0.5 * (per_token * mask).sum() / mask.sum().clamp(min=1)


def whitened(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x − mean)/std over the masked entries (0 elsewhere): the advantage normalisation of TRL's PPO and
    the whole advantage of the ``reinforce`` estimator (whitened reward-to-go, no value head)."""
    mask = mask.float()
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / count
    return (values - mean) / (var.sqrt() + eps) * mask
