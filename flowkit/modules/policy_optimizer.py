"""The :class:`~flowkit.step.StepOptimizer` of Lightning's manual optimization (DDP, DeepSpeed, one device)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import lightning as L
from torch import Tensor

from flowkit.modules.step_guard import StepGuard
from flowkit.step.optimizer import nonfinite_groups, step_groups
from flowkit.strategies import average_gradients, manual_backward


class LightningOptimizer:
    """The one optimizer of a LightningModule with named parameter groups (``policy``, ``value``, ``reward``),
    driven by hand: :func:`~flowkit.strategies.manual_backward` for each backward pass (DeepSpeed's per-backward
    state reset, DDP's reduction deferred), and at the step the DDP mean over ranks, clipping (DeepSpeed clips inside
    its step: ``max_grad_norm`` is its ``gradient_clipping``), the named groups' step (at the rates
    ``learning_rates(step)`` gives, the step counted from 1; a group it leaves out keeps its own) and zeroed
    gradients. Weights that are not finite after a step stop the run (``guard``) before anything is saved from them."""

    def __init__(self, module: L.LightningModule, guard: StepGuard, max_grad_norm: float | None,
                 learning_rates: Callable[[int], dict[str, float]]):
        self.module, self.guard, self.max_grad_norm = module, guard, max_grad_norm
        self.learning_rates = learning_rates

    def backward(self, loss: Tensor) -> None:
        manual_backward(self.module, loss)

    def nonfinite(self, groups: Collection[str]) -> list[str]:
        return nonfinite_groups(self.module.optimizers().param_groups, groups, "gradients")

    def step(self, groups: Collection[str]) -> None:
        optimizer = self.module.optimizers()
        average_gradients(self.module)
        if self.max_grad_norm is not None:
            self.module.clip_gradients(optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm")
        step = self.module.global_step + 1  # the step in progress, counted from 1 as in metrics.csv and the bar
        rates = self.learning_rates(step)
        for group in optimizer.param_groups:
            group["lr"] = rates.get(group.get("name"), group["lr"])
        step_groups(optimizer, groups)
        optimizer.zero_grad()
        self.guard.check_weights(self.module.trainer, optimizer.param_groups,
                                 f"the optimizer step of RL step {step} made the {{}} non-finite (a learning rate too "
                                 "high?)", groups)
