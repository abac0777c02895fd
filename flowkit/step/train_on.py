"""The second phase of an RL step: an :class:`~flowkit.step.Experience` in, the policy updated, metrics out.

``ppo_epochs`` passes × ``num_minibatches`` minibatches, each micro-batched and ended by one optimizer step (verl's
``dp_actor.update_policy``). The loss of every micro-batch is its share of the whole minibatch's, so results do not
depend on the micro-batch size. The reward model's online loss (e.g. the flow update) joins the first minibatch.

Multi-rank rule (docs/design.md): every forward/backward is a collective under DDP and ZeRO, so the number of
minibatches, of micro-batches and of loss pieces agrees over ranks before the first one runs — also when ranks hold
different numbers of rows; a rank with fewer runs padding micro-batches (:func:`~flowkit.step.micro_batches.
micro_batch_rows`), and ranks decide to skip a step together: one decision (one all-reduce) per optimizer step, over
the minibatch's losses and gradients.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import torch
from torch import Tensor

from flowkit.rewards.base import LearnsOnline, ReportsMetrics
from flowkit.rl.losses import aggregation_denominator
from flowkit.step.actor import Actor
from flowkit.step.experience import Experience
from flowkit.step.finite import NonFiniteCheck, raise_if_nonfinite
from flowkit.step.micro_batches import micro_batch_rows
from flowkit.step.optimizer import StepOptimizer
from flowkit.step.options import UpdateOptions
from flowkit.step.stats import StepStats

POLICY_GROUPS = ("policy", "value")


class PolicyUpdate:
    """Trains the policy (and the reward model's online loss) on experiences.

    Args:
        actor: the policy's forward and loss.
        update: updates per experience and their micro-batching.
    """

    def __init__(self, actor: Actor, update: UpdateOptions):
        self.actor, self.update = actor, update

    def train_on(self, experience: Experience, optimizer: StepOptimizer,
                 policy_groups: Collection[str] = POLICY_GROUPS) -> dict[str, Tensor | float]:
        """Update on ``experience``; returns the step's loss statistics (means over minibatches), times and the
        reward model's metrics. ``policy_groups=()``: the policy is frozen this step (the reward model's warm-up,
        :meth:`~flowkit.rewards.base.TokenRewardModel.freezes_policy`): only the reward model's online loss is
        backpropagated and only its group moves. Raises :class:`~flowkit.step.NonFiniteStep` (every rank alike)
        before an optimizer step whose losses or gradients are not finite."""
        start, timings = time.perf_counter(), {}
        stats = StepStats()
        minibatches = self._minibatches(experience) if policy_groups else [None]
        for index, rows in enumerate(minibatches):
            losses = NonFiniteCheck()
            if rows is not None:
                self._train_minibatch(experience, experience.select(rows), optimizer, stats, losses)
            groups = set(policy_groups)
            if index == 0 and self._reward_model_update(experience, optimizer, losses, timings):
                groups.add("reward")  # the reward model only moves on the minibatch that carried its loss
            stats.close_minibatch()
            # one decision over ranks, before a clipping shared by the groups would spread one group's NaN
            raise_if_nonfinite(losses.nonfinite() or optimizer.nonfinite(groups))
            optimizer.step(groups)
        timings["time/update_s"] = time.perf_counter() - start - timings.get("time/reward_model_s", 0.0)
        return {**timings, **stats.means(), **_reward_model_metrics(experience)}

    def _minibatches(self, experience: Experience) -> list[Tensor]:
        """Row indices of each minibatch: the rows in generation order cut into ``num_minibatches`` parts (sizes
        differing by at most one; a rank with fewer rows than minibatches has empty ones, which run padding
        micro-batches), once per ``ppo_epochs``; each part's rows in the experience's order."""
        position = torch.argsort(experience.sample_index.cpu())
        return [position[rows].sort().values for _ in range(self.update.ppo_epochs)
                for rows in torch.arange(experience.batch_size).tensor_split(self.update.num_minibatches)]

    def _train_minibatch(self, experience: Experience, mini: Experience, optimizer: StepOptimizer, stats: StepStats,
                         losses: NonFiniteCheck) -> None:
        """The backward of each micro-batch's share of the minibatch loss (normalised over the minibatch's
        ``loss_mask``); a padding micro-batch backpropagates the experience's first row times 0."""
        options = self.actor.options
        denominator = aggregation_denominator(mini.loss_mask, options.aggregation, options.max_new_tokens)
        tokens = mini.loss_mask.sum().clamp(min=1)
        for rows in micro_batch_rows(mini.attention_mask, self.update.micro_batch_size, self.update.micro_batch_tokens,
                                     self._rows_with_gradient(mini), self.actor.padding_free):
            if rows is None:
                loss = self.actor.padding_loss(self.actor.forward(experience.select([0]).trimmed()))
            else:
                micro = mini.select(rows).trimmed()
                real = float(micro.attention_mask.sum())
                positions = real if self.actor.padding_free else micro.input_ids.numel()  # what the forward computes
                stats.add_weighted("perf/padding_frac", 1 - real / positions, positions)
                loss = self.actor.loss(micro, self.actor.forward(micro), denominator, tokens, stats)
            losses.note("policy loss", loss)  # a padding loss is 0 × the outputs: NaN when the weights are
            optimizer.backward(loss)

    def _rows_with_gradient(self, mini: Experience) -> Tensor | None:
        """``skip_zero_advantage_rows``: the rows whose advantages are not all 0 (None: every row runs). The policy
        loss of a token is proportional to its advantage, so such a row adds nothing — unless a KL, value or entropy
        term also reads it."""
        if (not self.update.skip_zero_advantage_rows or self.actor.reference is not None
                or self.actor.value_head is not None or self.actor.options.entropy_coef > 0):
            return None
        return (mini.advantages * mini.response_mask).ne(0).any(-1)

    @staticmethod
    def _reward_model_update(experience: Experience, optimizer: StepOptimizer, losses: NonFiniteCheck,
                             timings: dict[str, float]) -> bool:
        """The backward of the reward model's online loss, piece by piece (as many pieces on every rank); whether
        there was one."""
        scorer = experience.reward_step
        if not isinstance(scorer, LearnsOnline):
            return False
        start = time.perf_counter()
        pieces = scorer.end_step(experience)
        for piece in pieces:
            loss = piece()
            losses.note("flow loss", loss)
            optimizer.backward(loss)
        timings["time/reward_model_s"] = time.perf_counter() - start
        return bool(pieces)


def _reward_model_metrics(experience: Experience) -> dict[str, float]:
    """The step scorer's own scalars; a key without a prefix gets ``reward_model/`` (``flowkit plot`` draws them)."""
    scorer = experience.reward_step
    if not isinstance(scorer, ReportsMetrics):
        return {}
    return {key if "/" in key else f"reward_model/{key}": value for key, value in scorer.metrics().items()}
