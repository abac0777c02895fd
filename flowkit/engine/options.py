"""The RL step's options, in groups, each checked where it is built (a one-line ConfigError naming the option).

A LightningModule takes them as flat constructor arguments (what a YAML config and ``--model.init_args.X`` set)
and builds these groups; the engine reads only the groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from flowkit.errors import ConfigError, check_range
from flowkit.rl.advantages import ESTIMATORS, AdvantageContext, AdvantageName, OutcomePlacement, ScaleRewards
from flowkit.rl.logprobs import DEFAULT_LM_HEAD_CHUNK
from flowkit.rl.losses import KL_ESTIMATORS, POLICY_LOSSES, Aggregation, KLEstimator, LossContext, PolicyLossName
from flowkit.rl.rollout_correction import RolloutCorrection


KLPlacement = Literal["loss", "reward"]


def _one_of(owner: str, name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{owner}.{name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class SamplingOptions:
    """``num_samples`` responses per prompt (the GRPO group), at most ``max_new_tokens`` each, sampled at
    ``temperature`` with nucleus ``top_p``; temperature 0 (greedy) needs one sample."""

    num_samples: int = 8
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0

    def check(self, owner: str) -> None:
        check_range(owner, "num_samples", self.num_samples, 1)
        check_range(owner, "max_new_tokens", self.max_new_tokens, 1)
        check_range(owner, "temperature", self.temperature, 0)
        check_range(owner, "top_p", self.top_p, 0, 1, open_low=True)
        if self.temperature == 0 and self.num_samples > 1:
            raise ConfigError(f"{owner}.temperature 0 (greedy) makes the {self.num_samples} samples of a prompt "
                              "identical, so every GRPO advantage is 0: use temperature > 0, or num_samples 1")


@dataclass(frozen=True)
class SamplingControls:
    """DAPO's sampling controls (Yu et al. 2025, §3.2 and §3.4; verl ``algorithm.filter_groups`` and
    ``reward_model.overlong_buffer``, TRL ``mask_truncated_completions``), all off by default.

    ``dynamic_sampling_max_draws``: drop the groups whose *raw* verifier outcomes (the grader's and reward
    functions' rewards, before any shaping such as the overlong penalty) are all equal — their GRPO advantage is 0
    — and generate for more prompts until as many groups as prompts are kept, at most that many generations per
    step (the first included); short of it, the step trains on the groups it kept. ``mask_truncated``: completions
    that end without EOS (cut at ``max_new_tokens``) take no part in the policy loss or its normalisation (their
    group's advantages still count them). ``overlong_buffer_length`` L_c, ``overlong_penalty`` p: DAPO eq. 13's soft
    overlong punishment added to the outcome reward, −p·(|y| − (L_max − L_c))/L_c for L_max − L_c < |y| ≤ L_max
    (−p at L_max, where generation stops), 0 below."""

    dynamic_sampling_max_draws: int | None = None
    mask_truncated: bool = False
    overlong_buffer_length: int | None = None
    overlong_penalty: float = 1.0

    @property
    def active(self) -> bool:
        return (self.dynamic_sampling_max_draws is not None or self.mask_truncated
                or self.overlong_buffer_length is not None)

    @classmethod
    def from_groups(cls, owner: str, dynamic_sampling: dict | None, mask_truncated: bool,
                    overlong_buffer: dict | None) -> SamplingControls:
        """From the module's ``dynamic_sampling: {max_draws}`` and ``overlong_buffer: {length, penalty}`` groups."""
        for name, group, required, allowed in (("dynamic_sampling", dynamic_sampling, {"max_draws"}, {"max_draws"}),
                                               ("overlong_buffer", overlong_buffer, {"length"}, {"length", "penalty"})):
            if group is not None and not (isinstance(group, dict) and required <= set(group) <= allowed):
                raise ConfigError(f"{owner}.{name} must be null or a mapping of {', '.join(sorted(allowed))} "
                                  f"({', '.join(sorted(required))} required), got {group!r}")
        overlong = overlong_buffer or {}
        return cls(None if dynamic_sampling is None else dynamic_sampling["max_draws"], mask_truncated,
                   overlong.get("length"), overlong.get("penalty", 1.0))

    def check(self, owner: str, max_new_tokens: int) -> None:
        check_range(owner, "dynamic_sampling.max_draws", self.dynamic_sampling_max_draws, 1)
        check_range(owner, "overlong_buffer.length", self.overlong_buffer_length, 1, max_new_tokens)
        check_range(owner, "overlong_buffer.penalty", self.overlong_penalty, 0)


@dataclass(frozen=True)
class AdvantageOptions:
    """``estimator``: ``grpo`` (RLFR eq. 9), ``rloo`` (eq. 9's form with the leave-one-out baseline), ``gae``
    (value head, whitened; PPO as TRL), ``reinforce`` (whitened reward-to-go) or another registered one
    (:func:`~flowkit.rl.advantages.register_advantage`); ``gamma``, ``lam``: discount and GAE λ; ``scale_rewards``:
    GRPO's std (``group`` | ``batch`` | ``none``); ``outcome_placement``: the outcome advantage on ``every_token``
    (the paper) or the ``last_token`` (official); ``entropy_alpha`` > 0 adds "Entropy Adv." (Cheng et al. 2025;
    RLFR Table 2's logit-space baseline), min(α·H_t, |A_t|/κ) with ``entropy_kappa`` κ, to every advantage
    (:func:`~flowkit.rl.advantages.entropy_shaped_advantages`)."""

    estimator: AdvantageName = "grpo"
    gamma: float = 1.0
    lam: float = 0.95
    scale_rewards: ScaleRewards = "group"
    outcome_placement: OutcomePlacement = "every_token"
    entropy_alpha: float = 0.0
    entropy_kappa: float = 2.0

    def check(self, owner: str) -> None:
        _one_of(owner, "advantage", self.estimator, tuple(ESTIMATORS))
        check_range(owner, "entropy_advantage_alpha", self.entropy_alpha, 0)
        check_range(owner, "entropy_advantage_kappa", self.entropy_kappa, 1, open_low=True)
        check_range(owner, "gamma", self.gamma, 0, 1)
        check_range(owner, "lam", self.lam, 0, 1)
        _one_of(owner, "scale_rewards", self.scale_rewards, ("group", "batch", "none"))
        _one_of(owner, "outcome_placement", self.outcome_placement, ("every_token", "last_token"))

    def context(self) -> AdvantageContext:
        """What the estimator reads of these options."""
        return AdvantageContext(self.gamma, self.lam, self.scale_rewards, self.outcome_placement)


@dataclass(frozen=True)
class LossOptions:
    """The clipped surrogate (ε_low, ε_high, dual clip c, ``aggregation``), the ``rollout_correction`` of rows an
    engine sampled from another distribution (:class:`~flowkit.rl.rollout_correction.RolloutCorrection`), the KL to the reference (``kl_coef``, its ``kl_estimator``, and whether it is a ``loss``
    term, as GRPO / verl, or subtracted from the ``reward``, as TRL's PPO), and the value loss (``vf_coef``,
    ``value_clip``) of the ``gae`` estimator. ``max_new_tokens``: the generation budget, for ``dr-grpo``.
    ``policy_loss``: the registered policy loss (``ppo`` the clipped surrogate, ``gspo`` its sequence-level ratio,
    ``cispo`` the clipped IS weight; :data:`~flowkit.rl.losses.POLICY_LOSSES`); ``entropy_coef``: weight of the
    entropy bonus (verl's ``entropy_coeff``; 0 is off); ``policy_loss_args``: values of the policy loss's own
    hyper-parameters, by the names its registration declares (the others keep their declared defaults)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    aggregation: Aggregation = "token-mean"
    rollout_correction: RolloutCorrection = RolloutCorrection()
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_in: KLPlacement = "loss"
    vf_coef: float = 0.1
    value_clip: float = 0.2
    max_new_tokens: int = 1024
    policy_loss: PolicyLossName = "ppo"
    entropy_coef: float = 0.0
    policy_loss_args: dict[str, float] = field(default_factory=dict)

    def check(self, owner: str) -> None:
        _one_of(owner, "policy_loss", self.policy_loss, tuple(POLICY_LOSSES))
        accepted = POLICY_LOSSES[self.policy_loss].args
        unknown = sorted(set(self.policy_loss_args) - set(accepted))
        if unknown:
            raise ConfigError(f"{owner}.policy_loss_args: policy_loss {self.policy_loss!r} accepts "
                              f"{', '.join(sorted(accepted)) or 'no arguments'}, got {', '.join(unknown)}")
        if self.clip_ratio_c is not None and self.policy_loss == "cispo":
            raise ConfigError(f"{owner}.clip_ratio_c applies to policy_loss ppo and gspo (cispo has no min to cap): "
                              "set it to null")
        check_range(owner, "entropy_coef", self.entropy_coef, 0)
        check_range(owner, "clip_low", self.clip_low, 0, 1, open_high=True)  # the ratio's lower bound 1 − ε must be > 0
        check_range(owner, "clip_high", self.clip_high, 0)
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ConfigError(f"{owner}.clip_ratio_c must be > 1 (or null), got {self.clip_ratio_c}")
        _one_of(owner, "aggregation", self.aggregation, ("token-mean", "seq-mean", "dr-grpo"))
        self.rollout_correction.check(owner)
        check_range(owner, "kl_coef", self.kl_coef, 0)
        _one_of(owner, "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of(owner, "kl_in", self.kl_in, ("loss", "reward"))
        check_range(owner, "vf_coef", self.vf_coef, 0)
        check_range(owner, "value_clip", self.value_clip, 0, open_low=True)
        check_range(owner, "max_new_tokens", self.max_new_tokens, 1)

    def context(self, importance_weights: Tensor | None, denominator: Tensor) -> LossContext:
        """The policy loss's context for one micro-batch: these options, the micro-batch's rollout-correction
        ``importance_weights`` and its minibatch's aggregation ``denominator``."""
        return LossContext(self.clip_low, self.clip_high, self.clip_ratio_c, self.aggregation, importance_weights,
                           denominator, self.max_new_tokens,
                           {**POLICY_LOSSES[self.policy_loss].args, **self.policy_loss_args})


@dataclass(frozen=True)
class UpdateOptions:
    """How one generation becomes optimizer steps: ``ppo_epochs`` × ``num_minibatches`` updates (1 × 1 is on-policy:
    no separate scoring pass), ``micro_batch_size`` sequences per forward/backward (None: a whole minibatch),
    ``lm_head_chunk_size`` response tokens per LM-head call, ``temperature`` the log-probs refer to (the sampling
    temperature), ``skip_zero_advantage_rows`` (a row whose advantages are all 0 adds nothing: skip it) and
    ``micro_batch_tokens``: pack rows, longest first, into micro-batches of at most that many tokens, padding
    included (rows × longest row; at most ``micro_batch_size`` rows when that is set too); None: fixed counts."""

    ppo_epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int | None = None
    lm_head_chunk_size: int | None = DEFAULT_LM_HEAD_CHUNK
    temperature: float = 1.0
    skip_zero_advantage_rows: bool = True
    micro_batch_tokens: int | None = None

    @property
    def updates(self) -> int:
        return self.ppo_epochs * self.num_minibatches

    def check(self, owner: str) -> None:
        for name in ("ppo_epochs", "num_minibatches", "micro_batch_size", "lm_head_chunk_size", "micro_batch_tokens"):
            check_range(owner, name, getattr(self, name), 1)
        check_range(owner, "temperature", self.temperature, 0)
