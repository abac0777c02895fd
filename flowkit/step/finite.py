"""Finite state: a non-finite quantity (logits, rewards, advantages, a loss, the gradients of a parameter group) skips
the RL step before the optimizer moves anything — on every rank alike, decided by one collective per decision."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.distributed import all_reduce_int


class NonFiniteStep(Exception):
    """Raised (on every rank alike) when logits, rewards, advantages, a loss or gradients are not finite; the caller
    skips the step or fails."""

    def __init__(self, what: list[str]):
        super().__init__(", ".join(what))
        self.what = what


def raise_if_nonfinite(bad: list[str]) -> None:
    """Ranks skip a step together: one that skipped alone would leave the others waiting in a collective (ZeRO's
    gradient reduction, the next forward's parameter gathering). Every rank decides at the same points of the step
    (one all-reduce each): after the scoring pass, and before each optimizer step."""
    if all_reduce_int(int(bool(bad)), ReduceOp.MAX):
        raise NonFiniteStep(bad or ["values on another rank"])


class NonFiniteCheck:
    """Which named quantities (log-probs, token rewards, the policy or flow loss, ...) were not finite. The flags stay
    on the values' device until :meth:`nonfinite` reads them once, at the decision (no device sync per micro-batch);
    names come back in the order they were first noted."""

    def __init__(self):
        self._finite: dict[str, Tensor] = {}

    def note(self, name: str, values: Tensor, where: Tensor | None = None) -> None:
        """``values`` (only at ``where``, a bool mask, when given) count against ``name``."""
        values = values.detach()
        finite = torch.isfinite(values if where is None else values[where]).all()
        self._finite[name] = finite if name not in self._finite else self._finite[name] & finite

    def nonfinite(self) -> list[str]:
        return [name for name, finite in self._finite.items() if not bool(finite)]
