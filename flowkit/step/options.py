"""The RL step's option groups, which are also the public configuration: ``model.init_args.sampling.temperature``.

Each option is declared once (:mod:`flowkit.options`: type, default, help under the field, range); the engine reads
only these groups. ``LossOptions.max_new_tokens`` and ``UpdateOptions.temperature`` are not keys of their own: the
module copies them from the sampling group (:meth:`LossOptions.with_budget`, :meth:`UpdateOptions.at_temperature`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from flowkit.errors import ConfigError
from flowkit.options import OptionGroup, bounded, registered, registry_entry
from flowkit.rl.advantages import ESTIMATORS, AdvantageContext, OutcomePlacement, ScaleRewards
from flowkit.rl.logprobs import DEFAULT_LM_HEAD_CHUNK
from flowkit.rl.losses import POLICY_LOSSES, Aggregation, KLEstimator, LossContext
from flowkit.rl.rollout_correction import RolloutCorrection


KLPlacement = Literal["loss", "reward"]


@dataclass(frozen=True)
class SamplingOptions(OptionGroup):
    """Sampling of the training rollouts: exactly the policy's softmax at ``temperature`` (with nucleus ``top_p``). The
    HF engine ignores the sampling knobs of the model's ``generation_config`` (an instruct model's top_k 20, repetition
    penalty, ...) and HF's global top_k 50, each of which would make the rollouts off-policy for the loss; it encodes
    each prompt once per group."""

    num_samples: int = bounded(8, 1)
    """responses per prompt (the GRPO group size)"""
    max_new_tokens: int = bounded(1024, 1)
    """the most tokens a response may have"""
    temperature: float = bounded(1.0, 0)
    """sampling temperature; 0 (greedy) needs ``num_samples`` 1 (identical samples have GRPO advantage 0)"""
    top_p: float = bounded(1.0, 0, 1, open_low=True)
    """nucleus sampling's probability mass"""

    def check_rules(self, owner: str) -> None:
        if self.temperature == 0 and self.num_samples > 1:
            raise ConfigError(f"{owner}.temperature 0 (greedy) makes the {self.num_samples} samples of a prompt "
                              "identical, so every GRPO advantage is 0: use temperature > 0, or num_samples 1")


@dataclass(frozen=True)
class SamplingControls(OptionGroup):
    """DAPO's sampling controls (Yu et al. 2025, §3.2 and §3.4; verl ``algorithm.filter_groups`` and
    ``reward_model.overlong_buffer``, TRL ``mask_truncated_completions``), all off by default. With any of them on,
    ``train/truncated_frac`` and ``train/zero_advantage_group_frac`` are logged."""

    dynamic_sampling_max_draws: int | None = bounded(None, 1)
    """DAPO's dynamic sampling: drop the groups whose raw verifier outcomes (before shaping such as the overlong
    penalty) are all equal (their GRPO advantage is 0) and generate for more prompts (``RolloutDataModule.extra_batch``)
    until as many groups as prompts are kept, at most this many generations per step (the first included); short of
    it, the step trains on the groups it kept. Ranks draw equally often (the smallest rank's count decides), each
    keeping its own groups. Logged: ``train/groups_kept``, ``train/groups_drawn``,
    ``train/sampling_draws``. null: off"""
    mask_truncated: bool = False
    """completions that end without EOS (cut at ``max_new_tokens``) take no part in the policy loss or its
    normalisation (their group's advantages still count them; TRL ``mask_truncated_completions``)"""
    overlong_buffer_length: int | None = bounded(None, 1)
    """L_c of DAPO eq. 13's soft overlong punishment added to the outcome reward, −p·(|y| − (L_max − L_c))/L_c for
    L_max − L_c < |y| ≤ L_max (verl ``overlong_buffer``); null: off"""
    overlong_penalty: float = bounded(1.0, 0)
    """p of the overlong punishment (−p at ``max_new_tokens``)"""

    @property
    def active(self) -> bool:
        return (self.dynamic_sampling_max_draws is not None or self.mask_truncated
                or self.overlong_buffer_length is not None)

    def check_within(self, owner: str, max_new_tokens: int) -> None:
        """:meth:`check`, and the buffer fits in the sampling budget."""
        self.check(owner)
        if self.overlong_buffer_length is not None and self.overlong_buffer_length > max_new_tokens:
            raise ConfigError(f"{owner}.overlong_buffer_length must be <= sampling.max_new_tokens ({max_new_tokens}), "
                              f"got {self.overlong_buffer_length}")


@dataclass(frozen=True)
class AdvantageOptions(OptionGroup):
    """The advantage estimator (:mod:`flowkit.rl.advantages`)."""

    estimator: str = registered("grpo", ESTIMATORS)
    """``grpo`` (group-normalised outcome + reward-to-go of the token rewards, RLFR eq. 9), ``rloo`` (eq. 9's form
    with the leave-one-out baseline r_i − mean_{j≠i} r_j of the row's group, unscaled), ``gae`` (a value head on
    the policy's last hidden state, GAE(γ, λ) over the token rewards with the outcome on the last token, whitened;
    PPO as TRL's PPO trainer), ``reinforce`` (the whitened reward-to-go, no value head) or another registered one
    (:func:`~flowkit.rl.advantages.register_advantage`; ``module.name``: the one ``name`` that importing ``module``, a
    file of your project, registers)"""
    gamma: float = bounded(1.0, 0, 1)
    """discount of the dense rewards' reward-to-go"""
    lam: float = bounded(0.95, 0, 1)
    """GAE's λ (``gae``)"""
    scale_rewards: ScaleRewards = "group"
    """std that scales the outcome advantage (TRL's option): ``group`` (GRPO), ``batch`` or ``none`` (Dr. GRPO)"""
    outcome_placement: OutcomePlacement = "every_token"
    """where the outcome advantage Â_o enters eq. 9: ``every_token`` (the paper: added to every token, undiscounted)
    or ``last_token`` (the official code: a reward on the last response token, discounted with γ like the token
    rewards); the two agree at γ = 1"""
    entropy_alpha: float = bounded(0.0, 0)
    """"Entropy Adv." (Cheng et al. 2025, the logit-space baseline of RLFR Table 2): α > 0 adds min(α·H_t, |A_t|/κ)
    to every token's advantage, H_t the policy's token entropy (detached); it never flips A_t's sign and adds
    nothing where A_t = 0. 0 is off; Cheng et al. run α 0.4, κ 2"""
    entropy_kappa: float = bounded(2.0, 1, open_low=True)
    """κ of "Entropy Adv." (> 1)"""

    def context(self) -> AdvantageContext:
        """What the estimator reads of these options."""
        return AdvantageContext(self.gamma, self.lam, self.scale_rewards, self.outcome_placement)


@dataclass(frozen=True)
class LossOptions(OptionGroup):
    """The policy loss, the KL to the reference and the value loss (:mod:`flowkit.rl.losses`)."""

    clip_low: float = bounded(0.2, 0, 1, open_high=True)
    """ε of the clipped surrogate (the ratio's lower bound 1 − ε must be > 0)"""
    clip_high: float = bounded(0.2, 0)
    """ε_high of the clipped surrogate"""
    clip_ratio_c: float | None = None
    """dual-clip bound c > 1 for negative advantages (verl's ``clip_ratio_c``, usually 3); null: off"""
    aggregation: Aggregation = "token-mean"
    """loss aggregation over a minibatch: ``token-mean`` (Σ tokens / number of response tokens, DAPO), ``seq-mean``
    (mean of per-sequence means, GRPO) or ``dr-grpo`` (Σ tokens / (B·max_new_tokens), Dr. GRPO)"""
    rollout_correction: RolloutCorrection = RolloutCorrection()
    """the correction of rows the rollout engine sampled from another distribution than the trainer's forward (its
    numerics, or older weights): truncated / masked importance weights per token or sequence, IcePop, the off-policy
    sequence mask, or PPO anchored at the rollout's log-probs (TRL / verl; the keys below). The mismatch is logged as
    ``rollout_corr/...`` whatever it is set to"""
    kl_coef: float = bounded(0.0, 0)
    """weight of the KL to the initial policy (0 = off, the paper's setting). The reference is the base model read
    with the LoRA adapters disabled under ``lora`` (no second copy), else a frozen copy; after an SFT start, the
    SFT'd policy"""
    kl_estimator: KLEstimator = "k3"
    """:func:`~flowkit.rl.losses.kl_estimate`: ``k1``, ``k2``, ``k3`` / ``low_var_kl`` (clamped as verl), ``abs``, or
    verl's straight-through ``k1+`` / ``k3+`` / ``low_var_kl+`` (value of k1 / k3, gradient of k2)"""
    kl_in: KLPlacement = "loss"
    """``loss`` (a loss term, as GRPO / verl) or ``reward`` (subtracted from the token rewards before the
    advantages, as TRL's PPO)"""
    vf_coef: float = bounded(0.1, 0)
    """weight of the value loss (``gae``; TRL's default)"""
    value_clip: float = bounded(0.2, 0, open_low=True)
    """clip of the value loss (``gae``; TRL's default)"""
    policy_loss: str = registered("ppo", POLICY_LOSSES)
    """``ppo`` (the clipped surrogate), ``gspo`` (its ratio replaced by the row's length-normalised sequence ratio,
    GSPO-token; TRL ``importance_sampling_level="sequence"``, verl ``loss_mode: gspo``; ``aggregation: seq-mean`` for
    the paper's objective) or ``cispo`` (the clipped
    importance weight, detached, times ∇logπ: MiniMax-M1; verl ``loss_mode: cispo``); each with ``clip_low`` /
    ``clip_high``; or another registered one (:func:`~flowkit.rl.losses.register_policy_loss`; ``module.name``: the
    one ``name`` that importing ``module``, a file of your project, registers)"""
    entropy_coef: float = bounded(0.0, 0)
    """weight of an entropy bonus, −coef × the token entropy aggregated as the policy loss (verl's
    ``entropy_coeff``); 0 is off. With it, every row runs (a zero-advantage row still has an entropy)"""
    policy_loss_args: dict[str, float] = field(default_factory=dict)
    """values of the policy loss's own hyper-parameters, by the names its registration declares
    (:func:`~flowkit.rl.losses.register_policy_loss`); the others keep their declared defaults"""
    max_new_tokens: int = field(default=1024, init=False)  # sampling.max_new_tokens, for dr-grpo: with_budget

    def with_budget(self, max_new_tokens: int) -> LossOptions:
        """This group with the sampling budget that ``dr-grpo`` and the truncation controls divide by."""
        bound = replace(self)
        object.__setattr__(bound, "max_new_tokens", max_new_tokens)  # frozen; not a key of its own
        return bound

    def check_rules(self, owner: str) -> None:
        accepted = registry_entry(POLICY_LOSSES, self.policy_loss).args
        unknown = sorted(set(self.policy_loss_args) - set(accepted))
        if unknown:
            raise ConfigError(f"{owner}.policy_loss_args: policy_loss {self.policy_loss!r} accepts "
                              f"{', '.join(sorted(accepted)) or 'no arguments'}, got {', '.join(unknown)}")
        if self.clip_ratio_c is not None and self.policy_loss == "cispo":
            raise ConfigError(f"{owner}.clip_ratio_c applies to policy_loss ppo and gspo (cispo has no min to cap): "
                              "set it to null")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ConfigError(f"{owner}.clip_ratio_c must be > 1 (or null), got {self.clip_ratio_c}")

    def context(self, importance_weights: Tensor | None, denominator: Tensor) -> LossContext:
        """The policy loss's context for one micro-batch: these options, the micro-batch's rollout-correction
        ``importance_weights`` and its minibatch's aggregation ``denominator``."""
        return LossContext(self.clip_low, self.clip_high, self.clip_ratio_c, self.aggregation, importance_weights,
                           denominator, self.max_new_tokens,
                           {**registry_entry(POLICY_LOSSES, self.policy_loss).args, **self.policy_loss_args})


@dataclass(frozen=True)
class UpdateOptions(OptionGroup):
    """How one generation becomes optimizer steps, and the memory of every pass over the rollouts. Gradients
    accumulate over a minibatch's micro-batches and the loss is normalised over the whole minibatch, so results do
    not depend on the micro-batch size."""

    ppo_epochs: int = bounded(1, 1)
    """μ, passes over each generation. Each update is an optimizer step, and Lightning's ``trainer.max_steps``
    counts optimizer steps: ppo_epochs × num_minibatches per RL step (the old log-probs come from the scoring pass
    before the first; 1 × 1, on-policy, takes them from the training forward itself, detached: a ratio of exactly 1,
    and without a reward model, KL reference, value head or entropy shaping no scoring pass runs at all)"""
    num_minibatches: int = bounded(1, 1)
    """updates per pass"""
    micro_batch_size: int | None = bounded(None, 1)
    """sequences per forward/backward in every pass over the rollouts (scoring, flow rewards, policy update, online
    flow loss); null: a whole minibatch at once"""
    lm_head_chunk_size: int | None = bounded(DEFAULT_LM_HEAD_CHUNK, 1)
    """response tokens per LM-head call for log-probs and entropies (bounds the logits to chunk × V; the backward
    recomputes each chunk's); null: all of a micro-batch's response tokens at once, their logits kept for the backward
    (one LM-head matmul of four saved, the micro-batch's response tokens × V floats held)"""
    skip_zero_advantage_rows: bool = True
    """a row whose advantages are all 0 adds exactly nothing to the loss or its gradient: skip its forward/backward
    in the update (with a KL term, a value head or an entropy bonus, every row runs); the normalisation still counts
    its tokens, and a scoring pass (token rewards, ``train/entropy``) still reads every row (without one,
    ``train/entropy`` is over the rows the update forwards)"""
    micro_batch_tokens: int | None = bounded(None, 1)
    """pack every pass's rows into micro-batches of at most this many tokens, padding included (rows × longest row;
    with ``padding_free``, the real tokens; verl ``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``): rows longest first, cut into runs of at most
    ``micro_batch_size`` rows when that is set too; ranks agree on the count. At a long-tailed length distribution
    the same peak as 8 fixed rows computes 0.52× the padded positions in 0.48× the time
    (``benchmarks/bench_token_budget.py``). null: ``micro_batch_size`` rows"""
    padding_free: bool = False
    """every pass over the rollouts (scoring, KL reference, policy update) runs a micro-batch's rows packed into one
    sequence with per-row positions and attention kept per row, computing no padded position
    (``perf/padding_frac`` 0); ``micro_batch_tokens`` then counts real tokens. Needs a transformers decoder with
    ``sdpa``, ``eager``, ``flex_attention`` or flash-attention (others run padded). false: B × S padded rows, a
    group's prompt run once where sound"""
    temperature: float = field(default=1.0, init=False)  # sampling.temperature, the log-probs' own: at_temperature

    @property
    def updates(self) -> int:
        return self.ppo_epochs * self.num_minibatches

    def at_temperature(self, temperature: float) -> UpdateOptions:
        """This group with the sampling temperature the log-probs refer to."""
        bound = replace(self)
        object.__setattr__(bound, "temperature", temperature)  # frozen; not a key of its own
        return bound


# Saved in the hyper-parameters of a checkpoint, which Lightning and flowkit load with weights_only.
torch.serialization.add_safe_globals([SamplingOptions, SamplingControls, AdvantageOptions, LossOptions, UpdateOptions])
