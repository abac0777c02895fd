"""Grading a generated batch: the outcome reward of each row and the grader's verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from flowkit.batch import RolloutBatch
from flowkit.rewards.functions import OutcomeReward, WeightedReward, outcome_rewards


@dataclass(frozen=True)
class Grader:
    """Outcome reward r_o (:func:`~flowkit.rewards.functions.outcome_rewards`: the math grader's ``outcome_reward``
    plus weighted ``functions``); ``correct`` (the logged accuracy, the ``correct`` rejection metric) is the grader's
    verdict. ``timeout``: seconds allowed to grade one response."""

    outcome_reward: OutcomeReward = "official"
    functions: list[WeightedReward] = field(default_factory=list)
    timeout: float = 1.0

    def __call__(self, batch: RolloutBatch) -> dict[str, Tensor]:
        """Fills ``batch.outcome_rewards`` and ``batch.correct``; returns each reward function's mean
        (``train/reward/<name>``)."""
        rewards, correct, values = outcome_rewards(batch.responses, batch.answers, batch.prompts, self.outcome_reward,
                                                   self.functions, self.timeout, batch.columns)
        device = batch.input_ids.device
        batch.outcome_rewards, batch.correct = rewards.to(device), correct.to(device)
        return {f"train/reward/{name}": value.nanmean() for name, value in values.items()}
