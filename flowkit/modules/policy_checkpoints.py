"""What :class:`~flowkit.modules.PolicyModule` writes into a checkpoint and checks before resuming one."""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import Any

from flowkit.errors import ConfigError
from flowkit.modules.policy_options import OptimOptions

log = logging.getLogger(__name__)

REWARD_MODEL_KEY = "reward_model_settings"  # in a checkpoint: reward_model_settings()
# Reward-model settings that a checkpoint's reward state is only valid for (shapes, which layers are tapped, the field's
# conditioning), by their attribute paths, recorded under their last name; the others (eta, beta, kappa, timesteps,
# ...) apply on resume as the config gives them.
RESUME_FIXED_REWARD_SETTINGS = ("percentiles", "network.depth", "network.width", "latents.condition")
# Reward-model classes recorded by earlier checkpoints under another module: the same class now.
MOVED_REWARD_CLASSES = {"flowkit.rewards.flow_reward.FlowReward": "flowkit.rewards.flow.reward.FlowReward"}


def reward_model_settings(model: Any) -> dict[str, Any]:
    """What a checkpoint's reward-model state means: its class and the settings that shape or place it."""
    settings: dict[str, Any] = {"class": None if model is None else f"{type(model).__module__}.{type(model).__qualname__}"}
    for path in RESUME_FIXED_REWARD_SETTINGS:
        try:
            value = attrgetter(path)(model)
        except AttributeError:  # a reward model without the setting
            continue
        settings[path.rpartition(".")[2]] = list(value) if isinstance(value, tuple) else value
    return settings


def check_resume(checkpoint: dict[str, Any], path: str, backbone: str, reward_model: Any,
                 own_state: dict[str, Any], pretrain_steps: int) -> None:
    """Before any work of a resume from ``checkpoint`` (read by the CLI from ``path``): refuse, in one
    :class:`~flowkit.errors.ConfigError` naming the setting and both values, a config whose model (``backbone``,
    ``reward_model``, its ``own_state`` dict) the checkpoint's state does not fit — another backbone, reward-model
    class (e.g. a GRPO checkpoint into an RLFR config), its percentiles, depth, width or condition, or any parameter's
    shape (LoRA, value head, KL reference). Every other setting applies on resume as the config gives it (the learning
    rates: :func:`apply_configured_lr`); a changed ``flow_pretrain.steps`` (``pretrain_steps``) gets a note (the
    pretraining ran before the checkpoint)."""
    def refuse(setting: str, saved: Any, current: Any) -> None:
        raise ConfigError(f"cannot resume {path}: {setting} is {saved!r} there, {current!r} in this config; resume "
                          "with the settings it was trained with, or start a new run with "
                          "--trainer.default_root_dir runs/NEW_NAME")

    saved_hparams = checkpoint.get("hyper_parameters") or {}
    if "backbone" in saved_hparams and saved_hparams["backbone"] != backbone:
        refuse("backbone", saved_hparams["backbone"], backbone)
    state = checkpoint.get("state_dict")  # absent from a DeepSpeed checkpoint's client state
    recorded = checkpoint.get(REWARD_MODEL_KEY)
    if recorded is not None and recorded["class"] in MOVED_REWARD_CLASSES:  # saved before the class moved
        recorded = {**recorded, "class": MOVED_REWARD_CLASSES[recorded["class"]]}
    if recorded is None and state is not None:  # checkpoints written before the settings were recorded
        recorded = {"class": "a reward model" if any(k.startswith("reward_model.") for k in state) else None}
    current = reward_model_settings(reward_model)
    if recorded is not None:
        if (recorded["class"] is None) != (current["class"] is None) or (
                recorded["class"] != "a reward model" and recorded["class"] != current["class"]):
            refuse("reward_model", recorded["class"] or "none", current["class"] or "none")
        for name in (path.rpartition(".")[2] for path in RESUME_FIXED_REWARD_SETTINGS):
            if name in recorded and recorded[name] != current.get(name):
                refuse(f"reward_model.{name}", recorded[name], current.get(name))
    if state is not None:
        for name, tensor in own_state.items():
            if name not in state:
                refuse(f"parameter {name}", "absent", list(tensor.shape) if hasattr(tensor, "shape") else "present")
            if hasattr(tensor, "shape") and hasattr(state[name], "shape") and state[name].shape != tensor.shape:
                refuse(f"the shape of {name}", list(state[name].shape), list(tensor.shape))
        extra = next((name for name in state if name not in own_state), None)
        if extra is not None:
            refuse(f"parameter {extra}", "present", "absent")
    saved_pretrain = saved_hparams.get("flow_pretrain")  # the CLI saves a group as its dict, Python as itself
    pretrained = (saved_pretrain.get("steps") if isinstance(saved_pretrain, dict)
                  else getattr(saved_pretrain, "steps", None))
    if pretrained is not None and pretrained != pretrain_steps:
        log.warning("flow_pretrain.steps %d (was %d) does not apply on resume: the checkpoint holds the flow its "
                    "pretraining and training made", pretrain_steps, pretrained)


def apply_configured_lr(param_groups: list[dict[str, Any]], optim: OptimOptions, step: int) -> None:
    """The config's learning rates (those of optimizer step ``step``, the last one taken) apply on resume too (the
    optimizer's restored state carries the checkpoint's)."""
    configured = {"policy": optim.lr, "value": optim.lr, "reward": optim.flow_lr} | optim.warmup_rates(step)
    for group in param_groups:
        lr = configured.get(group.get("name"))
        if lr is not None and group["lr"] != lr:
            log.warning("resume: the %s group's learning rate %g → %g (this config's)", group["name"], group["lr"], lr)
            group["lr"] = lr
