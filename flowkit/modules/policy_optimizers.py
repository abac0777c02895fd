"""The optimizer of :class:`~flowkit.modules.PolicyModule` and the offline start of its reward model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from flowkit.checkpointing.resume import resume_checkpoint
from flowkit.llm.latent_tap import LatentTap
from flowkit.modules.policy_options import FlowPretrainOptions
from flowkit.modules.pretraining import pretrain_flow_reward
from flowkit.rewards.base import PretrainsOnLatents


def build_optimizer(policy: torch.nn.Module, value_head: torch.nn.Module | None, reward_model: torch.nn.Module | None,
                    lr: float, flow_lr: float) -> torch.optim.Optimizer:
    """One AdamW over the parameter groups ``policy`` (lr), ``value`` (the value head, lr) and ``reward`` (the
    reward model, flow_lr): DeepSpeed takes one optimizer."""
    groups = [{"params": [p for p in policy.parameters() if p.requires_grad], "lr": lr, "name": "policy"}]
    if value_head is not None:
        groups.append({"params": list(value_head.parameters()), "lr": lr, "name": "value"})
    if reward_model is not None and any(True for _ in reward_model.parameters()):
        groups.append({"params": list(reward_model.parameters()), "lr": flow_lr, "name": "reward"})
    return torch.optim.AdamW(groups, weight_decay=0.0)


def pretrain_unless_resuming(trainer: L.Trainer | None, pretrain: Callable[[torch.device], None], steps: int) -> None:
    """The offline start (``pretrain`` on a device), run where every strategy calls ``configure_optimizers``: inside
    ``strategy.setup``, after DDP / single-device strategies placed the model on its device and before DeepSpeed
    copies the weights into its optimizer partitions (which a later pretraining would not reach). On the strategy's
    root device; skipped when the fit resumes a checkpoint, which holds the reward model's pretrained and trained
    weights."""
    if steps == 0 or trainer is None or resume_checkpoint(trainer) is not None:
        return
    pretrain(trainer.strategy.root_device)


def pretrain_reward_model(trainer: L.Trainer, policy: torch.nn.Module, tokenizer: Any, tap: LatentTap | None,
                          reward_model: Any, options: FlowPretrainOptions, flow_lr: float,
                          device: torch.device | None = None) -> None:
    """Offline start (RLFR §3.2): :func:`~flowkit.modules.pretraining.pretrain_flow_reward` with the policy frozen,
    ``options.steps`` steps at ``flow_lr``, on ``device`` (default: where the policy is)."""
    if not isinstance(reward_model, PretrainsOnLatents) or tap is None:
        raise ValueError("flow_pretrain.steps > 0 needs a reward model with latents and pretrain_losses (FlowReward)")
    pretrain_flow_reward(trainer, policy, tokenizer, tap, reward_model, options.steps, options.batch_size, flow_lr,
                         options.lr_decay, options.cache_latents, device)
