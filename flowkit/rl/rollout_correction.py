"""Rollout corrections: importance weights and masks for rows sampled by another policy than the one the loss
assumes, and the diagnostics of that mismatch. Pure tensor functions (no engine, no Lightning).

Three log-probabilities of each sampled token meet here (verl's "decoupled" view): the rollout engine's own
log π_rollout (its numerics, or an older policy version when generation runs ahead of training), the trainer's
log π_old of the same weights (the detached training forward), and log π_θ (the policy being updated). PPO's ratio
is π_θ / π_old; the correction reweights each token by a function of ρ = π_old / π_rollout:

* ``token_tis``: min(ρ_t, cap) per token (truncated IS; TRL ``token_truncate``, verl ``rollout_is: token``),
* ``seq_tis``: min(∏_t ρ_t, cap) on every token of the row (TRL ``sequence_truncate``, verl ``rollout_is: sequence``),
* ``token_mis``: ρ_t where floor ≤ ρ_t ≤ cap, else 0 (masked IS; TRL ``token_mask``),
* ``seq_mis``: ∏_t ρ_t where it lies in [floor, cap], else 0 for the whole row (TRL ``sequence_mask``),
* ``icepop``: ``token_mis`` with the IcePop band [0.5, 5] as its defaults (Ling Team, "Every Step Evolves",
  2025: tokens whose train / inference probability ratio leaves the band get no gradient).

``floor`` also lower-clamps the truncated modes (TRL's ``vllm_importance_sampling_clip_min``). A masked token keeps
its place in the loss's denominator (its weight is 0), as TRL's ratio of 0 does.

Independently of the weights, :func:`off_policy_sequence_mask` drops the negative-advantage tokens of rows that drifted
too far (DeepSeek-V3.2's off-policy sequence masking, TRL ``off_policy_mask_threshold``), and "bypass" takes
π_rollout itself as PPO's anchor π_old (verl ``bypass_mode``: two log-probs; the clipped ratio is the correction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flowkit.errors import ConfigError
from flowkit.options import OptionGroup, bounded

CorrectionMode = Literal["token_tis", "seq_tis", "token_mis", "seq_mis", "icepop"]
LOG_RATIO_BOUND = 20.0  # verl's safety bound on log ρ (ρ ∈ [2e-9, 5e8]) before exp
ICEPOP_BAND = (0.5, 5.0)


def rollout_log_ratio(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log ρ = log π_train − log π_rollout per token (B×S), 0 off ``mask``, clamped to ±:data:`LOG_RATIO_BOUND`."""
    return ((train_logprobs - rollout_logprobs) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """log ∏_t ρ_t per row, broadcast to the row's tokens (B×S)."""
    total = (log_ratio * mask).sum(-1, keepdim=True).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return total.expand_as(log_ratio)


def _truncated(log_ratio: Tensor, cap: float, floor: float | None) -> Tensor:
    return torch.exp(log_ratio).clamp(min=floor, max=cap)


def _masked(log_ratio: Tensor, cap: float, floor: float | None) -> Tensor:
    ratio = torch.exp(log_ratio)
    inside = (ratio <= cap) & (ratio >= (floor if floor is not None else 0.0))
    return ratio * inside


CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float, float | None], Tensor]] = {
    "token_tis": lambda log_ratio, mask, cap, floor: _truncated(log_ratio, cap, floor),
    "seq_tis": lambda log_ratio, mask, cap, floor: _truncated(_sequence_log_ratio(log_ratio, mask), cap, floor),
    "token_mis": lambda log_ratio, mask, cap, floor: _masked(log_ratio, cap, floor),
    "seq_mis": lambda log_ratio, mask, cap, floor: _masked(_sequence_log_ratio(log_ratio, mask), cap, floor),
    "icepop": lambda log_ratio, mask, cap, floor: _masked(log_ratio, cap, floor),
}


def correction_weights(log_ratio: Tensor, mask: Tensor, mode: CorrectionMode, cap: float,
                       floor: float | None = None) -> Tensor:
    """B×S detached weights of ``mode`` (see the module docstring) for the token log-ratios ``log_ratio``, 0 off
    ``mask``."""
    return CORRECTIONS[mode](log_ratio.detach(), mask, cap, floor) * mask


SEQUENCE_MODES = ("seq_tis", "seq_mis")
"""The modes whose ratio is the row's ∏_t ρ_t, put on every token of the row."""
TRUNCATING_MODES = ("token_tis", "seq_tis")
"""The modes that clamp a ratio outside [floor, cap] to the bound; the others give it weight 0."""


@torch.no_grad()
def correction_fractions(log_ratio: Tensor, mask: Tensor, mode: CorrectionMode, cap: float,
                         floor: float | None = None) -> dict[str, Tensor]:
    """What ``mode``'s weights did to ``mask``'s tokens: the fraction whose ratio (the row's ∏_t ρ_t in the sequence
    modes) lay outside [floor, cap] and was masked (weight 0: ``token_mis``, ``seq_mis``, ``icepop``) or truncated
    (clamped to the bound: ``token_tis``, ``seq_tis``), as ``masked_frac`` and ``truncated_frac`` (one of the two is
    0); in the sequence modes also the fraction of rows (with response tokens) masked or truncated,
    ``seq_masked_frac`` or ``seq_truncated_frac``."""
    on = mask.bool()
    sequence = mode in SEQUENCE_MODES
    ratio = torch.exp(_sequence_log_ratio(log_ratio, mask) if sequence else log_ratio)
    outside = ((ratio > cap) | (ratio < (floor if floor is not None else 0.0))) & on
    kind, other = ("truncated", "masked") if mode in TRUNCATING_MODES else ("masked", "truncated")
    fractions = {f"{kind}_frac": outside.sum() / on.sum().clamp(min=1), f"{other}_frac": torch.zeros(())}
    if sequence:
        fractions[f"seq_{kind}_frac"] = outside.any(-1).sum() / on.any(-1).sum().clamp(min=1)
    return fractions


def off_policy_sequence_mask(logprobs: Tensor, rollout_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                             threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL ``get_off_policy_mask``): a row whose mean per-token
    log π_rollout − log π_θ (a KL estimate of the drift, π_θ detached) exceeds ``threshold`` loses its tokens of
    negative advantage; everything else keeps weight 1. B×S, 0 off ``mask``. (TRL's advantages are one per row; here
    each token's own advantage decides, which is the same for GRPO's outcome advantage.)"""
    drift = ((rollout_logprobs - logprobs.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return ((advantages >= 0) | (drift <= threshold)).to(mask.dtype) * mask


@torch.no_grad()
def mismatch_metrics(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The rollout / trainer gap over ``mask``'s tokens: mean and max |Δ log p|, and the k3 estimate of
    KL(π_rollout ‖ π_train) from the rollout's own samples, mean over tokens of ρ − 1 − log ρ (Schulman's k3; verl's
    ``rollout_corr/k3_kl``)."""
    on = mask.bool()
    delta = (train_logprobs - rollout_logprobs)[on].float().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if delta.numel() == 0:
        zero = torch.zeros((), device=mask.device)
        return {"abs_diff_mean": zero, "abs_diff_max": zero, "k3_kl": zero}
    return {"abs_diff_mean": delta.abs().mean(), "abs_diff_max": delta.abs().max(),
            "k3_kl": (torch.expm1(delta) - delta).mean()}  # expm1: exact near δ = 0, where the gap usually is


@dataclass(frozen=True)
class RolloutCorrection(OptionGroup):
    """How the loss treats rows whose rollout engine sampled from another distribution than the trainer's (the
    group ``loss.rollout_correction``; it applies when the engine returns its sampler's log-probs)."""

    mode: CorrectionMode | None = None
    """the importance weights (the modes of :mod:`flowkit.rl.rollout_correction`); null: no weights (the mismatch is
    still logged)"""
    cap: float | None = bounded(None, 0, open_low=True)
    """the upper bound C of ρ (TRL's ``vllm_importance_sampling_clip_max``, verl's ``rollout_is_threshold``); null: 2,
    or 5 for ``icepop``"""
    floor: float | None = bounded(None, 0)
    """the lower bound of ρ (masked modes: below it the weight is 0; truncated modes: clamped up to it); null: no
    lower bound, or 0.5 for ``icepop``"""
    off_policy_mask: float | None = bounded(None, 0)
    """δ of the off-policy sequence mask (DeepSeek-V3.2; TRL ``off_policy_mask_threshold``): a row whose mean
    log π_rollout − log π_θ exceeds it loses its tokens of negative advantage; null: off"""
    bypass: bool = False
    """use π_rollout as PPO's π_old (verl ``bypass_mode``): the clipped ratio π_θ / π_rollout corrects by itself, so
    ``mode`` must be null"""

    @property
    def upper(self) -> float:
        return self.cap if self.cap is not None else (ICEPOP_BAND[1] if self.mode == "icepop" else 2.0)

    @property
    def lower(self) -> float | None:
        return self.floor if self.floor is not None else (ICEPOP_BAND[0] if self.mode == "icepop" else None)

    def check_rules(self, owner: str) -> None:
        if self.lower is not None and not self.lower < self.upper:
            raise ConfigError(f"{owner}.floor ({self.lower}) must be below cap ({self.upper})")
        if self.bypass and self.mode is not None:
            raise ConfigError(f"{owner}.bypass takes the rollout's log-probs as PPO's anchor, whose clipped ratio is the "
                              f"correction: set mode null (got {self.mode!r})")

# Saved in the hyper-parameters of a checkpoint, which Lightning and flowkit load with weights_only.
torch.serialization.add_safe_globals([RolloutCorrection])
