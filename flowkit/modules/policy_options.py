"""Every option group of :class:`~flowkit.modules.PolicyModule` (importable from here; those the RL engine reads are
declared in :mod:`flowkit.step.options`, the rollout engine's in :mod:`flowkit.llm.engines`), the check of all its
options (:func:`check_options`), the table of options that moved into groups (a config in the old flat form is a
one-line error naming the new key), and the groups' reference tables (:func:`option_tables`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from flowkit.agents import EpisodeOptions
from flowkit.step.options import AdvantageOptions, LossOptions, SamplingControls, SamplingOptions, UpdateOptions
from flowkit.errors import ConfigError, check_range
from flowkit.llm.engines import ROLLOUT_ENGINES, RolloutOptions
from flowkit.llm.lora import LoraSettings
from flowkit.modules.optim import LrDecay
from flowkit.options import (
    OptionGroup, bounded, literal_values, markdown, moved_options, options_table, registry_entry,
)
from flowkit.rewards.base import PretrainsOnLatents, TokenRewardModel
from flowkit.rewards.flow.options import reference_tables
from flowkit.rewards.functions import OutcomeReward

__all__ = ["AdvantageOptions", "EpisodeOptions", "FlowPretrainOptions", "GROUPS", "LossOptions", "MOVED_OPTIONS",
           "OptimOptions", "RolloutOptions", "SFTOptions", "SamplingControls", "SamplingOptions", "UpdateOptions",
           "ValidationOptions", "check_options", "option_tables"]


@dataclass(frozen=True)
class OptimOptions(OptionGroup):
    """One AdamW over the parameter groups ``policy`` and ``value`` (``lr``) and ``reward`` (``flow_lr``), and the
    finite-state guard of its steps."""

    lr: float = bounded(1e-6, 0, open_low=True)
    """learning rate of the policy (and the value head)"""
    flow_lr: float = bounded(1e-4, 0, open_low=True)
    """learning rate of the reward model (online updates and the offline pretraining)"""
    lr_warmup_steps: int = bounded(0, 0)
    """optimizer steps over which the policy's (and the value head's) learning rate rises linearly to ``lr`` (step k
    of n: lr·k/n; verl's ``lr_warmup_steps``, TRL's ``warmup_steps``). Adam's first steps move every weight by about
    ``lr`` whatever the gradient's noise, which a small policy's format may not survive. 0: ``lr`` from the first
    step"""
    max_grad_norm: float | None = bounded(1.0, 0, open_low=True)
    """gradient clipping over all groups (null: off); under DeepSpeed it becomes the config's ``gradient_clipping``
    (Lightning leaves clipping to DeepSpeed there)"""
    nonfinite: Literal["skip", "fail"] = "skip"
    """when logits, rewards, advantages or gradients are not finite: ``skip`` the step (logged as
    ``train/skipped_steps``) or ``fail``"""
    max_consecutive_skips: int | None = bounded(10, 1)
    """with ``nonfinite: skip``, fail (with the reason) after this many RL steps in a row were skipped, e.g. NaN
    weights that no step can repair; null never fails"""

    def warmup_rates(self, step: int) -> dict[str, float]:
        """The policy's and the value head's learning rate at optimizer step ``step`` (counted from 1) of the warmup;
        none outside it (the groups step at ``lr`` and ``flow_lr``)."""
        if not 1 <= step <= self.lr_warmup_steps:
            return {}
        return dict.fromkeys(("policy", "value"), self.lr * step / self.lr_warmup_steps)


@dataclass(frozen=True)
class FlowPretrainOptions(OptionGroup):
    """The offline start (RLFR §3.2): reward-model pretraining on the DataModule's expert solutions with the backbone
    frozen, run once before RL (skipped when resuming); AdamW at ``optim.flow_lr`` after a 10 % warmup
    (:func:`~flowkit.modules.optim.flow_pretraining_schedule`)."""

    steps: int = bounded(0, 0)
    """pretraining steps (0: none); needs a reward model with latents to pretrain (a FlowReward)"""
    batch_size: int = bounded(128, 1)
    """expert solutions per pretraining step"""
    cache_latents: bool = False
    """encode each expert solution once and keep its latents on CPU for the later epochs (the backbone is frozen, so
    they do not change); for small backbones and datasets"""
    lr_decay: LrDecay = "cosine"
    """``cosine`` to 0 after the warmup (the official offline pretraining) or ``constant`` (the tiny job: its short
    pretraining leaves the flow undertrained, and decay cost it error signal)"""


@dataclass(frozen=True)
class ValidationOptions(OptionGroup):
    """Validation: pass@1 and pass@k (k = ``num_samples``) of the math grader on each eval set."""

    num_samples: int = bounded(4, 1)
    """samples per prompt"""
    temperature: float = bounded(1.0, 0)
    """sampling temperature; 0 is greedy with one sample"""


@dataclass(frozen=True)
class SFTOptions(OptionGroup):
    """An SFT start before the first RL step (:func:`~flowkit.modules.sft.supervised_start`) on the training records'
    ``solution`` completions (the TPL paper: 3 epochs on the preferred explanations at 2e-5, App. F); with a KL,
    PPO's reference is then the SFT'd policy."""

    epochs: int = bounded(0, 0)
    """passes over the solutions (0: no SFT start)"""
    lr: float = bounded(2e-5, 0, open_low=True)
    """learning rate, decaying linearly to 0"""


# Saved in the hyper-parameters of a checkpoint, which Lightning and flowkit load with weights_only.
torch.serialization.add_safe_globals([OptimOptions, FlowPretrainOptions, ValidationOptions, SFTOptions,
                                      EpisodeOptions])

# PolicyModule's groups by key, in the order of its signature (and of the option reference's tables).
GROUPS: dict[str, type] = {
    "sampling": SamplingOptions, "advantage": AdvantageOptions, "loss": LossOptions, "update": UpdateOptions,
    "optim": OptimOptions, "controls": SamplingControls, "rollout": RolloutOptions,
    "flow_pretrain": FlowPretrainOptions,
    "validation": ValidationOptions, "sft": SFTOptions, "episodes": EpisodeOptions,
}

def check_options(owner: str, reward_model: TokenRewardModel | None, outcome_reward: str, grader_timeout: float,
                  peak_flops: float | None, lora: LoraSettings | None, groups: dict[str, OptionGroup]) -> None:
    """A one-line ConfigError for any of PolicyModule's options out of its range, before the backbone loads;
    ``groups`` holds every group by its key in :data:`GROUPS`."""
    check_range(owner, "grader_timeout", grader_timeout, 0, open_low=True)
    check_range(owner, "peak_flops", peak_flops, 0, open_low=True)
    if outcome_reward not in literal_values(OutcomeReward):
        raise ConfigError(f"{owner}.outcome_reward must be one of {', '.join(literal_values(OutcomeReward))}, got "
                          f"{outcome_reward!r}")
    for key, group in groups.items():
        if key not in ("controls", "rollout"):  # checked against the sampling group below
            group.check(f"{owner}.{key}")
    sampling, rollout, flow_pretrain = groups["sampling"], groups["rollout"], groups["flow_pretrain"]
    episodes = groups["episodes"]
    groups["controls"].check_within(f"{owner}.controls", episodes.max_tokens if episodes.environment
                                    else sampling.max_new_tokens)
    if episodes.environment:
        check_episodes(owner, episodes, outcome_reward, rollout)
    if groups["controls"].dynamic_sampling_max_draws is not None and sampling.num_samples < 2:
        raise ConfigError(f"{owner}.controls.dynamic_sampling_max_draws keeps the groups whose outcomes differ, which "
                          f"a group of {owner}.sampling.num_samples 1 never has: use num_samples >= 2, or "
                          "dynamic_sampling_max_draws null")
    rollout.check_group_size(f"{owner}.rollout", sampling.num_samples)
    registry_entry(ROLLOUT_ENGINES, rollout.engine).check()
    if rollout.server_lora_push == "adapter" and lora is None:
        raise ConfigError(f"{owner}.rollout.server_lora_push 'adapter' pushes a LoRA policy's adapters alone and needs "
                          f"{owner}.lora; without LoRA use rollout.server_lora_push: merged")
    if flow_pretrain.steps > 0 and not (isinstance(reward_model, PretrainsOnLatents) and reward_model.percentiles):
        missing = "percentiles" if isinstance(reward_model, PretrainsOnLatents) else "pretrain_losses"
        raise ConfigError(f"{owner}.flow_pretrain.steps {flow_pretrain.steps} needs a reward_model with latents to "
                          f"pretrain (flowkit.rewards.PretrainsOnLatents, e.g. a FlowReward); "
                          f"{type(reward_model).__name__ if reward_model else None} has no {missing}; "
                          "set flow_pretrain.steps 0")


def check_episodes(owner: str, episodes: EpisodeOptions, outcome_reward: str, rollout: RolloutOptions) -> None:
    """Episodes take their outcome reward from the environment (plus ``reward_functions``) and run ahead of training
    (``rollout.max_staleness`` ≥ 1) on the ``server`` engine only: a colocated engine generates on the weights it
    trains, so nothing can run while they train."""
    if outcome_reward != "none":
        raise ConfigError(f"{owner}.episodes rewards an episode with its environment's reward (and reward_functions "
                          f"over the final answer), not the math grader: set {owner}.outcome_reward none, got "
                          f"{outcome_reward!r}")
    if rollout.max_staleness and rollout.engine != "server":
        raise ConfigError(f"{owner}.rollout.max_staleness {rollout.max_staleness} runs episodes ahead of training on "
                          f"rollout.engine server only, not {rollout.engine!r}: use engine server, or max_staleness 0")


_RENAMED = {
    "advantage": "advantage.estimator", "entropy_advantage_alpha": "advantage.entropy_alpha",
    "entropy_advantage_kappa": "advantage.entropy_kappa", "rollout_engine": "rollout.engine",
    "rollout_batch_size": "rollout.batch_size", "val_num_samples": "validation.num_samples",
    "val_temperature": "validation.temperature", "sft_epochs": "sft.epochs", "sft_lr": "sft.lr",
    "dynamic_sampling": "controls.dynamic_sampling_max_draws",
    "overlong_buffer": "controls.overlong_buffer_length and controls.overlong_penalty",
    **{f"flow_pretrain_{name}": f"flow_pretrain.{name}"
       for name in ("steps", "batch_size", "cache_latents", "lr_decay")},
    **{f"rollout_server_{name}": f"rollout.server_{name}" for name in ("url", "timeout", "sync_every", "bucket_mb")},
}


# Each option of the old flat form (``model.init_args.temperature``) → its key now (``sampling.temperature``): a
# group's field of the same name (the first group's: ``lr`` is ``optim.lr``), or its new name.
MOVED_OPTIONS: dict[str, str] = {**moved_options(GROUPS), **_RENAMED}


def option_tables() -> str:
    """The option reference's tables (docs/reference/options.md): one per group, generated from the declarations;
    then the FlowReward's (:func:`~flowkit.rewards.flow.options.reference_tables`)."""
    return "\n\n".join([*(f"**`{key}`** — {markdown(' '.join((group.__doc__ or '').split()))}\n\n"
                          f"{options_table(group, key)}" for key, group in GROUPS.items()), reference_tables()])
