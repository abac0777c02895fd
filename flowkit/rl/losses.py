"""Policy-gradient losses: PPO/GRPO clipped surrogate and the k3 KL estimator."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean"]


def masked_aggregate(values: Tensor, mask: Tensor, aggregation: Aggregation = "token-mean") -> Tensor:
    """token-mean: mean over all valid tokens of the batch (DAPO); seq-mean: mean of per-sequence means (GRPO)."""
    mask = mask.float()
    if aggregation == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    if aggregation == "seq-mean":
        per_sequence = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_sequence[mask.sum(-1) > 0].mean()
    raise ValueError(f"aggregation must be 'token-mean' or 'seq-mean', got {aggregation!r}")


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: Aggregation = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) with ρ = exp(logπ − logπ_old), aggregated over ``mask``."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    loss = masked_aggregate(-torch.minimum(unclipped, clipped), mask, aggregation)
    with torch.no_grad():
        clip_fraction = masked_aggregate((clipped < unclipped).float(), mask, "token-mean")
        approx_kl = masked_aggregate(old_logprobs - logprobs, mask, "token-mean")
    return loss, {"clip_fraction": clip_fraction, "approx_kl": approx_kl}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, aggregation: Aggregation = "token-mean") -> Tensor:
    """k3 estimator of KL(π‖π_ref): exp(ref − logπ) − (ref − logπ) − 1 (Schulman 2020), non-negative."""
    delta = ref_logprobs - logprobs
    return masked_aggregate(torch.exp(delta) - delta - 1, mask, aggregation)
