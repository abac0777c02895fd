"""`FlowRewardModule`: offline flow pretraining on expert solutions with the backbone frozen (RLFR §3.2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch

from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm.rollout import expert_latents
from flowkit.modules.optim import LR_DECAYS, LrDecay, flow_pretraining_schedule
from flowkit.rewards.flow_reward import FlowReward
from flowkit.strategies import accumulate_until_step, manual_backward


class FlowRewardModule(L.LightningModule):
    """Pretrain a :class:`FlowReward`'s velocity field on latents of expert (prompt, solution) pairs.

    The frozen backbone runs in inference mode with a :class:`LatentTap`; only the field trains (eq. 4,
    logit-normal t), one backward per piece of at most ``reward_model.max_rows_per_piece`` field rows, then one
    optimizer step, so memory does not grow with the solutions' length. ``export_artifacts`` writes the field as
    safetensors for ``FlowReward(weights=...)``.

    Args:
        backbone: hub id, local dir or ``bundled:NAME`` of the policy whose latents are modelled.
        reward_model: the FlowReward whose field is trained (its percentiles, depth, condition).
        lr: peak learning rate (paper: 1e-4); warmup_ratio: linear warmup fraction of ``max_steps``;
        lr_decay: after the warmup, ``cosine`` to 0 (the official offline pretraining) or ``constant``
            (:func:`~flowkit.modules.optim.flow_pretraining_schedule`).
        dtype, trust_remote_code: backbone loading.
    """

    def __init__(
        self,
        backbone: str = "bundled:tiny_adder",
        reward_model: FlowReward | None = None,
        lr: float = 1e-4,
        warmup_ratio: float = 0.1,
        lr_decay: LrDecay = "cosine",
        dtype: str = "float32",
        trust_remote_code: bool = False,
    ):
        super().__init__()
        if lr_decay not in LR_DECAYS:
            raise ConfigError(f"FlowRewardModule.lr_decay must be cosine or constant, got {lr_decay!r}")
        self.save_hyperparameters(ignore=["reward_model"])
        self.backbone, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.backbone.requires_grad_(False).eval()
        self.reward_model = reward_model or FlowReward()
        self.tap = LatentTap(self.backbone, self.reward_model.percentiles)
        self.reward_model.bind(self.backbone.config.hidden_size, self.tap.layer_positions,
                               getattr(self.backbone.config, "rms_norm_eps", None))
        self.generator = torch.Generator()
        self.automatic_optimization = False  # several backward passes (pieces) per step

    def setup(self, stage: str) -> None:
        if stage == "fit":
            accumulate_until_step(self.trainer, None)

    def on_fit_start(self) -> None:
        self.generator.manual_seed(torch.initial_seed() % 2**31)

    def training_step(self, rows: dict[str, Any], batch_idx: int) -> None:
        latents, mask = expert_latents(self.backbone, self.tokenizer, self.tap, rows["prompt"], rows["solution"],
                                       self.device)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = torch.zeros((), device=self.device)
        for piece in self.reward_model.pretrain_losses(latents, mask, self.generator):
            value = piece()
            manual_backward(self, value)
            loss += value.detach()
        optimizer.step()
        self.lr_schedulers().step()
        self.log("train/flow_loss", loss, prog_bar=True, batch_size=len(rows["prompt"]))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.reward_model.parameters(), lr=self.hparams.lr)
        total = max(1, self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches)
        schedule = flow_pretraining_schedule(optimizer, total, self.hparams.warmup_ratio, self.hparams.lr_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def export_artifacts(self, directory: str | Path) -> dict[str, Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "flow.safetensors"
        self.reward_model.save_field(path)
        return {"flow": path}
