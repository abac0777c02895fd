"""The finite-state guard of :class:`~flowkit.modules.PolicyModule`: no step, checkpoint or export from non-finite
values."""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

from torch.distributed import ReduceOp

from flowkit.distributed import all_reduce_int
from flowkit.step.step import GROUP_NAMES, nonfinite_groups, raise_if_nonfinite
from flowkit.errors import NonFiniteTraining
from flowkit.modules.optim import step_groups
from flowkit.strategies import average_gradients

log = logging.getLogger(__name__)


class FiniteStateGuard:
    """The optimizer step and the ``optim.nonfinite`` policy of a LightningModule with ``optim`` (an
    :class:`~flowkit.modules.policy_options.OptimOptions`), ``reward_model``, ``skipped_steps`` and
    ``consecutive_skips``."""

    def step_optimizer(self, groups: Collection[str]) -> None:
        """Clip (DeepSpeed clips inside its step: ``max_grad_norm`` is its ``gradient_clipping``), move only the
        parameter groups in ``groups`` (:func:`~flowkit.modules.optim.step_groups`), zero the gradients.

        Finite state: non-finite gradients of a group skip the step (:class:`NonFiniteStep`, on every rank) before
        the clipping, whose one norm over all groups would turn every group's gradients into NaN; weights that are
        not finite after the step stop the run (:meth:`_stop_nonfinite`) before anything is saved from them."""
        optimizer = self.optimizers()
        average_gradients(self)
        raise_if_nonfinite(nonfinite_groups(optimizer.param_groups, groups, "gradients"))
        if self.optim.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.optim.max_grad_norm, gradient_clip_algorithm="norm")
        step = self.global_step + 1  # the step in progress, counted from 1 as in metrics.csv and the bar
        step_groups(optimizer, groups)
        optimizer.zero_grad()
        bad = nonfinite_groups(optimizer.param_groups, groups, "weights")
        if all_reduce_int(int(bool(bad)), ReduceOp.MAX):
            broken = ", ".join(bad) or "weights on another rank"
            self._stop_nonfinite(f"the optimizer step of RL step {step} made the {broken} non-finite (a learning rate "
                                 "too high?)")

    def _check_finite_weights(self, when: str) -> None:
        """Stop (:meth:`_stop_nonfinite`) when any rank's weights hold a non-finite value (a collective)."""
        optimizers = self.trainer.optimizers  # none when a checkpoint is saved outside fit
        param_groups = optimizers[0].param_groups if optimizers else self.configure_optimizers().param_groups
        bad = nonfinite_groups(param_groups, GROUP_NAMES, "weights")
        if all_reduce_int(int(bool(bad)), ReduceOp.MAX):
            self._stop_nonfinite(f"the {', '.join(bad) or 'weights on another rank'} are non-finite {when}")

    def _stop_nonfinite(self, problem: str) -> None:
        """Raise :class:`~flowkit.errors.NonFiniteTraining` naming the last good checkpoint (``--ckpt_path last``
        resumes it: no checkpoint is written from non-finite weights)."""
        callback = self.trainer.checkpoint_callback
        saved = [path for path in (getattr(callback, "last_model_path", ""), self.trainer.ckpt_path)
                 if path and Path(path).exists()]
        last_good = (f"the last good checkpoint is {saved[0]}: resume it with --ckpt_path {saved[0]} once the cause is "
                     "fixed" if saved else "no checkpoint was saved before it: start again once the cause is fixed")
        raise NonFiniteTraining(f"{problem}; nothing was saved from them, {last_good}")

    def _skip(self, bad: list[str]) -> None:
        """The ``nonfinite`` policy: fail, or drop the step (no optimizer step; gradients so far are discarded)."""
        if self.reward_model is not None:  # name the method that produced them
            bad = [f"{what} (from {type(self.reward_model).__name__}.score)" if what == "token rewards" else what
                   for what in bad]
        step = self.global_step + 1  # the step in progress, counted from 1 as in metrics.csv and the bar
        message = f"non-finite {', '.join(bad)} at step {step}"
        if self.optim.nonfinite == "fail":
            raise NonFiniteTraining(message)
        self.optimizers().zero_grad()  # the skipped step's scorer, and what it accumulated, went with the step
        self.skipped_steps += 1
        self.consecutive_skips += 1
        limit = self.optim.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
            self._stop_nonfinite(f"{self.consecutive_skips} RL steps in a row were skipped (optim.max_consecutive_skips "
                                 f"{limit}; the last one: {message}): the weights or the reward model are probably "
                                 "broken")
        log.warning("skipping RL step %d: non-finite %s (%d skipped so far)", step, ", ".join(bad), self.skipped_steps)
        self.log("train/skipped_steps", float(self.skipped_steps))
        return None
