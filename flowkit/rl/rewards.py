"""Flow token rewards from debiased deviation scores (RLFR eq. 10)."""

from __future__ import annotations

import torch
from torch import Tensor


def minmax_normalize(scores: Tensor, mask: Tensor) -> Tensor:
    """Per-row min-max of ``scores`` over ``mask`` → [0, 1]; a constant row gives zeros (never NaN)."""
    mask = mask.bool()
    big = torch.finfo(scores.dtype).max
    low = torch.where(mask, scores, big).amin(-1, keepdim=True)
    high = torch.where(mask, scores, -big).amax(-1, keepdim=True)
    span = high - low
    normalized = torch.where(span > 0, (scores - low) / torch.where(span > 0, span, 1.0), 0.0)
    return torch.where(mask, normalized, 0.0)


def keep_substantial(normalized: Tensor, eta: float, top_k: int | None = None) -> Tensor:
    """𝕀[r̂ > η]·r̂, then (optionally) only the ``top_k`` largest survivors per row.

    Following the official code, top-k applies only to rows with at least ``top_k`` survivors.
    """
    kept = torch.where(normalized > eta, normalized, 0.0)
    if top_k is None:
        return kept
    survivors = (kept > 0).sum(-1, keepdim=True)
    k = min(top_k, kept.shape[-1])
    threshold = kept.topk(k, dim=-1).values[..., -1:]
    limited = torch.where(kept >= threshold, kept, 0.0)
    return torch.where(survivors >= top_k, limited, kept)


def flow_token_rewards(scores: Tensor, mask: Tensor, eta: float = 0.6, beta: float = 0.01, top_k: int | None = None) -> Tensor:
    """r_k = −β · 𝕀[r̂_k > η] · r̂_k with r̂ = minmax(R_CFM) over the row's scored tokens (eq. 10).

    High deviation from the reference flow means off-distribution latents, hence a penalty.
    """
    return -beta * keep_substantial(minmax_normalize(scores, mask), eta, top_k)
