"""The optimizer of :class:`~flowkit.modules.PolicyModule` and the offline start of its reward model."""

from __future__ import annotations

import torch

from flowkit.checkpointing.resume import resume_checkpoint
from flowkit.modules.pretraining import pretrain_flow_reward
from flowkit.rewards.base import PretrainsOnLatents


class OptimizerHooks:
    """``configure_optimizers`` and the flow pretraining of a LightningModule with ``policy``, ``value_head``,
    ``reward_model``, ``tap``, ``tokenizer``, ``optim`` and ``flow_pretrain``."""

    def configure_optimizers(self):
        """One AdamW over the parameter groups ``policy`` (lr), ``value`` (the value head, lr) and ``reward`` (the
        reward model, flow_lr): DeepSpeed takes one optimizer. A fresh fit first runs the offline flow pretraining
        (:meth:`_pretrain_unless_resuming`)."""
        self._pretrain_unless_resuming()
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": self.optim.lr, "name": "policy"}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": self.optim.lr, "name": "value"})
        if self.reward_model is not None and any(True for _ in self.reward_model.parameters()):
            groups.append({"params": list(self.reward_model.parameters()), "lr": self.optim.flow_lr, "name": "reward"})
        return torch.optim.AdamW(groups, weight_decay=0.0)

    def pretrain_reward_model(self, device: torch.device | None = None) -> None:
        """Offline start (RLFR §3.2): :func:`~flowkit.modules.pretraining.pretrain_flow_reward` with the policy frozen,
        ``flow_pretrain.steps`` steps at ``optim.flow_lr``, on ``device`` (default: where the policy is)."""
        options = self.flow_pretrain
        if not isinstance(self.reward_model, PretrainsOnLatents) or self.tap is None:
            raise ValueError("flow_pretrain.steps > 0 needs a reward model with latents and pretrain_losses (FlowReward)")
        pretrain_flow_reward(self.trainer, self.policy, self.tokenizer, self.tap, self.reward_model, options.steps,
                             options.batch_size, self.optim.flow_lr, options.lr_decay, options.cache_latents, device)

    def _pretrain_unless_resuming(self) -> None:
        """The offline start, run where every strategy calls :meth:`configure_optimizers`: inside ``strategy.setup``,
        after DDP / single-device strategies placed the model on its device and before DeepSpeed copies the weights
        into its optimizer partitions (which a later pretraining would not reach). On the strategy's root device;
        skipped when the fit resumes a checkpoint, which holds the reward model's pretrained and trained weights."""
        if self.flow_pretrain.steps == 0 or self._trainer is None or resume_checkpoint(self.trainer) is not None:
            return
        self.pretrain_reward_model(self.trainer.strategy.root_device)
