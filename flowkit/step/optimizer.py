"""The optimizer object an update drives: ``backward(loss)``, ``nonfinite(groups)``, ``step(groups)``.

Parameters are in named groups (``policy``, ``value``, ``reward``): one optimizer over all of them (DeepSpeed takes
one), of which a step moves only some (the reward model only on the minibatch that carried its loss).
:class:`TorchOptimizer` is the plain-PyTorch implementation (one process or gloo/NCCL ranks that average their own
gradients); :class:`~flowkit.modules.policy_optimizer.LightningOptimizer` is Lightning's manual optimization
(DDP, DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

import torch
from torch import Tensor

# An optimizer parameter group → what the user calls it.
GROUP_NAMES = {"policy": "policy", "value": "value head", "reward": "flow"}


class StepOptimizer(Protocol):
    """What :meth:`~flowkit.step.PolicyUpdate.train_on` needs of an optimizer."""

    def backward(self, loss: Tensor) -> None:
        """One of the step's several backward passes (gradients accumulate until :meth:`step`)."""

    def nonfinite(self, groups: Collection[str]) -> list[str]:
        """After a minibatch's backward passes: ``"<group> gradients"`` for each group in ``groups`` whose gradients
        on this rank hold a non-finite value (their mean over ranks is non-finite exactly when one rank's is: the
        caller decides over ranks, :func:`~flowkit.step.finite.raise_if_nonfinite`)."""

    def step(self, groups: Collection[str]) -> None:
        """Average the gradients over ranks where the backward did not, clip, move only the parameter groups in
        ``groups``, zero every gradient."""


def nonfinite_groups(param_groups: list[dict[str, Any]], groups: Collection[str], what: str) -> list[str]:
    """``"<group> <what>"`` for each of an optimizer's ``param_groups`` named in ``groups`` whose gradients
    (``what="gradients"``) or weights (``"weights"``) hold a non-finite value; a ZeRO-3 parameter is checked through
    this rank's shard. A parameter without a gradient (DeepSpeed keeps them in its own partitions) is not checked."""
    bad = []
    for group in param_groups:
        if group.get("name") not in groups:
            continue
        if what == "gradients":
            tensors = [p.grad for p in group["params"] if p.grad is not None]
        else:
            tensors = [getattr(p, "ds_tensor", p) for p in group["params"]]
        checks = [torch.isfinite(t).all() for t in tensors if t.numel()]
        if checks and not bool(torch.stack(checks).all()):
            bad.append(f"{GROUP_NAMES.get(group['name'], group['name'])} {what}")
    return bad


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


def average_over_ranks(params: list[torch.nn.Parameter]) -> None:
    """Replace every gradient of ``params`` by its mean over the ranks (one all-reduce of them all, flattened). Ranks
    agree on which parameters have a gradient (a missing one counts as zeros where another rank has one)."""
    device = params[0].device if params else torch.device("cpu")
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)
    torch.distributed.all_reduce(present, op=torch.distributed.ReduceOp.MAX)
    synced = [p for p, has in zip(params, present.tolist(), strict=True) if has]
    for p in synced:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in synced]) if synced else torch.zeros(0, device=device)
    torch.distributed.all_reduce(flat)
    flat /= torch.distributed.get_world_size()
    offset = 0
    for p in synced:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


class TorchOptimizer:
    """:class:`StepOptimizer` over a plain ``torch.optim`` optimizer with named parameter groups. Under
    ``torch.distributed`` every gradient is averaged over the ranks before it is checked (the ranks' models are
    replicas that each backpropagated their own rows)."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None):
        self.optimizer, self.max_grad_norm = optimizer, max_grad_norm

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def nonfinite(self, groups: Collection[str]) -> list[str]:
        return nonfinite_groups(self.optimizer.param_groups, groups, "gradients")

    def step(self, groups: Collection[str]) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            average_over_ranks([p for group in self.optimizer.param_groups for p in group["params"]])
        if self.max_grad_norm is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        step_groups(self.optimizer, groups)
        self.optimizer.zero_grad()
