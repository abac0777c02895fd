"""Validation of :class:`~flowkit.modules.PolicyModule`: pass@1 and pass@k of the math grader on each eval set."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torchmetrics import MeanMetric

from flowkit.data.grader import grade
from flowkit.llm.rollout_engine import RolloutEngine
from flowkit.modules.policy_options import ValidationOptions
from flowkit.rewards.base import EvaluatesPolicy, TokenRewardModel
from flowkit.rl.metrics import pass_at_k


class PolicyValidator(torch.nn.Module):
    """pass@1 and pass@k (k = ``options.num_samples``; 1 at temperature 0) of each eval set; a reward model with its
    own ``evaluate`` (e.g. the explanation reward's judged accuracy) reports that instead.

    Attributes:
        metrics: the running means of each eval set, by position: a ``ModuleDict`` key cannot hold every name a
            user may give an eval set (``gsm8k.test``), so the names are kept beside it (:attr:`set_names`).
        set_names: the eval sets' names, as the datamodule's ``val_names`` gives them.
    """

    def __init__(self, options: ValidationOptions, grader_timeout: float):
        super().__init__()
        self.options, self.grader_timeout = options, grader_timeout
        self.metrics = torch.nn.ModuleDict()
        self.set_names: list[str] = []

    @property
    def k(self) -> int:
        return 1 if self.options.temperature == 0 else self.options.num_samples

    def start(self, names: list[str], device: torch.device) -> None:
        """A validation epoch over the eval sets ``names`` starts (fresh metrics when they changed)."""
        if names != self.set_names:
            self.set_names = names
            self.metrics = torch.nn.ModuleDict({
                str(index): torch.nn.ModuleDict({"pass@1": MeanMetric(), f"pass@{self.k}": MeanMetric()})
                for index in range(len(names))}).to(device)

    def step(self, prompts: dict[str, list[str]], set_index: int, engine: RolloutEngine,
             reward_model: TokenRewardModel | None) -> Iterator[tuple[str, Any, int]]:
        """(key, value or metric, batch size) of each value to log for a batch of eval set ``set_index``."""
        name = self.set_names[set_index]
        if isinstance(reward_model, EvaluatesPolicy):
            generate = lambda texts, n, temperature: engine.generate(texts, n, None, temperature=temperature)  # noqa: E731
            for key, (value, weight) in reward_model.evaluate(prompts, generate).items():
                if weight:
                    yield f"val/{name}/{key}", value, int(weight)
            return
        k = self.k
        batch = engine.generate(prompts["prompt"], k, prompts["answer"], temperature=self.options.temperature)
        correct = torch.tensor([grade(r, a, self.grader_timeout) for r, a in zip(batch.responses, batch.answers)])
        per_prompt = correct.view(-1, k).sum(-1)
        metrics = self.metrics[str(set_index)]
        metrics["pass@1"].update(pass_at_k(k, per_prompt, 1))
        metrics[f"pass@{k}"].update(pass_at_k(k, per_prompt, k))
        for key, metric in metrics.items():
            yield f"val/{name}/{key}", metric, len(prompts["prompt"])
