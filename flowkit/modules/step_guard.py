"""The finite-state guard of :class:`~flowkit.modules.PolicyModule`: no step, checkpoint or export from non-finite
values. One object owns the policy (``optim.nonfinite``) and its state (how many steps were skipped)."""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

import lightning as L
from torch.distributed import ReduceOp

from flowkit.distributed import all_reduce_int
from flowkit.errors import NonFiniteTraining
from flowkit.modules.policy_options import OptimOptions
from flowkit.step.optimizer import GROUP_NAMES, nonfinite_groups

log = logging.getLogger(__name__)


class StepGuard:
    """Decides what a non-finite RL step does (skip or fail; stop after ``optim.max_consecutive_skips`` skips in a
    row) and stops the run when weights are not finite.

    Attributes:
        skipped_steps: RL steps skipped so far (a checkpoint keeps it: a resumed run keeps counting).
        consecutive_skips: RL steps skipped since the last one that trained.
    """

    def __init__(self, options: OptimOptions):
        self.options = options
        self.skipped_steps = 0
        self.consecutive_skips = 0

    def trained(self) -> None:
        """An RL step trained: the run of skipped steps ends."""
        self.consecutive_skips = 0

    def skip(self, trainer: L.Trainer, what: list[str], step: int) -> None:
        """Non-finite ``what`` at RL step ``step`` (counted from 1): fail (``optim.nonfinite: fail``, or the
        ``max_consecutive_skips``-th skip in a row), else count the skip and warn. The caller drops the step's
        gradients."""
        message = f"non-finite {', '.join(what)} at step {step}"
        if self.options.nonfinite == "fail":
            raise NonFiniteTraining(message)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        limit = self.options.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
            self.stop(trainer, f"{self.consecutive_skips} RL steps in a row were skipped (optim.max_consecutive_skips "
                               f"{limit}; the last one: {message}): the weights or the reward model are probably "
                               "broken")
        log.warning("skipping RL step %d: non-finite %s (%d skipped so far)", step, ", ".join(what), self.skipped_steps)

    def check_weights(self, trainer: L.Trainer, param_groups: list[dict[str, Any]], problem: str,
                      groups: Collection[str] = tuple(GROUP_NAMES)) -> None:
        """Stop (:meth:`stop`) when any rank's weights of ``groups`` hold a non-finite value (one collective);
        ``problem`` says when, with ``{}`` where the broken groups are named."""
        bad = nonfinite_groups(param_groups, groups, "weights")
        if all_reduce_int(int(bool(bad)), ReduceOp.MAX):
            self.stop(trainer, problem.format(", ".join(bad) or "weights on another rank"))

    @staticmethod
    def stop(trainer: L.Trainer, problem: str) -> None:
        """Raise :class:`~flowkit.errors.NonFiniteTraining` naming the last good checkpoint (``--ckpt_path last``
        resumes it: no checkpoint is written from non-finite weights)."""
        callback = trainer.checkpoint_callback
        saved = [path for path in (getattr(callback, "last_model_path", ""), trainer.ckpt_path)
                 if path and Path(path).exists()]
        last_good = (f"the last good checkpoint is {saved[0]}: resume it with --ckpt_path {saved[0]} once the cause is "
                     "fixed" if saved else "no checkpoint was saved before it: start again once the cause is fixed")
        raise NonFiniteTraining(f"{problem}; nothing was saved from them, {last_good}")
