"""Optimizer helpers shared by the LightningModules that keep several parameter groups in ONE optimizer."""

from __future__ import annotations

from collections.abc import Collection

import torch


def step_groups(optimizer: torch.optim.Optimizer, names: Collection[str]) -> None:
    """``optimizer.step()`` that moves only the parameter groups whose ``"name"`` is in ``names``.

    Plain Adam skips a group whose gradients are None. DeepSpeed steps every group's flat partition (a group
    without a loss this step gets zero or, under ZeRO-3, its last gradients), so Adam's momentum would keep
    moving it: the other groups run this step at lr 0.
    """
    others = [group for group in optimizer.param_groups if group["name"] not in names]
    lrs = [group["lr"] for group in others]
    for group in others:
        group["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(others, lrs, strict=True):
            group["lr"] = lr
