"""Advantage estimators, as pure tensor functions registered by name (verl's ``core_algos`` style).

- ``grpo``: the group-normalised outcome advantage Â_o plus the reward-to-go of the dense token rewards (RLFR eq. 9).
- ``rloo``: GRPO's form with the leave-one-out baseline instead (Kool et al. 2019; Ahmadian et al. 2024).
- ``gae``: generalised advantage estimation over the token rewards with a value head, whitened (PPO as TRL's PPO
  trainer runs it for the explanation method, seed 000 App. F; also the numeric PPO baseline of RBRL).
- ``reinforce``: the whitened reward-to-go, no value head.

An estimator (:class:`Estimator`, registered with :func:`register_advantage`) runs in up to three stages, because
the step scores its rows micro-batch by micro-batch: ``outcome(rewards, group_ids, ctx)`` once over every row of the
step (the group statistics: GRPO's normalisation, RLOO's baseline); ``tokens(inputs, ctx)`` per micro-batch, on its
rows alone (:class:`AdvantageInputs`: the rows' outcome advantages, mask, token rewards, values); and, when it
declares ``whiten``, a whitening over the whole batch after every row was estimated (which needs every row before
the first update).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


def masked_first(mask: Tensor) -> Tensor:
    """B×S column order putting each row's ``mask`` positions first, in their order: a sequence estimator gathered
    through it runs over the masked tokens as one contiguous sequence (an agent episode's policy tokens, the
    environment's between them left out), and its result is scattered back through it."""
    return torch.sort((mask <= 0).to(torch.int8), dim=-1, stable=True).indices


def reward_to_go(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Σ γ^{j} r over the masked tokens from k on (the j-th after k), 0 off ``mask``: tokens off the mask (an
    episode's environment tokens) neither add a reward nor a discount step."""
    order = masked_first(mask)
    rewards = (token_rewards.float() * mask).gather(-1, order)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for k in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, k] + gamma * running
        returns[:, k] = running
    return _unpacked(returns, order) * mask


def token_advantages(outcome_advantages: Tensor, response_mask: Tensor, token_rewards: Tensor | None = None,
                     gamma: float = 1.0) -> Tensor:
    """The per-row part of eq. 9: Â_o (B, already normalised over the batch) on every response token plus
    the reward-to-go of the token rewards. Rows are independent, so micro-batches can call it on their rows."""
    mask = response_mask.float()
    advantages = outcome_advantages.float()[:, None] * mask
    if token_rewards is not None:
        advantages = advantages + reward_to_go(token_rewards, mask, gamma)
    return advantages


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


def gae(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over a time-major T×N rollout (Schulman et al. 2016, eq. 16):
    δ_t = r_t + γ (1 − d_t) V(s_{t+1}) − V(s_t),  A_t = δ_t + γ λ (1 − d_t) A_{t+1}; ``dones[t]`` says the episode
    ended at step t (so s_{t+1} is the next episode's first state); ``last_value`` (N) is V of the state after the
    last step. Returns (advantages, returns = A + V)."""
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    next_advantage = torch.zeros_like(last_value, dtype=torch.float32)
    next_value = last_value.float()
    for t in reversed(range(rewards.shape[0])):
        keep = 1.0 - dones[t].float()
        delta = rewards[t] + gamma * keep * next_value - values[t]
        next_advantage = delta + gamma * lam * keep * next_advantage
        advantages[t] = next_advantage
        next_value = values[t]
    return advantages, advantages + values


def sequence_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """:func:`gae` along each row's masked tokens (B×S) as one sequence (:func:`masked_first`: an episode's
    environment tokens are no steps of it): it ends at the last masked token, V = 0 after it. Returns (advantages,
    returns), both 0 off the mask."""
    order = masked_first(mask)
    mask = mask.float().gather(-1, order)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).amax(-1, keepdim=True)
    done = (positions >= last).float()  # the last masked token and the padding after it end the episode
    advantages, returns = gae((rewards.float().gather(-1, order) * mask).T, (values.float().gather(-1, order) * mask).T,
                              done.T, torch.zeros(mask.shape[0], device=mask.device), gamma, lam)
    return _unpacked(advantages.T * mask, order), _unpacked(returns.T * mask, order)


def _unpacked(packed: Tensor, order: Tensor) -> Tensor:
    """``packed`` (gathered through :func:`masked_first`'s ``order``) back at its columns."""
    return torch.zeros_like(packed).scatter(-1, order, packed)


def whitened(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x − mean)/std over the masked entries (0 elsewhere): TRL's PPO advantage normalisation."""
    mask = mask.float()
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / count
    return (values - mean) / (var.sqrt() + eps) * mask


OutcomePlacement = Literal["every_token", "last_token"]


@dataclass
class AdvantageInputs:
    """What an estimator's ``tokens`` stage reads, for B rows (any subset of a step's rows).

    ``outcome``: per row, the estimator's ``outcome`` stage over the step (GRPO's group-normalised Â_o, RLOO's
    leave-one-out advantage, or the raw outcome reward r_o for ``gae`` and ``reinforce``). ``token_rewards``: B×S
    dense rewards on response tokens (a reward model's, KL-shaped when the KL is in the reward) or None. ``values``:
    B×S value-head estimates V(state before token s) at response tokens, for an estimator with a value head.
    """

    outcome: Tensor
    response_mask: Tensor
    token_rewards: Tensor | None = None
    values: Tensor | None = None


@dataclass(frozen=True)
class AdvantageContext:
    """The estimators' settings: discount ``gamma``, GAE's ``lam``, GRPO's ``scale_rewards`` and where an outcome
    advantage enters the tokens (``outcome_placement``)."""

    gamma: float = 1.0
    lam: float = 0.95
    scale_rewards: ScaleRewards = "group"
    outcome_placement: OutcomePlacement = "every_token"


OutcomeStage = Callable[[Tensor, Tensor, AdvantageContext], Tensor]
TokenStage = Callable[[AdvantageInputs, AdvantageContext], tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator (see the module docstring for its stages).

    ``outcome(rewards, group_ids, ctx)``: N outcome rewards and N group ids (the prompt index of each row) of every
    row of the step → the N rows' outcome terms. ``tokens(inputs, ctx)`` → (B×S advantages, B×S value targets or
    None). ``value_head``: it reads ``inputs.values`` and returns value targets (the policy gets a value head).
    ``whiten``: its advantages are whitened over the whole batch after every row is estimated.
    """

    outcome: OutcomeStage
    tokens: TokenStage
    value_head: bool
    whiten: bool


ESTIMATORS: dict[str, Estimator] = {}


def _outcome_at_last_token(inputs: AdvantageInputs) -> Tensor:
    mask = inputs.response_mask.float()
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).amax(-1)
    rewards = torch.zeros_like(mask) if inputs.token_rewards is None else inputs.token_rewards.float() * mask
    rows = (last >= 0).nonzero().flatten()
    rewards[rows, last[rows]] += inputs.outcome.float()[rows]
    return rewards


def outcome_and_reward_to_go(inputs: AdvantageInputs, ctx: AdvantageContext) -> tuple[Tensor, None]:
    """RLFR eq. 9: A_k = Σ_{s≥k} γ^{s−k} r_s + Â_o (``every_token``, the paper) or the official code's form with Â_o
    a reward on the last token, discounted with the token rewards (``last_token``; equal at γ = 1). No value head."""
    if ctx.outcome_placement == "last_token":
        return reward_to_go(_outcome_at_last_token(inputs), inputs.response_mask, ctx.gamma), None
    return token_advantages(inputs.outcome, inputs.response_mask, inputs.token_rewards, ctx.gamma), None


def gae_tokens(inputs: AdvantageInputs, ctx: AdvantageContext) -> tuple[Tensor, Tensor]:
    """GAE(γ, λ) over the token rewards with r_o on the last token, against the value head (TRL's PPO)."""
    if inputs.values is None:
        raise ValueError("the gae estimator needs value-head estimates")
    return sequence_gae(_outcome_at_last_token(inputs), inputs.values, inputs.response_mask, ctx.gamma, ctx.lam)


def reinforce_tokens(inputs: AdvantageInputs, ctx: AdvantageContext) -> tuple[Tensor, None]:
    """The reward-to-go of the token rewards with r_o on the last token (whitened over the batch afterwards)."""
    return reward_to_go(_outcome_at_last_token(inputs), inputs.response_mask, ctx.gamma), None


def register_advantage(name: str, tokens: TokenStage = outcome_and_reward_to_go, value_head: bool = False,
                       whiten: bool = False) -> Callable[[OutcomeStage], OutcomeStage]:
    """Registers the decorated ``outcome(rewards, group_ids, ctx)`` stage as estimator ``name`` with its
    ``tokens`` stage (default: the outcome term on the tokens plus the reward-to-go, GRPO's eq. 9) and its flags
    (:class:`Estimator`)."""

    def register(outcome: OutcomeStage) -> OutcomeStage:
        ESTIMATORS[name] = Estimator(outcome, tokens, value_head, whiten)
        return outcome

    return register


@register_advantage("grpo")
def grpo_outcome(rewards: Tensor, group_ids: Tensor, ctx: AdvantageContext) -> Tensor:
    """GRPO's Â_o, :func:`group_normalized_advantage` with ``ctx.scale_rewards``."""
    return group_normalized_advantage(rewards, group_ids, scale_rewards=ctx.scale_rewards)


@register_advantage("reinforce", tokens=reinforce_tokens, whiten=True)
@register_advantage("gae", tokens=gae_tokens, value_head=True, whiten=True)
def raw_outcome(rewards: Tensor, group_ids: Tensor, ctx: AdvantageContext) -> Tensor:
    """No group baseline: the outcome reward itself (``gae``'s baseline is its value head; ``reinforce`` is
    whitened over the batch)."""
    return rewards.float()


@register_advantage("rloo")
def rloo_outcome(rewards: Tensor, group_ids: Tensor, ctx: AdvantageContext) -> Tensor:
    """RLOO's leave-one-out advantage (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!";
    Ahmadian et al. 2024, "Back to Basics", RLOO): A_i = r_i − 1/(k−1) Σ_{j≠i} r_j over the k rows of row i's
    group, i.e. k/(k−1)·(r_i − mean_group) — unbiased, as the baseline does not depend on r_i, and not scaled by a
    std (``scale_rewards`` is GRPO's). A group of one row has no other sample to compare with: its advantage is 0."""
    rewards = rewards.float()
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))
    total = torch.zeros(len(groups), device=rewards.device).index_add_(0, inverse, rewards)
    others = count[inverse] - 1
    baseline = (total[inverse] - rewards) / others.clamp(min=1)
    return torch.where(others > 0, rewards - baseline, torch.zeros_like(rewards))
