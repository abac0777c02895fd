"""FlowReward's option groups (``reward_model.init_args.scoring.eta``), declared once each as
:mod:`flowkit.options` declares them, and the protocol presets.

Where the RLFR paper and its official code (the RL scripts on ``ppo_trainer.py``) differ, the option's default is
null: the ``protocol`` fills it (:data:`PRESETS`, :func:`resolve`); a value given explicitly overrides the preset.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

import torch

from flowkit.errors import ConfigError, check_nonempty, check_range
from flowkit.options import OptionGroup, bounded, markdown, options_table
from flowkit.rewards.flow.matching import DEFAULT_MAX_ROWS, Condition
from flowkit.rewards.flow.rejection import TOKEN_METRICS, Metric
from flowkit.rewards.flow.scoring import Normalization

FlowProtocol = Literal["flowkit", "paper", "official"]
FlowUpdate = Literal["buffer", "micro_batch"]
EntropyOf = Literal["sampled", "next"]


@dataclass(frozen=True)
class LatentOptions(OptionGroup):
    """Which of the policy's latents the reference flow models (RLFR §3.1)."""

    percentiles: tuple[float, ...] = (0.25, 0.5, 0.75)
    """layer percentiles P whose latents are scored: the outputs of decoder blocks min(round(p·L), L−1), as the
    official code hooks them (:func:`~flowkit.llm.latent_tap.tapped_layer_indices`); each in (0, 1]"""
    condition: Condition | None = None
    """which latent conditions the field of token j: ``next`` = h_{j+1} (the paper's "subsequent token"; the last
    response token is unscored), ``previous`` = h_{j−1} (the official RL scripts' ``token_post``: the first response
    token is scored against the last prompt token) or ``none``; null: the protocol's"""

    def check_rules(self, owner: str) -> None:
        check_nonempty(owner, "percentiles", self.percentiles)
        for p in self.percentiles:
            check_range(owner, "percentiles", p, 0.0, 1.0, open_low=True)  # as tapped_layer_indices takes them


@dataclass(frozen=True)
class NetworkOptions(OptionGroup):
    """The velocity field v_φ (an AdaLN MLP, :class:`~flowkit.rewards.flow.field.VelocityField`) and the rows it
    takes per call."""

    depth: int = bounded(4, 1)
    """residual AdaLN blocks"""
    width: int | None = bounded(None, 1)
    """hidden width; null: the backbone's hidden size (the official)"""
    max_rows_per_call: int | None = bounded(DEFAULT_MAX_ROWS, 1)
    """velocity-field rows (token × percentile × timestep) per call when scoring: bounds the scoring memory of long
    rollouts without changing any score; null scores everything in one call"""
    max_rows_per_piece: int | None = bounded(DEFAULT_MAX_ROWS, 1)
    """velocity-field rows per backward piece of the flow loss (online update and offline pretraining): the pieces
    are backpropagated one at a time, so this bounds the field's activations held for a backward; the loss does not
    change. null: one piece"""


@dataclass(frozen=True)
class ScoringOptions(OptionGroup):
    """The token rewards: the debiased deviation R_CFM (eq. 5–7) normalised per row, thresholded and scaled
    (eq. 10): r_k = −β·𝕀[r̂_k > η]·r̂_k (:mod:`flowkit.rewards.flow.scoring`)."""

    timesteps: tuple[float, ...] = (0.8,)
    """rewarding timesteps T, each in (0, 1) and weighted t/(1−t) (eq. 7); also the online update's timesteps"""
    eta: float = bounded(0.6, 0.0, 1.0)
    """threshold η of eq. 10 (r̂ lies in [0, 1], |r̂| in [0, 1] for ``bilateral`` / ``mean``)"""
    beta: float = bounded(0.01, 0.0)
    """scale β of eq. 10"""
    top_k: int | None = bounded(None, 1)
    """keep exactly k tokens in rows with ≥ k survivors (the official ``--flow_score_topk``, 15 in its scripts);
    null: off"""
    normalization: Normalization | None = None
    """``minmax`` (official ``--flow_reward_norm minmax``: r̂ ∈ [0, 1], penalties only), ``bilateral`` (the paper's
    eq. 10 text: r̂ ∈ [−1, 1], |r̂| > η, bonuses for unusually low deviation) or ``mean`` (official ``mean``:
    min-max minus the row mean); null: the protocol's"""
    score_power: float = bounded(1.0, 0.0, open_low=True)
    """γ of the official ``--flow_gamma``: r̂ ← sign(r̂)·|r̂|^γ before η; 1 is off"""
    noise_draws: int = bounded(1, 1)
    """noise draws averaged per reward (variance reduction; the official code uses 1)"""
    debias: bool = True
    """weight each rewarding timestep's deviation by t/(1−t) (eq. 7); false averages the plain R_FM of eq. 5 (the
    paper's "w/o debias" ablation)"""

    def check_rules(self, owner: str) -> None:
        check_nonempty(owner, "timesteps", self.timesteps)
        for t in self.timesteps:
            # 0.99999999 rounds to 1.0 in float32, where the weight t/(1−t) is infinite and every score NaN or inf.
            t32 = torch.tensor(t, dtype=torch.float32)
            if not (0 < t32 < 1 and torch.isfinite(t32 / (1 - t32))):
                raise ConfigError(f"{owner}.timesteps must lie in (0, 1) with a finite t/(1−t) weight in float32, "
                                  f"got {t!r} ({float(t32)!r} in float32)")


@dataclass(frozen=True)
class OnlineOptions(OptionGroup):
    """The online update of the flow on the policy's own rollouts (RLFR Alg. 1, :mod:`flowkit.rewards.flow.online`);
    the flow's optimizer is ``PolicyModule.optim.flow_lr``."""

    online_update: bool | None = None
    """train the flow during RL; false freezes it (the paper's ablation, and what the official scripts run: their
    flow loss has no graph, docs/methods/rlfr.md); null: the protocol's"""
    flow_update: FlowUpdate | None = None
    """``buffer``: the paper's Alg. 1 — accepted rollouts are buffered until κ are there, then eq. 4 is the plain
    mean over their scored tokens. ``micro_batch``: the official trainer (``ppo_trainer.py`` L488-520) — every step,
    per micro-batch a masked mean over a row's tokens (weights a_j) then over the rows (weights b_r: 1 if accepted,
    else ``soft_weight``), averaged over the step's micro-batches; flowkit takes one flow step per RL step where the
    official takes one per policy minibatch. null: the protocol's"""
    rejection_metric: Metric = "correct"
    """which rollouts train the flow: ``correct`` (official ``batch_correct``), ``entropy`` (mean entropy above the
    batch median), ``both``; with ``flow_update: micro_batch`` also ``token_entropy`` (official
    ``trajectory_entropy``: every row, its tokens selected by ``entropy_quantile``) and ``correct+token_entropy``"""
    kappa: int = bounded(32, 1)
    """κ of Alg. 1: a buffer update happens once at least κ accepted rollouts are buffered, on all of them"""
    update_every_step: bool = False
    """``buffer``: update on every RL step that accepted any rollout (on every rank), ignoring κ"""
    soft_weight: float = bounded(0.0, 0.0, 1.0)
    """``micro_batch``: weight b_r of a rejected row, and a_j of a token below the entropy quantile (official
    ``--soft_flow``)"""
    entropy_quantile: float | None = bounded(None, 0.0, 1.0)
    """q of the token metrics (official ``--metrics_entropy_quantile``): tokens whose entropy is ≥ the row's
    q-quantile over its scored tokens weigh 1, the others ``soft_weight``"""
    entropy_of: EntropyOf | None = None
    """the token entropy the quantile reads: ``sampled`` (of the distribution the token was sampled from) or
    ``next`` (the official ``entropy_from_logits(logits[:, -num_actions:])``: the distribution after the token, one
    position later; a row's last token keeps its own); null: the protocol's"""
    flow_warmup_steps: int = bounded(0, 0)
    """for the first N RL steps the policy is frozen and only the flow trains, on the policy's rollouts (official
    ``--freezing_actor_steps_for_flow N``); a warm-up RL step counts one of ``trainer.max_steps``"""

    def check_rules(self, owner: str) -> None:
        if self.flow_update == "buffer" and (self.soft_weight > 0 or self.rejection_metric in TOKEN_METRICS):
            raise ConfigError(f"{owner}.soft_weight > 0 and the token_entropy metrics weigh tokens of the official "
                              "per-micro-batch update: set flow_update: micro_batch")
        if (self.rejection_metric in TOKEN_METRICS) != (self.entropy_quantile is not None):
            raise ConfigError(f"{owner}.entropy_quantile is the quantile of the token_entropy metrics: set both or "
                              f"neither (rejection_metric {self.rejection_metric!r}, entropy_quantile "
                              f"{self.entropy_quantile!r})")
        if self.flow_update == "micro_batch" and self.update_every_step:
            raise ConfigError(f"{owner}.update_every_step is the buffer's cadence; flow_update: micro_batch updates "
                              "on every step already: set update_every_step false")
        if self.flow_warmup_steps > 0 and not self.online_update:
            raise ConfigError(f"{owner}.flow_warmup_steps trains the flow with the policy frozen: it needs "
                              "online_update true")


@dataclass(frozen=True)
class PretrainingOptions(OptionGroup):
    """The offline pretraining's loss (eq. 4 on expert latents; ``PolicyModule.flow_pretrain`` or
    ``FlowRewardModule`` run it)."""

    pretrain_timesteps: int = bounded(4, 1)
    """copies of every token, each with its own logit-normal t and noise (the official ``flow_batch_mul``: 4 for
    Qwen2.5-1.5B, 2 for 7B)"""
    pretrain_logit_mean: float = bounded(0.0, -5.0, 5.0)
    """location m of t = sigmoid(n), n ~ N(m, 1); the official uses 0, m > 0 spends more of the pretraining near
    high rewarding timesteps (beyond ±5, t is all 0 or 1)"""
    pretrain_condition: Condition | None = None
    """the condition the pretraining loss uses (the official pretrains with ``next``, ``token_pre``, and scores
    with ``previous``); null: the protocol's, which for ``flowkit`` and ``paper`` is ``latents.condition``"""


# Each group's preset-controlled options by protocol: ``flowkit`` is flowkit's default (the official scoring with
# the paper's online Alg. 1), ``paper`` the RLFR paper's text, ``official`` what the official RL scripts run.
# pretrain_condition None: as latents.condition.
PRESETS: dict[str, dict[str, dict[str, object]]] = {
    "flowkit": {"latents": {"condition": "previous"}, "scoring": {"normalization": "minmax"},
                "online": {"online_update": True, "flow_update": "buffer", "entropy_of": "sampled"},
                "pretraining": {"pretrain_condition": None}},
    "paper": {"latents": {"condition": "next"}, "scoring": {"normalization": "bilateral"},
              "online": {"online_update": True, "flow_update": "buffer", "entropy_of": "sampled"},
              "pretraining": {"pretrain_condition": None}},
    "official": {"latents": {"condition": "previous"}, "scoring": {"normalization": "minmax"},
                 "online": {"online_update": False, "flow_update": "micro_batch", "entropy_of": "next"},
                 "pretraining": {"pretrain_condition": "next"}},
}


def resolve(protocol: str, key: str, group: OptionGroup) -> OptionGroup:
    """``group`` (FlowReward's group ``key``) with each option it left null set to ``protocol``'s value."""
    if protocol not in PRESETS:
        raise ConfigError(f"FlowReward.protocol must be one of {', '.join(PRESETS)}, got {protocol!r}")
    unset = {name: value for name, value in PRESETS[protocol].get(key, {}).items() if getattr(group, name) is None}
    return replace(group, **unset)


def preset_table() -> str:
    """The Markdown table of what each protocol picks (docs/methods/rlfr.md)."""
    rows = ["| option | " + " | ".join(f"`{name}`" for name in PRESETS) + " |",
            "|---|" + "---|" * len(PRESETS)]
    for key, group in GROUPS.items():
        for option in fields(group):
            values = [PRESETS[name].get(key, {}) for name in PRESETS]
            if option.name in values[0]:
                shown = ["as `latents.condition`" if v[option.name] is None else f"`{str(v[option.name]).lower()}`"
                         for v in values]
                rows.append(f"| `{key}.{option.name}` | " + " | ".join(shown) + " |")
    return "\n".join(rows)


def reference_tables(prefix: str = "reward_model.init_args") -> str:
    """FlowReward's option tables, one per group under ``prefix``, generated from the declarations (the option
    reference's, docs/reference/options.md)."""
    intro = (f"**`{prefix}`** (`flowkit.rewards.FlowReward`) — `protocol` (`{'`, `'.join(PRESETS)}`, default "
             "`flowkit`) fills each option below whose default is null (docs/methods/rlfr.md); `seed` (null: the "
             "run's) and `weights` (a pretrained flow's safetensors) are its own keys.")
    return "\n\n".join([intro, *(f"**`{prefix}.{key}`** — {markdown(' '.join((group.__doc__ or '').split()))}\n\n"
                                   f"{options_table(group, f'{prefix}.{key}')}" for key, group in GROUPS.items())])


# FlowReward's groups by key, in the order of its signature (and of the generated tables).
GROUPS: dict[str, type] = {"latents": LatentOptions, "network": NetworkOptions, "scoring": ScoringOptions,
                           "online": OnlineOptions, "pretraining": PretrainingOptions}

# Saved in the hyper-parameters of a checkpoint, which Lightning and flowkit load with weights_only.
torch.serialization.add_safe_globals(list(GROUPS.values()))
