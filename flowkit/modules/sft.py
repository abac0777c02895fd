"""Supervised fine-tuning before RL (the TPL paper's SFT start on preferred explanations, seed 000 App. F / Table 12;
or expert solutions for RLFR): the policy learns the training records' ``solution`` completions, then RL starts from
it and — with a KL — PPO's reference is this post-SFT policy (TRL's reference is the SFT model)."""

from __future__ import annotations

import lightning as L
import torch

from flowkit.errors import ConfigError
from flowkit.llm.packing import encode_pairs
from flowkit.seeding import run_seed
from flowkit.step.finite import raise_if_nonfinite


def supervised_start(module: L.LightningModule, epochs: int, lr: float, seed: int | None = None) -> list[float]:
    """``epochs`` passes over the (prompt, solution) pairs of the datamodule's training records, in global batches of
    ``data.batch_size`` (each rank takes its share of every batch), micro-batched by the module's
    ``update.micro_batch_size``; the loss is the token mean of the solutions' negative log-likelihood
    (:meth:`~flowkit.step.Actor.sft_loss`), the policy group's learning rate decays linearly from ``lr`` to 0 over
    the steps, and only the policy moves. Every rank takes the same steps (under DDP / ZeRO each backward and step
    is a collective). Returns the per-step losses (also logged as ``sft/loss``)."""
    trainer, data = module.trainer, module.trainer.datamodule
    rows = [r for r in data.train_records if "solution" in r]
    if not rows:
        raise ConfigError(f"sft.epochs {epochs} needs training records with a solution ({data.solution_key!r}); "
                          "none has one")
    world, rank = trainer.world_size, trainer.global_rank
    per_rank = data.per_rank_batch_size(world)
    generator = torch.Generator().manual_seed(run_seed(seed))
    batches = [order for _ in range(epochs) for order in torch.randperm(len(rows), generator=generator).split(data.batch_size)]
    batches = [b for b in batches if len(b) == data.batch_size]  # whole batches: every rank runs as many micro-batches
    rates = iter(lr * (1 - k / len(batches)) for k in range(len(batches)))  # one per step, linear decay to 0
    optimizer = module.step_optimizer(lambda step: {"policy": next(rates)})
    policy_group = next(g for g in module.optimizers().param_groups if g["name"] == "policy")
    rl_lr, losses = policy_group["lr"], []
    try:
        for step, order in enumerate(batches):
            share = [rows[i] for i in order[rank::world][:per_rank].tolist()]
            batch = encode_pairs(module.tokenizer, [r["prompt"] for r in share], [r["solution"] for r in share])
            batch = batch.to(module.device)
            tokens = batch.response_mask.sum().clamp(min=1)
            loss = 0.0
            for micro_rows in torch.arange(batch.batch_size).split(module.update.micro_batch_size or batch.batch_size):
                part = module.actor.sft_loss(batch.select(micro_rows).trimmed(), tokens)
                optimizer.backward(part)
                loss += float(part.detach())
            raise_if_nonfinite(optimizer.nonfinite({"policy"}))
            optimizer.step({"policy"})
            losses.append(loss)
            if module.logger is not None and trainer.is_global_zero:
                module.logger.log_metrics({"sft/loss": loss}, step=step)
    finally:
        policy_group["lr"] = rl_lr
    return losses

