"""One RL step, two phases with data between them (verl's ``compute_log_prob`` → ``compute_advantage`` →
``update_policy``):

    prompts ─▶ ExperienceMaker.make_experience ─▶ Experience ─▶ PolicyUpdate.train_on(·, optimizer) ─▶ metrics

Plain PyTorch (no Lightning). What depends on the training strategy is the ``optimizer`` object
(:class:`~flowkit.step.optimizer.StepOptimizer`: ``backward``, ``nonfinite``, ``step``); the prompts of dynamic
sampling's extra draws come from the maker's :class:`~flowkit.step.experience.PromptSource`.
"""

from __future__ import annotations

from torch import Tensor

from flowkit.rewards.base import TokenRewardModel
from flowkit.step.experience import Experience, PromptBatch
from flowkit.step.make_experience import ExperienceMaker
from flowkit.step.optimizer import StepOptimizer
from flowkit.step.train_on import POLICY_GROUPS, PolicyUpdate


class RLStep:
    """Runs RL steps: ``experience`` makes each step's :class:`Experience`, ``update`` trains on it."""

    def __init__(self, experience: ExperienceMaker, update: PolicyUpdate):
        self.experience, self.update = experience, update

    @property
    def reward_model(self) -> TokenRewardModel | None:
        return self.experience.reward_model

    def __call__(self, prompts: PromptBatch, step: int,
                 optimizer: StepOptimizer) -> tuple[Experience, dict[str, Tensor | float]]:
        """Generate, score and train on one prompt batch of RL step ``step``; returns the experience and the
        step's metrics (both phases'). Raises :class:`~flowkit.step.NonFiniteStep`."""
        experience = self.experience.make_experience(prompts, step)
        frozen = self.reward_model is not None and self.reward_model.freezes_policy(step)
        metrics = self.update.train_on(experience, optimizer, policy_groups=() if frozen else POLICY_GROUPS)
        return experience, {**experience.metrics, **metrics}
