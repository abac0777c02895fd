"""Optimizer helpers shared by the LightningModules that keep several parameter groups in ONE optimizer."""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from flowkit.errors import ConfigError


def require_fp32_master_weights(owner: str, strategy: Strategy, module: torch.nn.Module, lr: float) -> None:
    """A one-line :class:`ConfigError` when ``module`` trains bf16/fp16 parameters under a strategy that keeps no fp32
    master copy of them, i.e. anything but DeepSpeed (whose ZeRO optimizers step fp32 partitions).

    torch's AdamW updates such a weight in its own dtype: a bf16 weight w moves only by steps above ~|w|·2⁻⁹, and at
    lr 1e-6 an update of ~lr rounds to nothing — training silently does not happen. Lightning's ``bf16-mixed`` already
    means fp32 weights with bf16 compute (autocast), which also accumulates gradients in fp32; that is the setting
    to use off DeepSpeed.
    """
    if isinstance(strategy, DeepSpeedStrategy):
        return
    low = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()
                  if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)})
    if low:
        raise ConfigError(
            f"{owner}.dtype {'/'.join(low)} trains {'/'.join(low)} weights with no fp32 master copy under "
            f"{type(strategy).__name__} (AdamW updates at lr {lr:g} fall below their resolution and are lost): use "
            "dtype float32 with trainer.precision bf16-mixed (fp32 weights, bf16 compute) or a DeepSpeed strategy"
        )


LrDecay = Literal["cosine", "constant"]
LR_DECAYS: tuple[str, ...] = get_args(LrDecay)


def flow_pretraining_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float = 0.1,
                              decay: LrDecay = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 over ⌈warmup_ratio·steps⌉ steps, then ``cosine`` decay to 0 at ``total_steps`` — the
    official RLFR offline pretraining (LLaMA-Factory ``lr_scheduler_type: cosine``, ``warmup_ratio: 0.1``: the HF
    Trainer's schedule) — or a ``constant`` learning rate after the warmup."""
    warmup = math.ceil(warmup_ratio * total_steps)
    if decay == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    if decay == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    raise ValueError(f"learning-rate decay must be cosine or constant, got {decay!r}")
