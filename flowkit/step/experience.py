"""`Experience`: what :meth:`~flowkit.step.ExperienceMaker.make_experience` hands to
:meth:`~flowkit.step.PolicyUpdate.train_on` — every row generated, graded and scored, every field filled.

A :class:`~flowkit.batch.RolloutBatch` is what rollout engines return and reward models read, a record that fills up
as the rows are graded and scored; an Experience is the finished, immutable record the update reads. Field names are
RolloutBatch's, so a reward model's ``end_step`` and the completion logs read either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from flowkit.batch import RolloutBatch
from flowkit.rewards.base import StepScorer


@dataclass(frozen=True)
class PromptBatch:
    """One batch of prompts with their reference answers and the data's other fields (one value per prompt)."""

    prompts: list[str]
    answers: list[str]
    columns: dict[str, list] = field(default_factory=dict)

    @staticmethod
    def of(record: dict[str, Any]) -> PromptBatch:
        """A data module's batch (``prompt``, ``answer``, ``index`` and the data's other fields, each a list)."""
        columns = {key: value for key, value in record.items() if key not in ("prompt", "answer", "index")}
        return PromptBatch(record["prompt"], record["answer"], columns)


class PromptSource(Protocol):
    """Where dynamic sampling draws more prompts: ``extra_batch(step, draw)`` is extra draw ``draw`` ≥ 1 of RL step
    ``step``, a pure function of both (a resumed run draws the same), or None to stop drawing (on every rank alike:
    SIGTERM)."""

    def extra_batch(self, step: int, draw: int) -> PromptBatch | None: ...


@dataclass(frozen=True)
class Experience:
    """One RL step's rows, ready for the update. B rows, S positions (RolloutBatch's layout: left-padded prompt, then
    the response); every B×S tensor aligned to ``input_ids`` (position s holds token s's value).

    ``loss_mask`` is 1 on the tokens the policy loss trains on: the tokens the policy sampled
    (:attr:`RolloutBatch.loss_mask <flowkit.batch.RolloutBatch.loss_mask>`) of the rows kept in the loss
    (``controls.mask_truncated`` drops truncated rows); an agent episode's row has 0 on the environment's tokens while
    ``response_mask`` still marks every token after the prompt.
    """

    input_ids: Tensor  # B×S long
    attention_mask: Tensor  # B×S long, 1 on real tokens
    response_mask: Tensor  # B×S float, 1 on response tokens (what the forward computes log-probs of)
    loss_mask: Tensor  # B×S float, 1 on the tokens the policy loss and its normalisation count
    group_ids: Tensor  # B long, rows sampled from the same prompt share an id
    sample_index: Tensor  # B long, each row's place in the order it was generated (rows come longest first under
    #                       update.micro_batch_tokens; minibatches are cut in generation order)
    policy_versions: Tensor  # B×S long, the policy version (optimizer steps) whose weights sampled each token
    old_logprobs: Tensor | None  # B×S float, log π_old of each token (the scoring pass's, before any update of the
    #                              step); None: the step ran no scoring pass (on-policy), π_old is the update's forward
    advantages: Tensor  # B×S float
    outcome_rewards: Tensor  # B float
    correct: Tensor  # B bool, the grader's verdict
    entropy: Tensor | None  # B float, mean token entropy of the response under π_old (None: no scoring pass ran;
    #                         the update reports ``train/entropy`` over the rows it forwards)
    rollout_logprobs: Tensor | None = None  # B×S float, the rollout engine's own log-probs (None: it gives none)
    ref_logprobs: Tensor | None = None  # B×S float, under the frozen KL reference (None: no KL)
    token_rewards: Tensor | None = None  # B×S float, the reward model's dense rewards (None: no reward model)
    old_values: Tensor | None = None  # B×S float, V(state before token s) under π_old (None: no value head)
    returns: Tensor | None = None  # B×S float, the value targets A + V (None: no value head)
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)  # the data's other fields, one value per row
    reward_step: StepScorer | None = field(default=None, repr=False)  # the reward model's scorer of this step
    metrics: dict[str, float] = field(default_factory=dict)  # what making it measured (times, sampling controls)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(-1)

    def select(self, index: Tensor | list[int]) -> Experience:
        """Rows ``index`` (integer indices) of every field."""
        rows = [int(i) for i in index]
        return self._map(lambda t: t[rows], lambda values: [values[i] for i in rows] if values else [])

    def trimmed(self) -> Experience:
        """The rows cut after their last real token (right padding costs compute and changes nothing)."""
        length = int(self.attention_mask.any(0).nonzero().max()) + 1
        return self._map(lambda t: t[:, :length] if t.dim() >= 2 else t, list)

    def _map(self, tensor_fn, list_fn) -> Experience:
        values: dict[str, Any] = {"reward_step": self.reward_step, "metrics": self.metrics}
        for f in dataclasses.fields(self):
            if f.name in values:
                continue
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = tensor_fn(value)
            elif isinstance(value, list):
                value = list_fn(value)
            elif isinstance(value, dict):
                value = {key: list_fn(column) for key, column in value.items()}
            values[f.name] = value
        return Experience(**values)

    @staticmethod
    def of(batch: RolloutBatch, sample_index: Tensor, loss_mask: Tensor, reward_step: StepScorer | None,
           metrics: dict[str, float]) -> Experience:
        """The finished record of a graded and scored ``batch`` (each token's policy version: the batch's own when
        per token, else its row's)."""
        versions = batch.policy_versions.to(batch.input_ids.device)
        if versions.dim() == 1:
            versions = versions[:, None].expand_as(batch.input_ids)
        return Experience(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, response_mask=batch.response_mask,
            loss_mask=loss_mask, group_ids=batch.group_ids, sample_index=sample_index,
            policy_versions=versions.long(),
            old_logprobs=batch.old_logprobs, advantages=batch.advantages, outcome_rewards=batch.outcome_rewards,
            correct=batch.correct, entropy=batch.entropy, rollout_logprobs=batch.rollout_logprobs,
            ref_logprobs=batch.ref_logprobs, token_rewards=batch.token_rewards, old_values=batch.old_values,
            returns=batch.returns, prompts=batch.prompts, responses=batch.responses, answers=batch.answers,
            columns=batch.columns, reward_step=reward_step, metrics=metrics)
