"""The first phase of an RL step: prompts in, :class:`~flowkit.step.Experience` out.

Generate ``num_samples`` responses per prompt → grade them → DAPO's sampling controls (dynamic sampling, overlong
buffer, truncated-row mask) → a no-grad scoring pass in micro-batches (old log-probs, entropies, reference log-probs,
the reward model's token rewards, values) → advantages. The reward model reads each micro-batch's latents right
after its forward and they go: memory is set by the micro-batch, never the batch.

The scoring pass runs only where something before the update needs the policy's forward (:meth:`ExperienceMaker.
scores`). On-policy GRPO without a reward model, KL reference, value head or entropy shaping needs none: its
advantages come from the outcomes alone and π_old is the update's own forward, detached (ρ = 1, gradient ∇log π), as
TRL's ``GRPOTrainer`` does with one iteration per generation — a whole no-grad forward of the batch saved per step.

Plain PyTorch (no Lightning); the policy's weights do not change here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.batch import RolloutBatch, pad_columns
from flowkit.distributed import all_reduce_int
from flowkit.llm.rollout_engine import RolloutEngine, prefetch_ahead
from flowkit.options import registry_entry
from flowkit.rewards.base import PadsScoring, StepScorer, TokenRewardModel, check_step_scorer, check_token_rewards
from flowkit.rl.advantages import ESTIMATORS, AdvantageInputs, entropy_shaped_advantages, whitened
from flowkit.rl.losses import kl_shaped_rewards
from flowkit.step.actor import Actor
from flowkit.step.episodes import EpisodeRollout
from flowkit.step.experience import Experience, PromptBatch, PromptSource
from flowkit.step.finite import NonFiniteCheck, raise_if_nonfinite
from flowkit.step.micro_batches import longest_first, micro_batch_rows, sequence_lengths
from flowkit.step.options import AdvantageOptions, SamplingControls, UpdateOptions

SCORED = ("old_logprobs", "ref_logprobs", "token_rewards", "old_values", "advantages", "returns")


class ExperienceMaker:
    """Makes the :class:`Experience` of RL steps.

    Args:
        actor: the policy's forward (the scoring pass).
        rollout: the rollout engine (:class:`~flowkit.llm.rollout_engine.RolloutEngine`).
        grader: fills a generated batch's ``outcome_rewards`` and ``correct``, returns its metrics
            (:class:`~flowkit.step.grading.Grader`).
        reward_model: dense token rewards, or None.
        advantage, update, controls: option groups (``update``: the micro-batching of the scoring pass).
        num_samples: responses per prompt.
        stream: where dynamic sampling draws more prompts (:class:`~flowkit.step.PromptSource`); None without it.
        episodes: generates the rows as agent episodes (:class:`~flowkit.step.episodes.EpisodeRollout`, over
            ``rollout``'s token-in path); None: one response per row.
    """

    def __init__(self, actor: Actor, rollout: RolloutEngine, grader: Callable[[RolloutBatch], dict[str, Tensor]],
                 reward_model: TokenRewardModel | None,
                 advantage: AdvantageOptions, update: UpdateOptions, controls: SamplingControls, num_samples: int,
                 stream: PromptSource | None = None, episodes: EpisodeRollout | None = None):
        self.actor, self.rollout, self.grader, self.reward_model = actor, rollout, grader, reward_model
        self.advantage, self.update, self.controls, self.num_samples = advantage, update, controls, num_samples
        self.stream, self.episodes = stream, episodes
        self.estimator, self.estimator_context = registry_entry(ESTIMATORS, advantage.estimator), advantage.context()

    def make_experience(self, prompts: PromptBatch, step: int) -> Experience:
        """The experience of RL step ``step`` (longest row first under ``micro_batch_tokens``), with the reward
        model's scorer of the step (its online loss joins the update) and what making it measured (times,
        sampling-control and reward-function statistics). Raises :class:`~flowkit.step.NonFiniteStep` (every rank
        alike) after the generation or the scoring pass."""
        metrics: dict[str, float] = {"time/generate_s": 0.0}
        batch = self._generated(prompts, metrics)
        if self.controls.dynamic_sampling_max_draws is not None:
            batch = self._dynamic_sampling(batch, step, metrics)
        in_loss = self._apply_length_controls(batch, metrics)
        order = torch.arange(batch.batch_size)
        if self.update.micro_batch_tokens is not None:  # every micro-batch a run of consecutive rows
            order = longest_first(sequence_lengths(batch.attention_mask))
            batch = batch.select(order)
            in_loss = None if in_loss is None else in_loss[order]
        scorer = None if self.reward_model is None else check_step_scorer(self.reward_model,
                                                                           self.reward_model.begin_step(step, batch))
        start = time.perf_counter()
        if self.scores():
            self._score(batch, scorer)
        else:
            self._advantages(batch)
        if self.estimator.whiten:  # over the whole batch, once every row has its advantages
            batch.advantages = whitened(batch.advantages, batch.loss_mask)
        metrics["time/score_s"] = time.perf_counter() - start
        loss_mask = batch.loss_mask if in_loss is None else batch.loss_mask * in_loss[:, None]
        return Experience.of(batch, order, loss_mask, scorer, metrics)

    def prefetch_ahead(self, batch_of: Callable[[int], dict[str, Any]], index: int, steps_after: int) -> None:
        """At the start of the step that trains the data's batch ``index`` (``batch_of(i)``: batch i, a pure function
        of i): keep the next steps' rollouts in flight on the engine, or their episodes
        (:func:`~flowkit.llm.rollout_engine.prefetch_ahead`)."""
        if self.episodes is None:
            prefetch_ahead(self.rollout, lambda i: batch_of(i)["prompt"], index, self.num_samples, steps_after)
        else:  # an episode's environment starts from the whole record
            prefetch_ahead(self.episodes, lambda i: PromptBatch.of(batch_of(i)), index, self.num_samples, steps_after)

    # ------------------------------------------------------------------------------------------ sampling controls
    def _generated(self, prompts: PromptBatch, metrics: dict[str, float]) -> RolloutBatch:
        """``num_samples`` responses (or episodes) per prompt, graded (the generation time added to ``metrics``)."""
        start = time.perf_counter()
        if self.episodes is not None:
            batch, trajectories, nonfinite = self.episodes.generate(prompts, self.num_samples, self.actor.device)
        else:
            batch = self.rollout.generate(prompts.prompts, self.num_samples, prompts.answers)
            batch.columns = {key: [value for value in values for _ in range(self.num_samples)]  # prompt-major rows
                             for key, values in prompts.columns.items()}
            nonfinite = self.rollout.saw_nonfinite_logits
        if batch.policy_versions is None:  # an engine that does not count versions samples with the current weights
            batch.policy_versions = torch.full((batch.batch_size,), self.rollout.policy_version)
        metrics["time/generate_s"] += time.perf_counter() - start
        raise_if_nonfinite(["generation logits"] if nonfinite else [])
        metrics.update(self.grader(batch))
        if self.episodes is not None:
            metrics.update(self.episodes.grade(batch, trajectories))
        return batch

    def _dynamic_sampling(self, batch: RolloutBatch, step: int, metrics: dict[str, float]) -> RolloutBatch:
        """DAPO's dynamic sampling: keep the groups whose raw outcomes differ, draw more prompts until as many groups
        as the step's prompts are kept on every rank (or ``max_draws`` generations ran: every rank draws as often,
        each draw being a collective under ZeRO-3), then keep the first that many. A rank that kept no group trains
        on its first draw as it came (all its outcome advantages are 0). The stream's None stops the draws (SIGTERM)."""
        if self.stream is None:
            raise ValueError("dynamic sampling needs a prompt stream (ExperienceMaker.stream) to draw more prompts")
        target = int(batch.group_ids.unique().numel())
        first, parts, drawn, kept, draws = batch, [], 0, 0, 0
        while True:
            parts.append(batch.select(_informative_rows(batch)))
            drawn += int(batch.group_ids.unique().numel())
            kept += int(parts[-1].group_ids.unique().numel())
            draws += 1
            if (draws >= self.controls.dynamic_sampling_max_draws or all_reduce_int(kept, ReduceOp.MIN) >= target
                    or (extra := self.stream.extra_batch(step, draws)) is None):
                break
            next_id = int(batch.group_ids.max()) + 1
            batch = self._generated(extra, metrics)
            batch.group_ids = batch.group_ids + next_id  # groups of every draw stay apart
        metrics.update({"train/groups_drawn": float(drawn), "train/groups_kept": float(min(kept, target)),
                        "train/sampling_draws": float(draws), "train/zero_advantage_group_frac": 1.0 - kept / drawn})
        if kept == 0:
            return first
        batch = RolloutBatch.cat([part for part in parts if part.batch_size])
        if kept > target:  # the first ``target`` kept groups, in the order they were drawn (rows are prompt-major)
            batch = batch.select(torch.isin(batch.group_ids, torch.unique_consecutive(batch.group_ids)[:target]))
        return batch

    def _apply_length_controls(self, batch: RolloutBatch, metrics: dict[str, float]) -> Tensor | None:
        """``overlong_buffer``: DAPO eq. 13's penalty added to the outcome rewards (after dynamic sampling read
        the raw ones); ``mask_truncated``: the B float rows that stay in the policy loss (None: all). Logs the
        truncated fraction when any control is on."""
        controls = self.controls
        if not controls.active:
            return None
        truncated = self._truncated(batch)
        metrics["train/truncated_frac"] = float(truncated.float().mean())
        if "train/zero_advantage_group_frac" not in metrics:
            drawn = int(batch.group_ids.unique().numel())
            kept = int(batch.group_ids[_informative_rows(batch)].unique().numel())
            metrics["train/zero_advantage_group_frac"] = 1.0 - kept / max(1, drawn)
        if controls.overlong_buffer_length is not None:
            lengths, limit = self._lengths(batch)
            batch.outcome_rewards = batch.outcome_rewards.float() + overlong_penalty(
                lengths, limit, controls.overlong_buffer_length, controls.overlong_penalty)
        return (~truncated).float() if controls.mask_truncated else None

    def _lengths(self, batch: RolloutBatch) -> tuple[Tensor, int]:
        """B lengths the overlong buffer reads and their limit: the responses against ``max_new_tokens``; episodes
        (prompt and every turn) against their token budget."""
        if self.episodes is None:
            return batch.response_lengths, self.actor.options.max_new_tokens
        return batch.attention_mask.sum(-1), self.episodes.options.max_tokens

    def _truncated(self, batch: RolloutBatch) -> Tensor:
        """B bool: rows a bound cut (episodes: the runner's turn or token bound), else responses without an EOS
        token (cut at ``max_new_tokens``; without an EOS id: that long)."""
        if batch.truncated is not None:
            return batch.truncated
        eos = self.rollout.tokenizer.eos_token_id
        if eos is None:
            return batch.response_lengths >= self.actor.options.max_new_tokens
        return ~((batch.input_ids == eos) & batch.response_mask.bool()).any(-1)

    # ------------------------------------------------------------------------------------------ scoring
    def scores(self) -> bool:
        """Whether the step runs the scoring pass: more than one update per experience (π_old must be fixed before the
        first changes the weights), or advantages that read a forward (a reward model's token rewards, a KL in the
        reward, a value head's values, entropy shaping)."""
        actor = self.actor
        return (self.update.updates > 1 or self.reward_model is not None or actor.reference is not None
                or actor.value_head is not None or self.advantage.entropy_alpha > 0)

    def _advantages(self, batch: RolloutBatch) -> None:
        """The advantages of a step without a scoring pass: the estimator over the outcomes alone (its old log-probs
        and entropies stay None: the update's forward gives them)."""
        outcome = self.estimator.outcome(batch.outcome_rewards, batch.group_ids, self.estimator_context)
        inputs = AdvantageInputs(outcome, batch.loss_mask, None, None)
        batch.advantages, batch.returns = self.estimator.tokens(inputs, self.estimator_context)
        check = NonFiniteCheck()
        check.note("advantages", batch.advantages, batch.loss_mask.bool())
        raise_if_nonfinite(check.nonfinite())

    @torch.no_grad()
    def _score(self, batch: RolloutBatch, scorer: StepScorer | None) -> None:
        """The scoring pass: a no-grad forward per micro-batch fixing old log-probs, entropies, reference log-probs,
        token rewards, values and advantages of every row; a rank with fewer micro-batches runs padding ones. Then
        one decision over ranks: a non-finite value anywhere skips the step."""
        outcome = self.estimator.outcome(batch.outcome_rewards, batch.group_ids, self.estimator_context)
        length = batch.input_ids.shape[1]
        parts: dict[str, list[Tensor]] = {name: [] for name in (*SCORED, "entropy")}
        check = NonFiniteCheck()
        for rows in micro_batch_rows(batch.attention_mask, self.update.micro_batch_size, self.update.micro_batch_tokens,
                                     padding_free=self.actor.padding_free):
            if rows is None:
                self._padding(batch, scorer)
                continue
            micro = self._scored(batch.select(rows).trimmed(), rows, outcome, scorer)
            response = micro.loss_mask.bool()
            for name, values in (("log-probs", micro.old_logprobs), ("advantages", micro.advantages),
                                 ("token rewards", micro.token_rewards)):
                if values is not None:
                    check.note(name, values, response)
            parts["entropy"].append(micro.entropy)
            for name in SCORED:
                if getattr(micro, name) is not None:  # token rewards in float32, as the completion logs read them
                    parts[name].append(pad_columns(getattr(micro, name), length).float())
        raise_if_nonfinite(check.nonfinite())
        batch.entropy = torch.cat(parts.pop("entropy"))
        for name, values in parts.items():
            setattr(batch, name, torch.cat(values) if values else None)

    def _scored(self, micro: RolloutBatch, rows: Tensor, outcome: Tensor, scorer: StepScorer | None) -> RolloutBatch:
        """A micro-batch's forward, then what the update needs of it: old log-probs, entropies, reference log-probs,
        token rewards (the reward model reads the latents, then they go), values and advantages, over the tokens
        the policy sampled (``loss_mask``; an episode's environment tokens are read by the forward only)."""
        out = self.actor.forward(micro, tap=scorer is not None)
        micro.old_logprobs = out.logprobs.detach()
        mask = micro.loss_mask
        micro.entropy = (out.entropy.detach() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        if self.actor.reference is not None:
            micro.ref_logprobs = self.actor.reference_logprobs(micro)
        if scorer is not None:
            micro.latents, micro.token_entropy = out.latents, out.entropy.detach()
            micro.token_rewards = check_token_rewards(type(scorer).__name__, scorer.score(micro, rows), micro)
            micro.latents = None
        rewards = micro.token_rewards
        options = self.actor.options
        if self.actor.reference is not None and options.kl_in == "reward":
            rewards = kl_shaped_rewards(rewards, micro.old_logprobs, micro.ref_logprobs, mask, options.kl_coef,
                                        options.kl_estimator)
        micro.old_values = None if out.values is None else out.values.detach()
        inputs = AdvantageInputs(outcome[rows], mask, rewards, micro.old_values)
        micro.advantages, micro.returns = self.estimator.tokens(inputs, self.estimator_context)
        if self.advantage.entropy_alpha > 0:
            micro.advantages = entropy_shaped_advantages(micro.advantages, out.entropy, mask,
                                                         self.advantage.entropy_alpha, self.advantage.entropy_kappa)
        return micro

    def _padding(self, batch: RolloutBatch, scorer: StepScorer | None) -> None:
        """A padding micro-batch of the scoring pass (another rank scores a real one here): the step's first row
        through every module a real one reaches — the policy (and value head), the KL reference and the step scorer
        (:class:`~flowkit.rewards.base.PadsScoring`) — each a collective under ZeRO-3."""
        row = batch.select([0]).trimmed()
        out = self.actor.forward(row, tap=scorer is not None)
        if self.actor.reference is not None:
            self.actor.reference_logprobs(row)
        if isinstance(scorer, PadsScoring):
            row.latents, row.token_entropy = out.latents, out.entropy.detach()
            scorer.pad(row)


def _informative_rows(batch: RolloutBatch) -> Tensor:
    """B bool: rows of the groups whose raw outcome rewards are not all equal (a nonzero GRPO advantage)."""
    _, group = batch.group_ids.unique(return_inverse=True)
    rewards = batch.outcome_rewards.float()
    count = int(group.max()) + 1 if len(group) else 0
    high = rewards.new_full((count,), float("-inf")).scatter_reduce(0, group, rewards, "amax")
    low = rewards.new_full((count,), float("inf")).scatter_reduce(0, group, rewards, "amin")
    return (high > low)[group]


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty: float) -> Tensor:
    """DAPO eq. 13 times ``penalty`` (verl ``overlong_buffer.penalty_factor``): 0 for |y| ≤ L_max − L_c,
    −penalty·(|y| − (L_max − L_c))/L_c inside the buffer, −penalty from L_max on."""
    excess = (lengths.float() - (max_length - buffer)).clamp(min=0, max=buffer)
    return -penalty * excess / buffer
