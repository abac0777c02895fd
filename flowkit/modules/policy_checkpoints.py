"""What :class:`~flowkit.modules.PolicyModule` writes into a checkpoint and checks before resuming one."""

from __future__ import annotations

import logging
from typing import Any

from flowkit.errors import ConfigError

log = logging.getLogger(__name__)

REWARD_MODEL_KEY = "reward_model_settings"  # in a checkpoint: CheckpointHooks._reward_model_settings()
# Reward-model settings that a checkpoint's reward state is only valid for (shapes, which layers are tapped, the field's
# conditioning); the others (eta, beta, kappa, timesteps, ...) apply on resume as the config gives them.
RESUME_FIXED_REWARD_SETTINGS = ("percentiles", "depth", "width", "condition")


class CheckpointHooks:
    """The checkpoint hooks of a LightningModule with ``reward_model``, ``optim``, ``flow_pretrain``,
    ``guard`` (:class:`~flowkit.modules.step_guard.StepGuard`) and ``_check_finite_weights``."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._check_finite_weights("when saving a checkpoint")  # never a checkpoint of non-finite weights
        checkpoint["skipped_steps"] = self.guard.skipped_steps  # a resumed run keeps counting
        checkpoint[REWARD_MODEL_KEY] = self._reward_model_settings()

    def _reward_model_settings(self) -> dict[str, Any]:
        """What a checkpoint's reward-model state means: its class and the settings that shape or place it."""
        model = self.reward_model
        settings: dict[str, Any] = {"class": None if model is None else f"{type(model).__module__}.{type(model).__qualname__}"}
        for name in RESUME_FIXED_REWARD_SETTINGS:
            if hasattr(model, name):
                value = getattr(model, name)
                settings[name] = list(value) if isinstance(value, tuple) else value
        return settings

    def check_resume(self, checkpoint: dict[str, Any], path: str) -> None:
        """Before any work of a resume from ``checkpoint`` (read by the CLI from ``path``): refuse, in one
        :class:`~flowkit.errors.ConfigError` naming the setting and both values, a config whose model the checkpoint's
        state does not fit — another backbone, reward-model class (e.g. a GRPO checkpoint into an RLFR config), its
        percentiles, depth, width or condition, or any parameter's shape (LoRA, value head, KL reference). Every other
        setting applies on resume as the config gives it (the learning rates: :meth:`on_train_start`); a changed
        ``flow_pretrain.steps`` gets a note (the pretraining ran before the checkpoint)."""
        def refuse(setting: str, saved: Any, current: Any) -> None:
            raise ConfigError(f"cannot resume {path}: {setting} is {saved!r} there, {current!r} in this config; resume "
                              "with the settings it was trained with, or start a new run with "
                              "--trainer.default_root_dir runs/NEW_NAME")

        saved_hparams = checkpoint.get("hyper_parameters") or {}
        if "backbone" in saved_hparams and saved_hparams["backbone"] != self.hparams.backbone:
            refuse("backbone", saved_hparams["backbone"], self.hparams.backbone)
        state = checkpoint.get("state_dict")  # absent from a DeepSpeed checkpoint's client state
        recorded = checkpoint.get(REWARD_MODEL_KEY)
        if recorded is None and state is not None:  # checkpoints written before the settings were recorded
            recorded = {"class": "a reward model" if any(k.startswith("reward_model.") for k in state) else None}
        current = self._reward_model_settings()
        if recorded is not None:
            if (recorded["class"] is None) != (current["class"] is None) or (
                    recorded["class"] != "a reward model" and recorded["class"] != current["class"]):
                refuse("reward_model", recorded["class"] or "none", current["class"] or "none")
            for name in RESUME_FIXED_REWARD_SETTINGS:
                if name in recorded and recorded[name] != current.get(name):
                    refuse(f"reward_model.{name}", recorded[name], current.get(name))
        if state is not None:
            own = self.state_dict()
            for name, tensor in own.items():
                if name not in state:
                    refuse(f"parameter {name}", "absent", list(tensor.shape) if hasattr(tensor, "shape") else "present")
                if hasattr(tensor, "shape") and hasattr(state[name], "shape") and state[name].shape != tensor.shape:
                    refuse(f"the shape of {name}", list(state[name].shape), list(tensor.shape))
            extra = next((name for name in state if name not in own), None)
            if extra is not None:
                refuse(f"parameter {extra}", "present", "absent")
        saved_pretrain = saved_hparams.get("flow_pretrain")  # the CLI saves a group as its dict, Python as itself
        pretrained = (saved_pretrain.get("steps") if isinstance(saved_pretrain, dict)
                      else getattr(saved_pretrain, "steps", None))
        if pretrained is not None and pretrained != self.flow_pretrain.steps:
            log.warning("flow_pretrain.steps %d (was %d) does not apply on resume: the checkpoint holds the flow its "
                        "pretraining and training made", self.flow_pretrain.steps, pretrained)

    def _apply_configured_lr(self) -> None:
        """The config's learning rates apply on resume too (the optimizer's restored state carries the checkpoint's)."""
        configured = {"policy": self.optim.lr, "value": self.optim.lr, "reward": self.optim.flow_lr}
        for group in self.optimizers().optimizer.param_groups:
            lr = configured.get(group.get("name"))
            if lr is not None and group["lr"] != lr:
                log.warning("resume: the %s group's learning rate %g → %g (this config's)", group["name"], group["lr"], lr)
                group["lr"] = lr

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.guard.skipped_steps = int(checkpoint.get("skipped_steps", 0))
