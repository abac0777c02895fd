"""Step statistics accumulated over micro-batches and minibatches."""

from __future__ import annotations

import torch
from torch import Tensor


class StepStats:
    """``add`` sums a micro-batch's share of a minibatch value (the loss); ``add_weighted`` averages per-token means
    over micro-batches by token count; ``add_max`` keeps the largest value of the step; ``close_minibatch`` ends a
    minibatch; ``means`` averages over minibatches (and reports the maxima)."""

    def __init__(self):
        self.current: dict[str, Tensor] = {}
        self.weighted: dict[str, tuple[Tensor, float]] = {}
        self.done: dict[str, list[Tensor]] = {}
        self.maxima: dict[str, Tensor] = {}

    def add(self, name: str, value: Tensor) -> None:
        self.current[name] = self.current.get(name, 0.0) + value

    def add_weighted(self, name: str, value: Tensor, weight: float) -> None:
        total, count = self.weighted.get(name, (0.0, 0.0))
        self.weighted[name] = (total + value * weight, count + weight)

    def add_max(self, name: str, value: Tensor) -> None:
        self.maxima[name] = torch.maximum(self.maxima[name], value) if name in self.maxima else value

    def close_minibatch(self) -> None:
        for name, value in self.current.items():
            self.done.setdefault(name, []).append(torch.as_tensor(value))
        for name, (total, count) in self.weighted.items():
            self.done.setdefault(name, []).append(torch.as_tensor(total / max(count, 1.0)))
        self.current, self.weighted = {}, {}

    def means(self) -> dict[str, Tensor]:
        return {**{name: torch.stack(values).mean() for name, values in self.done.items()}, **self.maxima}
