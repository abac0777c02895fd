"""Flow token rewards from debiased deviation scores (RLFR eq. 10) and the official code's variants.

Pipeline per row of scored tokens: normalise R_CFM → keep the substantial values (|r̂| or r̂ above η) →
optionally keep only the top-k → r_k = −β·r̂_k. Three normalisations (``normalization``):

- ``minmax`` (official scripts' ``flow_reward_norm minmax``): r̂ ∈ [0, 1], keep r̂ > η — only penalties.
- ``bilateral`` (the paper's eq. 10 text and Table 3; official ``flow_score_bil``): r̂ = 2·minmax − 1 ∈ [−1, 1],
  keep |r̂| > η, so tokens far *below* the row's typical deviation earn a positive reward.
- ``mean`` (official ``flow_reward_norm mean``, which also switches on ``flow_score_bil``): r̂ = minmax − its
  row mean over scored tokens, keep |r̂| > η.

Where flowkit deliberately differs from the official code: the row minimum is the true minimum over scored
tokens (the official ``get_row_min`` takes the second-smallest value of the zero-padded row, so on rows without
padding the smallest token falls below 0), and a constant row gives zeros where the official divides by zero
(NaN). The official ``mean`` branch reads min/max it never computed; flowkit reads it as min-max, then centre.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Normalization = Literal["minmax", "bilateral", "mean"]
NORMALIZATIONS = ("minmax", "bilateral", "mean")


def minmax_normalize(scores: Tensor, mask: Tensor) -> Tensor:
    """Per-row min-max of ``scores`` over ``mask`` → [0, 1]; a constant row gives zeros (never NaN)."""
    mask = mask.bool()
    big = torch.finfo(scores.dtype).max
    low = torch.where(mask, scores, big).amin(-1, keepdim=True)
    high = torch.where(mask, scores, -big).amax(-1, keepdim=True)
    span = high - low
    normalized = torch.where(span > 0, (scores - low) / torch.where(span > 0, span, 1.0), 0.0)
    return torch.where(mask, normalized, 0.0)


def normalize_scores(scores: Tensor, mask: Tensor, normalization: Normalization = "minmax") -> Tensor:
    """r̂ per scored token (zero elsewhere, and on constant rows) for the chosen ``normalization``."""
    mask = mask.bool()
    unit = minmax_normalize(scores, mask)
    if normalization == "minmax":
        return unit
    varies = unit.amax(-1, keepdim=True) > 0  # constant and single-token rows stay all-zero
    if normalization == "bilateral":
        centred = 2 * unit - 1
    elif normalization == "mean":
        count = mask.sum(-1, keepdim=True).clamp(min=1)
        centred = unit - unit.sum(-1, keepdim=True) / count
    else:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    return torch.where(mask & varies, centred, 0.0)


def _keep_largest(values: Tensor, k: int) -> Tensor:
    """Bool mask of the ``k`` largest entries per row; ties go to the earlier position (exactly k kept)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(values, dtype=torch.bool).scatter_(-1, order, True)


def keep_substantial(normalized: Tensor, eta: float, top_k: int | None = None, two_sided: bool = False) -> Tensor:
    """𝕀[r̂ > η]·r̂ (``two_sided``: 𝕀[|r̂| > η]·r̂), then (optionally) only ``top_k`` survivors per row.

    As in the official code, top-k applies only to rows with at least ``top_k`` survivors and keeps exactly k
    tokens (ties broken by position, earliest first); two-sided, it keeps the ⌊k/2⌋ largest positive and the
    ⌊k/2⌋ most negative survivors (official: top-k split in half per side). flowkit takes each side's half from
    that side's survivors only, where the official ``topk(−r̂)`` can also pick zeros or positive values.
    """
    substantial = normalized.abs() > eta if two_sided else normalized > eta
    kept = torch.where(substantial, normalized, 0.0)
    if top_k is None:
        return kept
    enough = substantial.sum(-1, keepdim=True) >= top_k
    if two_sided:
        low = torch.finfo(kept.dtype).min
        half = top_k // 2
        positive = _keep_largest(torch.where(kept > 0, kept, low), half) & (kept > 0)
        negative = _keep_largest(torch.where(kept < 0, -kept, low), half) & (kept < 0)
        chosen = positive | negative
    else:
        chosen = _keep_largest(torch.where(substantial, kept, torch.finfo(kept.dtype).min), top_k) & substantial
    return torch.where(enough, torch.where(chosen, kept, 0.0), kept)


def flow_token_rewards(
    scores: Tensor,
    mask: Tensor,
    eta: float = 0.6,
    beta: float = 0.01,
    top_k: int | None = None,
    normalization: Normalization = "minmax",
    power: float = 1.0,
) -> Tensor:
    """r_k = −β · 𝕀[r̂_k passes η] · r̂_k with r̂ the row-normalised R_CFM over scored tokens (eq. 10).

    High deviation from the reference flow means off-distribution latents, hence a penalty; with ``bilateral``
    or ``mean`` normalisation, tokens with r̂ < −η (far below the row's typical deviation) get a bonus.
    ``power`` γ ≠ 1 (official ``--flow_gamma``, ``models/utils.py`` L131-132) replaces r̂ by sign(r̂)·|r̂|^γ before
    the threshold: r̂^γ on ``minmax``'s [0, 1] as the official; sign-preserving on the two-sided normalisations,
    where the official ``pow`` of a negative r̂ is NaN for a fractional γ.
    """
    normalized = normalize_scores(scores, mask, normalization)
    if power != 1:
        normalized = normalized.sign() * normalized.abs().pow(power)
    return -beta * keep_substantial(normalized, eta, top_k, two_sided=normalization != "minmax")
