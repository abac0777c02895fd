"""Policy-gradient losses, registered by name with one signature ``fn(logprobs, old_logprobs, advantages, mask, ctx)``
(:data:`POLICY_LOSSES`: ``ppo`` the PPO/GRPO clipped surrogate, ``gspo`` its sequence-level importance ratio,
``cispo`` the clipped IS weight; ``ctx`` a :class:`LossContext`), the KL estimators and the clipped value loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean", "dr-grpo"]

# verl's bounds: one bf16 outlier token (a log-ratio of 90 overflows exp in float32) must not make the step
# non-finite. The log-ratio is clamped before exp (ratios up to e^20 still clip as usual), the k3 KL after it.
LOG_RATIO_BOUND = 20.0
KL_BOUND = 10.0


def aggregation_denominator(mask: Tensor, aggregation: Aggregation = "token-mean",
                            max_new_tokens: int | None = None) -> Tensor:
    """What :func:`masked_sum` is divided by over a whole (mini)batch, so that splitting the batch into
    micro-batches and adding their ``masked_sum / denominator`` gives exactly :func:`masked_aggregate`.

    token-mean: the number of valid tokens (DAPO); seq-mean: the number of sequences with a valid token (GRPO);
    dr-grpo: B·max_new_tokens, a constant (Dr. GRPO, Liu et al. 2025, removes the length normalisation).
    """
    mask = mask.float()
    if aggregation == "token-mean":
        return mask.sum().clamp(min=1)
    if aggregation == "seq-mean":
        return (mask.sum(-1) > 0).float().sum().clamp(min=1)
    if aggregation == "dr-grpo":
        if max_new_tokens is None or max_new_tokens < 1:
            raise ValueError(f"aggregation 'dr-grpo' needs max_new_tokens >= 1, got {max_new_tokens}")
        return mask.new_tensor(float(mask.shape[0] * max_new_tokens))
    raise ValueError(f"aggregation must be 'token-mean', 'seq-mean' or 'dr-grpo', got {aggregation!r}")


def masked_sum(values: Tensor, mask: Tensor, aggregation: Aggregation = "token-mean") -> Tensor:
    """The numerator of :func:`masked_aggregate`: a sum over rows, so micro-batches' sums add up."""
    mask = mask.float()
    if aggregation in ("token-mean", "dr-grpo"):
        return (values * mask).sum()
    if aggregation == "seq-mean":
        return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    raise ValueError(f"aggregation must be 'token-mean', 'seq-mean' or 'dr-grpo', got {aggregation!r}")


def masked_aggregate(values: Tensor, mask: Tensor, aggregation: Aggregation = "token-mean",
                     max_new_tokens: int | None = None) -> Tensor:
    """token-mean: mean over all valid tokens of the batch (DAPO); seq-mean: mean of per-sequence means (GRPO);
    dr-grpo: sum over valid tokens / (B·max_new_tokens) (Dr. GRPO)."""
    return masked_sum(values, mask, aggregation) / aggregation_denominator(mask, aggregation, max_new_tokens)


@dataclass(frozen=True)
class LossContext:
    """What a policy loss reads besides its four B×S tensors.

    Attributes:
        clip_low, clip_high: the ratio's clip range [1 − ε_low, 1 + ε_high] (DAPO's asymmetric ``clip_high``).
        clip_ratio_c: dual clip (Ye et al. 2020, verl's ``clip_ratio_c``, typically 3): for A < 0 the per-token
            loss is capped at −c·A, so a huge ratio on a negative-advantage token cannot blow up the step.
            Must be > 1; None is off.
        aggregation: how per-token losses become one number (:func:`masked_aggregate`).
        importance_weights: B×S detached per-token weights multiplied into the loss, e.g. the truncated
            importance-sampling correction min(exp(logπ_old − logπ_rollout), cap) for a rollout engine whose
            sampler differs from the trainer (verl / TRL); None is 1.
        denominator: the whole minibatch's :func:`aggregation_denominator` when this call sees one micro-batch of
            it; the micro-batches' losses then add up to the minibatch loss. None: this call's own rows.
        max_new_tokens: the generation budget, for ``dr-grpo``.
        args: the loss's own hyper-parameters by name: the defaults its :func:`register_policy_loss` declared,
            overridden by the ``policy_loss_args`` option.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    aggregation: Aggregation = "token-mean"
    importance_weights: Tensor | None = None
    denominator: Tensor | float | None = None
    max_new_tokens: int | None = None
    args: Mapping[str, float] = field(default_factory=dict)


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, LossContext], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: the function and the hyper-parameters it accepts in ``ctx.args``, with defaults."""

    fn: PolicyLossFn
    args: Mapping[str, float]


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, **args: float) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Registers ``fn(logprobs, old_logprobs, advantages, mask, ctx)`` under ``name`` (verl's
    ``register_policy_loss``); ``args`` names the loss's own hyper-parameters with their defaults, which it reads as
    ``ctx.args[name]``. A loss returns (loss, detached ``clip_fraction`` and ``approx_kl``)."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = PolicyLoss(fn, dict(args))
        return fn

    return register


def aggregated(per_token: Tensor, mask: Tensor, ctx: LossContext) -> Tensor:
    """``ctx.importance_weights`` × ``per_token``, aggregated over ``mask`` as ``ctx`` says: ``masked_sum /
    ctx.denominator``, the minibatch's aggregate or this micro-batch's share of it."""
    if ctx.importance_weights is not None:
        per_token = per_token * ctx.importance_weights
    return _share(per_token, mask, ctx.aggregation, ctx.denominator, ctx.max_new_tokens)


def _share(per_token: Tensor, mask: Tensor, aggregation: Aggregation, denominator: Tensor | float | None,
           max_new_tokens: int | None) -> Tensor:
    """``masked_sum / denominator``: the minibatch's aggregate, or this micro-batch's share of it."""
    if denominator is None:
        denominator = aggregation_denominator(mask, aggregation, max_new_tokens)
    return masked_sum(per_token, mask, aggregation) / denominator


def _dual_clipped(per_token: Tensor, advantages: Tensor, clip_ratio_c: float | None) -> Tensor:
    """Dual clip (Ye et al. 2020, verl's ``clip_ratio_c``): for A < 0 the per-token loss is capped at −c·A."""
    if clip_ratio_c is None:
        return per_token
    return torch.where(advantages < 0, torch.minimum(per_token, -clip_ratio_c * advantages), per_token)


def token_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """ρ = exp(logπ − logπ_old) per token, the log-ratio clamped to ±:data:`LOG_RATIO_BOUND` first (verl), so an
    outlier token cannot overflow exp."""
    return torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def policy_metrics(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, clipped: Tensor) -> dict[str, Tensor]:
    """The detached metrics every policy loss returns: ``clip_fraction``, the token mean of the bool ``clipped``,
    and ``approx_kl``, the token mean of logπ_old − logπ (over this call's tokens)."""
    with torch.no_grad():
        return {"clip_fraction": masked_aggregate(clipped.float(), mask, "token-mean"),
                "approx_kl": masked_aggregate(old_logprobs - logprobs, mask, "token-mean")}


@register_policy_loss("ppo")
def clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                        ctx: LossContext = LossContext()) -> tuple[Tensor, dict[str, Tensor]]:
    """−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) with ρ = :func:`token_ratio` (PPO, Schulman et al. 2017, eq. 7),
    dual-clipped, weighted and aggregated over ``mask`` as ``ctx`` says (:class:`LossContext`).

    Returns:
        The loss and, detached, ``clip_fraction`` and ``approx_kl`` (token means over this call's tokens).
    """
    return _clipped_surrogate(token_ratio(logprobs, old_logprobs), logprobs, old_logprobs, advantages, mask, ctx)


def _clipped_surrogate(ratio: Tensor, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                       ctx: LossContext) -> tuple[Tensor, dict[str, Tensor]]:
    """max(−ρA, −clip(ρ, 1−ε_low, 1+ε_high)A) per token for a given ratio ρ (token-level: PPO; sequence-level:
    GSPO), then the dual clip, the importance weights and the aggregation."""
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - ctx.clip_low, 1 + ctx.clip_high) * advantages
    per_token = _dual_clipped(torch.maximum(unclipped, clipped), advantages, ctx.clip_ratio_c)
    return aggregated(per_token, mask, ctx), policy_metrics(logprobs, old_logprobs, mask, clipped > unclipped)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """B×1: log s_i = (1/|y_i|) Σ_t (log π − log π_old) over row i's response tokens (GSPO's length-normalised
    sequence ratio, in log space), clamped to ±:data:`LOG_RATIO_BOUND`; 0 for a row without response tokens."""
    mask = mask.float()
    mean = ((logprobs - old_logprobs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return mean.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@register_policy_loss("gspo")
def gspo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                     ctx: LossContext = LossContext()) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its token form GSPO-token (the paper's
    eq. 13; verl ``loss_mode: gspo``): the clipped surrogate of :func:`clipped_policy_loss` with every token's ratio
    replaced by s_i,t = sg[s_i] · π(y_i,t) / sg[π(y_i,t)], s_i = exp(mean_t log(π/π_old)) the row's
    length-normalised sequence ratio (:func:`sequence_log_ratio`). Its value is s_i on every token of the row, so
    the whole row is clipped or not; its gradient is s_i · ∇log π(y_i,t) per token, so token-varying advantages
    (dense rewards) keep their per-token weight. With an advantage constant along each row and ``seq-mean``
    aggregation (the paper's; verl forces it, TRL's ``importance_sampling_level="sequence"`` follows ``loss_type``)
    it equals the sequence-level GSPO objective, value and gradient. The sequence ratio needs the whole row in one
    call, which micro-batches (they split rows, not tokens) always give."""
    log_sequence = sequence_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_sequence.detach() + logprobs - logprobs.detach())
    return _clipped_surrogate(ratio, logprobs, old_logprobs, advantages, mask, ctx)


@register_policy_loss("cispo")
def cispo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                      ctx: LossContext = LossContext()) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4–5; verl ``loss_mode: cispo``): −sg(r̂)·A·∇log π per token with
    r̂ = clip(ρ, 1−ε_low, 1+ε_high), the importance weight clipped and detached, so a token whose ratio left the
    range still gets its (bounded) gradient instead of none. Written as −sg(r̂)·A·exp(log π − sg(log π)): the
    gradient of verl's −sg(r̂)·A·log π, with the value −r̂·A, comparable to the clipped surrogate's. MiniMax-M1
    clips only above (a large ``clip_low``); ``clip_fraction`` counts tokens whose weight was clipped. No dual clip
    (``clip_ratio_c`` must be None: there is no max to cap)."""
    if ctx.clip_ratio_c is not None:
        raise ValueError("cispo has no dual clip: clip_ratio_c must be None")
    ratio = token_ratio(logprobs, old_logprobs)
    weight = ratio.clamp(1 - ctx.clip_low, 1 + ctx.clip_high).detach()
    per_token = -weight * advantages * torch.exp(logprobs - logprobs.detach())
    return aggregated(per_token, mask, ctx), policy_metrics(logprobs, old_logprobs, mask, weight != ratio)


KLEstimator = Literal["k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "low_var_kl+"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "low_var_kl+")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from the sampled tokens' log-probs (Schulman 2020; verl ``kl_penalty``,
    option ``kl_loss_type``):

    - ``k1``: log π − log π_ref (unbiased, high variance; what TRL's PPO subtracts from the reward);
    - ``k2``: ½ (log π − log π_ref)² (verl ``mse``);
    - ``k3`` / ``low_var_kl``: exp(r) − r − 1 with r = log π_ref − log π, non-negative; as verl, r is clamped to
      ±:data:`LOG_RATIO_BOUND` and the value to :data:`KL_BOUND` (verl computes its ``k3`` and ``low_var_kl`` alike);
    - ``abs``: |log π − log π_ref| (verl ``abs``);
    - ``k1+``, ``k3+``, ``low_var_kl+``: verl's straight-through forms: the value of k1 / k3, the gradient of k2
      (k1's and k3's expected gradients are not the KL's gradient; k2's is).
    """
    if estimator.endswith("+") and estimator[:-1] in ("k1", "k3", "low_var_kl"):
        value = kl_estimate(logprobs, ref_logprobs, estimator[:-1])
        gradient = kl_estimate(logprobs, ref_logprobs, "k2")
        return gradient - gradient.detach() + value.detach()
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if estimator == "abs":
        return (logprobs - ref_logprobs).abs()
    if estimator in ("k3", "low_var_kl"):
        delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return (torch.exp(delta) - delta - 1).clamp(max=KL_BOUND)
    raise ValueError(f"KL estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, aggregation: Aggregation = "token-mean",
               denominator: Tensor | float | None = None, max_new_tokens: int | None = None,
               estimator: KLEstimator = "k3") -> Tensor:
    """The KL term of the loss: :func:`kl_estimate` aggregated over ``mask`` (k3 by default, as verl's
    ``low_var_kl``). ``denominator`` / ``max_new_tokens`` as in :class:`LossContext`."""
    return _share(kl_estimate(logprobs, ref_logprobs, estimator), mask, aggregation, denominator, max_new_tokens)


def kl_shaped_rewards(token_rewards: Tensor | None, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                      kl_coef: float, estimator: KLEstimator = "k1") -> Tensor:
    """r_t − β·KL_t on response tokens: the KL in the reward, as TRL's PPO trainer (k1 there)."""
    rewards = torch.zeros_like(logprobs) if token_rewards is None else token_rewards
    return (rewards - kl_coef * kl_estimate(logprobs, ref_logprobs, estimator)) * mask


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float,
                       denominator: Tensor | float | None = None) -> Tensor:
    """½·Σ over the mask of max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²) / ``denominator`` (default: the
    mask's token count; TRL's ``cliprange_value``, CleanRL's clipped value loss)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = torch.maximum((values - returns).square(), (clipped - returns).square())
    mask = mask.float()
    if denominator is None:
        denominator = mask.sum().clamp(min=1)
    return 0.5 * (per_token * mask).sum() / denominator
