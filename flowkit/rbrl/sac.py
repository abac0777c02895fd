"""Discrete soft actor-critic over a variable set of rules (seed 002 §5.4, App. Alg. 3; Christodoulou 2019).

All functions take per-rule tensors B×R with a bool ``mask`` (True = real rule) and are pure, so they
can be checked against hand-computed values. With π = softmax over real rules:

    V(s')   = Σ_a π(a|s') [Q̄(s', a) − α log π(a|s')]                      (soft state value, target nets)
    Q̄       = min(Q̄1, Q̄2)  or the official softmin blend  Σ_i w_i Q̄_i,  w = softmax(−β (Q̄1, Q̄2)), β = 10
    y       = r + γ (1 − done) V(s')
    L_Q     = mean (Q1(s, a) − y)² + mean (Q2(s, a) − y)²
    L_π     = mean_s Σ_a π(a|s) [α log π(a|s) − min(Q1, Q2)(s, a)]        (KL to the Boltzmann policy)
    L_α     = mean_s log α · (H(π(·|s)) − H̄(s))                             (auto-tuned temperature)
    H̄(s)    = ratio · log |A|  (official: |A| the environment's action count)  or  ratio · log |R_s|  (flowkit)

The official code (mauriciogtec/rule-bottleneck-reinforcement-learning, ``sac_attention.py``) blends the
twin target Qs with ``softmin(10 · Q)`` weights (a smooth minimum: β → ∞ is the hard min), uses ratio 0.89
of log |A| for the environment's action space A (``-0.89 * log(1 / envs.single_action_space.n)``, whatever the
number of rules), α₀ = 0.1 and copies the target networks every 64 steps (τ = 1); ``target_update(..., tau)``
covers both that hard copy and Polyak averaging.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def _expect(probs: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Σ_a π(a) values(a) over real rules; padded entries (π = 0, values may be ±inf) contribute 0.
    The padding is zeroed before the product: 0 · inf would give NaN gradients through ``where``."""
    zero = torch.zeros_like(values)
    return (torch.where(mask, probs, zero) * torch.where(mask, values, zero)).sum(-1)


def entropy(log_pi: Tensor, mask: Tensor) -> Tensor:
    return -_expect(log_pi.exp(), log_pi, mask)


SOFTMIN_BETA = 10.0  # the official inverse temperature of the twin-Q softmin blend
TWIN_Q_BLENDS = ("softmin", "min")


def blend_twin_q(q1: Tensor, q2: Tensor, blend: str) -> Tensor:
    """``"min"``: min(Q1, Q2); ``"softmin"``: w1 Q1 + w2 Q2 with (w1, w2) = softmax(−β (Q1, Q2)), β = 10."""
    if blend == "min":
        return torch.min(q1, q2)
    if blend == "softmin":
        stacked = torch.stack([q1, q2], dim=-1)
        return (torch.softmax(-SOFTMIN_BETA * stacked, dim=-1) * stacked).sum(-1)
    raise ValueError(f"twin-Q blend must be one of {TWIN_Q_BLENDS}, got {blend!r}")


def soft_q_target(
    reward: Tensor, done: Tensor, next_log_pi: Tensor, next_q1: Tensor, next_q2: Tensor, next_mask: Tensor,
    alpha: Tensor | float, gamma: float, blend: str = "min",
) -> Tensor:
    # padded rules may hold anything; zero them before blending so softmax weights stay finite
    zero = torch.zeros_like(next_q1)
    q = blend_twin_q(torch.where(next_mask, next_q1, zero), torch.where(next_mask, next_q2, zero), blend)
    value = _expect(next_log_pi.exp(), q - alpha * next_log_pi, next_mask)
    return reward + gamma * (1.0 - done.float()) * value


def critic_loss(q1: Tensor, q2: Tensor, action: Tensor, target: Tensor) -> Tensor:
    index = action.long().unsqueeze(-1)
    target = target.detach()
    q1_taken, q2_taken = q1.gather(-1, index).squeeze(-1), q2.gather(-1, index).squeeze(-1)
    return ((q1_taken - target) ** 2).mean() + ((q2_taken - target) ** 2).mean()


def actor_loss(log_pi: Tensor, q1: Tensor, q2: Tensor, mask: Tensor, alpha: Tensor | float) -> Tensor:
    q_min = torch.min(q1, q2).detach()
    return _expect(log_pi.exp(), alpha * log_pi - q_min, mask).mean()


def target_entropy(mask: Tensor, ratio: float, num_actions: int | None = None) -> Tensor:
    """H̄ per row: ``ratio · log num_actions`` (the official target, the same for every state) when
    ``num_actions`` is given, else ``ratio · log |R_s|`` over the row's real rules."""
    if num_actions is not None:
        return torch.full(mask.shape[:-1], ratio * math.log(num_actions))
    return ratio * torch.log(mask.sum(-1).float())


def temperature_loss(log_alpha: Tensor, log_pi: Tensor, mask: Tensor, ratio: float, num_actions: int | None = None) -> Tensor:
    gap = (entropy(log_pi, mask) - target_entropy(mask, ratio, num_actions)).detach()
    return (log_alpha * gap).mean()


@torch.no_grad()
def target_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """θ̄ ← (1 − τ) θ̄ + τ θ: Polyak averaging for τ < 1, a hard copy for τ = 1."""
    for t, s in zip(target.parameters(), source.parameters()):
        if tau == 1.0:
            t.copy_(s)  # exact, where lerp's a + 1·(b − a) may round
        else:
            t.lerp_(s, tau)
