"""Validation of :class:`~flowkit.modules.PolicyModule`: pass@1 and pass@k of the math grader on each eval set."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric

from flowkit.rewards.base import EvaluatesPolicy
from flowkit.rewards.grader import grade
from flowkit.rl.metrics import pass_at_k


class ValidationHooks:
    """The validation hooks of a LightningModule with ``rollout_engine``, ``reward_model``, ``validation`` (a
    :class:`~flowkit.modules.policy_options.ValidationOptions`) and ``hparams.grader_timeout``."""

    def on_validation_epoch_start(self) -> None:
        """The metrics of each eval set, by position: a ``ModuleDict`` key cannot hold every name a user may give an
        eval set (``gsm8k.test``), so the names are kept beside it (:attr:`val_set_names`)."""
        names = list(getattr(self.trainer.datamodule, "val_names", None) or ["heldout"])
        if names != self.val_set_names:
            k = self._val_k()
            self.val_set_names = names
            self.val_metrics = torch.nn.ModuleDict({
                str(index): torch.nn.ModuleDict({"pass@1": MeanMetric(), f"pass@{k}": MeanMetric()})
                for index in range(len(names))}).to(self.device)

    def _val_k(self) -> int:
        return 1 if self.validation.temperature == 0 else self.validation.num_samples

    def validation_step(self, prompts: dict[str, list[str]], batch_idx: int, dataloader_idx: int = 0) -> None:
        """pass@1 and pass@k of the math grader on each eval set; a reward model with its own ``evaluate`` (e.g. the
        explanation reward's judged accuracy) reports that instead."""
        name = self.val_set_names[dataloader_idx]
        if isinstance(self.reward_model, EvaluatesPolicy):
            generate = lambda texts, n, temperature: self.rollout_engine.generate(texts, n, None, temperature=temperature)  # noqa: E731
            for key, (value, weight) in self.reward_model.evaluate(prompts, generate).items():
                if weight:
                    self.log(f"val/{name}/{key}", value, add_dataloader_idx=False, batch_size=int(weight))
            return
        k = self._val_k()
        batch = self.rollout_engine.generate(prompts["prompt"], k, prompts["answer"], temperature=self.validation.temperature)
        correct = torch.tensor([grade(r, a, self.hparams.grader_timeout) for r, a in zip(batch.responses, batch.answers)])
        per_prompt = correct.view(-1, k).sum(-1)
        metrics = self.val_metrics[str(dataloader_idx)]
        metrics["pass@1"].update(pass_at_k(k, per_prompt, 1))
        metrics[f"pass@{k}"].update(pass_at_k(k, per_prompt, k))
        for key, metric in metrics.items():
            self.log(f"val/{name}/{key}", metric, add_dataloader_idx=False, batch_size=len(prompts["prompt"]))
