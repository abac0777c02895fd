"""One RL step: rollout → outcome rewards → token rewards from the reward model → advantages → micro-batched update.

Plain PyTorch (no Lightning). What depends on the training strategy enters as callables: ``backward(loss)`` (one of
the step's several backward passes) and ``step_optimizer(groups)`` (clip, move the named parameter groups, zero the
gradients). Memory is set by ``micro_batch_size`` or ``micro_batch_tokens``, not by the batch: every pass over the
rollouts runs in micro-batches, the reward model scores each micro-batch right after its forward, and the loss of
every micro-batch is its share of the whole minibatch's, so results do not depend on the micro-batch size. With a
token budget the step's rows are put longest first and packed into runs of consecutive rows
(:mod:`flowkit.engine.micro_batches`); minibatches keep the rows they would have had.

Multi-rank rule (DESIGN.md): every forward/backward is a collective under DDP and ZeRO, so the number of
micro-batches and of loss pieces agrees over ranks before the first one runs; a rank with fewer runs zero-loss
padding micro-batches, and ranks decide to skip a step together.

Finite state: a non-finite quantity (logits, rewards, advantages, the policy or the flow loss, the gradients of a
parameter group) skips the step before the optimizer moves anything (:class:`NonFiniteStep`, agreed over ranks);
:func:`nonfinite_groups` also lets the caller check the gradients before clipping and the weights after the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.batch import RolloutBatch, pad_columns
from flowkit.distributed import all_reduce_int
from flowkit.engine.actor import Actor, ActorOutput
from flowkit.engine.micro_batches import longest_first, pack_by_token_budget, sequence_lengths
from flowkit.engine.options import AdvantageOptions, UpdateOptions
from flowkit.engine.stats import StepStats
from flowkit.rewards.base import TokenRewardModel
from flowkit.rl.advantages import (
    ESTIMATORS, AdvantageInputs, entropy_shaped_advantages, group_normalized_advantage, whitened,
)
from flowkit.rl.losses import aggregation_denominator, kl_shaped_rewards


class NonFiniteStep(Exception):
    """Raised (on every rank alike) when logits, rewards or advantages are not finite; the caller skips or fails."""

    def __init__(self, what: list[str]):
        super().__init__(", ".join(what))
        self.what = what


class RLStep:
    """Runs RL steps over prompt batches.

    Args:
        actor: the policy's forward and loss.
        rollout: the rollout engine (``generate(prompts, n, answers)`` → :class:`RolloutBatch`; its
            ``saw_nonfinite_logits`` after a call).
        reward_model: dense token rewards (and an online loss), or None.
        grade: fills ``outcome_rewards`` and ``correct`` of a generated batch.
        advantage, update: option groups; ``num_samples``: responses per prompt.
        backward, step_optimizer: see the module docstring.
    """

    def __init__(self, actor: Actor, rollout: Any, reward_model: TokenRewardModel | None,
                 grade: Callable[[RolloutBatch], RolloutBatch], advantage: AdvantageOptions, update: UpdateOptions,
                 num_samples: int, backward: Callable[[Tensor], None],
                 step_optimizer: Callable[[Collection[str]], None]):
        self.actor, self.rollout, self.reward_model, self.grade = actor, rollout, reward_model, grade
        self.advantage, self.update, self.num_samples = advantage, update, num_samples
        self.backward, self.step_optimizer = backward, step_optimizer
        self.estimator = ESTIMATORS[advantage.estimator]

    def __call__(self, prompts: list[str], answers: list[str], step: int,
                 columns: dict[str, list] | None = None) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """Generate, score and train on one prompt batch (``columns``: the data's other fields, one value per prompt,
        which the reward model reads from ``RolloutBatch.columns``); returns the batch (with rewards, token rewards,
        entropies; longest row first under ``micro_batch_tokens``) and the step's statistics and timings. Raises
        :class:`NonFiniteStep`."""
        start = time.perf_counter()
        batch = self.rollout.generate(prompts, self.num_samples, answers)
        batch.columns = {key: [value for value in values for _ in range(self.num_samples)]  # rows are prompt-major
                         for key, values in (columns or {}).items()}
        timings = {"time/generate_s": time.perf_counter() - start}
        raise_if_nonfinite(["generation logits"] if self.rollout.saw_nonfinite_logits else [])
        batch = self.grade(batch)
        order = None  # the generated row at each position of the batch, when reordered
        if self.update.micro_batch_tokens is not None:  # every micro-batch a run of consecutive rows (a reward model's)
            order = longest_first(sequence_lengths(batch.attention_mask))
            batch = batch.select(order)
        if self.estimator.normalized_outcome:
            outcome = group_normalized_advantage(batch.outcome_rewards, batch.group_ids,
                                                 scale_rewards=self.advantage.scale_rewards)
        else:
            outcome = batch.outcome_rewards.float()
        if self.reward_model is not None:
            self.reward_model.begin_step(step, batch)
        batch.entropy = torch.full((batch.batch_size,), float("nan"), device=batch.input_ids.device)  # NaN: not run
        fused = self._fused()
        if not fused:
            score_start = time.perf_counter()
            self._score(batch, outcome)
            timings["time/score_s"] = time.perf_counter() - score_start
        update_start = time.perf_counter()
        stats = self._update(batch, outcome, fused, timings, order)
        timings["time/update_s"] = time.perf_counter() - update_start - timings.get("time/flow_s", 0.0)
        return batch, {**timings, **stats}

    def _fused(self) -> bool:
        """On-policy (one update) with nothing computed over the whole batch first: the training forward is also the
        scoring pass (no separate no-grad forward)."""
        return self.update.updates == 1 and not self.estimator.whiten

    # ------------------------------------------------------------------------------------------ scoring
    def _fill(self, micro: RolloutBatch, rows: Tensor, out: ActorOutput, outcome: Tensor, batch: RolloutBatch) -> None:
        """What the update needs of a micro-batch, right after its forward: old log-probs (the forward's, detached),
        entropies, reference log-probs, token rewards (the reward model reads the latents, then they go), values and
        advantages."""
        micro.old_logprobs = out.logprobs.detach()
        mask = micro.response_mask
        micro.entropy = batch.entropy[rows] = (out.entropy.detach() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        if self.actor.reference is not None:
            micro.ref_logprobs = self.actor.reference_logprobs(micro)
        if self.reward_model is not None:
            micro.latents = out.latents
            micro.token_rewards = self.reward_model.score(micro, rows)
            micro.latents = None
            if batch.token_rewards is None:  # the step's batch keeps them (completion logs read them)
                batch.token_rewards = torch.zeros(batch.response_mask.shape, device=mask.device)
            batch.token_rewards[rows, :mask.shape[1]] = micro.token_rewards.float()
        rewards = micro.token_rewards
        options = self.actor.options
        if self.actor.reference is not None and options.kl_in == "reward":
            rewards = kl_shaped_rewards(rewards, micro.old_logprobs, micro.ref_logprobs, mask, options.kl_coef,
                                        options.kl_estimator)
        micro.old_values = None if out.values is None else out.values.detach()
        inputs = AdvantageInputs(outcome[rows], mask, rewards, micro.old_values)
        micro.advantages, micro.returns = self.estimator.fn(inputs, self.advantage.gamma, self.advantage.lam,
                                                            self.advantage.outcome_placement)
        if self.advantage.entropy_alpha > 0:
            micro.advantages = entropy_shaped_advantages(micro.advantages, out.entropy, mask,
                                                         self.advantage.entropy_alpha, self.advantage.entropy_kappa)

    @torch.no_grad()
    def _score(self, batch: RolloutBatch, outcome: Tensor) -> None:
        """A no-grad pass in micro-batches fixing old log-probs, token rewards, values and advantages for every row
        (before updates that change the policy: μ > 1, several minibatches, or a batch-wide whitening)."""
        length = batch.input_ids.shape[1]
        names = ["old_logprobs", "ref_logprobs", "old_values", "advantages", "returns"]
        parts: dict[str, list[Tensor]] = {name: [] for name in names}
        for rows in self._micro_batches(batch):  # runs of consecutive rows, in order
            micro = batch.select(rows).trimmed()
            self._fill(micro, rows, self.actor.forward(micro, tap=True), outcome, batch)
            raise_if_nonfinite(_nonfinite(micro))
            for name in names:
                if getattr(micro, name) is not None:
                    parts[name].append(pad_columns(getattr(micro, name), length))
        for name in names:
            setattr(batch, name, torch.cat(parts[name]) if parts[name] else None)
        if self.estimator.whiten:
            batch.advantages = whitened(batch.advantages, batch.response_mask)

    # ------------------------------------------------------------------------------------------ update
    def _update(self, batch: RolloutBatch, outcome: Tensor, fused: bool, timings: dict[str, float],
                order: Tensor | None) -> dict[str, Tensor]:
        """``ppo_epochs`` passes × ``num_minibatches`` minibatches, each micro-batched and ended by one optimizer step;
        ``fused``: one pass whose forward also scores (old log-probs = its own, detached: ρ = 1 with gradient ∇logπ).
        A minibatch holds the same generated rows whatever ``order`` the batch is in."""
        stats = StepStats()
        position = torch.arange(batch.batch_size) if order is None else torch.argsort(order)
        minibatches = [position[rows].sort().values for _ in range(self.update.ppo_epochs)
                       for rows in torch.arange(batch.batch_size).chunk(self.update.num_minibatches)]
        for index, minibatch_rows in enumerate(minibatches):
            mini = batch if fused else batch.select(minibatch_rows)
            options = self.actor.options
            denominator = aggregation_denominator(mini.response_mask, options.aggregation, options.max_new_tokens)
            tokens = mini.response_mask.sum().clamp(min=1)
            losses = LossCheck()
            for rows in self._micro_batches(mini, self._rows_with_gradient(mini, outcome, fused)):
                if rows is None:
                    if fused:
                        raise_if_nonfinite([])  # the other ranks check their micro-batch here
                    loss = self.actor.padding_loss(mini.trimmed())
                    losses.note("policy loss", loss)  # 0 × the outputs: NaN when the weights are
                    self.backward(loss)
                    continue
                micro = mini.select(rows).trimmed()
                out = self.actor.forward(micro, tap=fused)
                if fused:
                    self._fill(micro, rows, out, outcome, batch)
                    raise_if_nonfinite(_nonfinite(micro))
                loss = self.actor.loss(micro, out, denominator, tokens, stats)
                losses.note("policy loss", loss)
                self.backward(loss)
            self._finish_minibatch(batch, stats, timings, losses, with_reward=index == 0)
        return stats.means()

    def _rows_with_gradient(self, mini: RolloutBatch, outcome: Tensor, fused: bool) -> Tensor | None:
        """``skip_zero_advantage_rows``: the rows whose advantages are not all 0 (None: every row runs). The policy
        loss of a token is proportional to its advantage, so such a row adds nothing — unless a KL, value or entropy
        term, or a reward model that must see every row, also reads it."""
        if (not self.update.skip_zero_advantage_rows or self.actor.reference is not None
                or self.actor.value_head is not None or (fused and self.reward_model is not None)
                or self.actor.options.entropy_coef > 0):
            return None
        advantages = outcome if fused else mini.advantages * mini.response_mask
        return advantages.reshape(len(advantages), -1).ne(0).any(-1)

    def _micro_batches(self, batch: RolloutBatch, keep: Tensor | None = None) -> list[Tensor | None]:
        """Row indices of each micro-batch of ``batch``, in order: ``micro_batch_size`` rows each, or with
        ``micro_batch_tokens`` (the rows come longest first) runs of rows packed under the token budget
        (:func:`~flowkit.engine.micro_batches.pack_by_token_budget`, at most ``micro_batch_size`` rows when that is
        set too), as many on every rank as on the rank that packs the most (every rank holds as many rows, so each
        can split its runs that often). With ``keep`` (a bool per row), only the kept rows, in as many micro-batches
        as the rank that keeps the most (at least one): a rank with fewer adds ``None`` entries (padding
        micro-batches). Counts are agreed before the first micro-batch runs."""
        index = torch.arange(batch.batch_size) if keep is None else keep.cpu().nonzero().flatten()
        budget, max_rows = self.update.micro_batch_tokens, self.update.micro_batch_size
        if budget is None:
            parts: list[Tensor | None] = list(index.split(max_rows or batch.batch_size)) if len(index) else []
            if keep is not None:
                parts += [None] * (all_reduce_int(max(1, len(parts)), ReduceOp.MAX) - len(parts))
            return parts
        lengths = sequence_lengths(batch.attention_mask)[index]
        count = all_reduce_int(max(1, len(pack_by_token_budget(lengths, budget, max_rows))), ReduceOp.MAX)
        runs = pack_by_token_budget(lengths, budget, max_rows, min(count, len(index)))
        return [index[run] for run in runs] + [None] * (count - len(runs))

    def _finish_minibatch(self, batch: RolloutBatch, stats: StepStats, timings: dict[str, float],
                          losses: LossCheck, with_reward: bool) -> None:
        """The reward model's online loss (first minibatch only, piece by piece), then the optimizer step — unless a
        policy or flow loss was not finite: then the step is skipped (on every rank) before ``step_optimizer``'s
        shared gradient clipping would spread one group's NaN gradients into the other's."""
        groups = {"policy", "value"}
        if with_reward and self.reward_model is not None:
            start = time.perf_counter()
            pieces = self.reward_model.end_step(batch)
            for piece in pieces:
                loss = piece()
                losses.note("flow loss", loss)
                self.backward(loss)
            if pieces:
                groups.add("reward")
            timings["time/flow_s"] = time.perf_counter() - start
        stats.close_minibatch()
        raise_if_nonfinite(losses.nonfinite())
        self.step_optimizer(groups)  # the reward model only moves on the minibatch that carried its loss


def _nonfinite(micro: RolloutBatch) -> list[str]:
    """Names of the micro-batch's non-finite quantities (on response tokens), in a fixed order."""
    response = micro.response_mask.bool()
    checks = {"log-probs": micro.old_logprobs, "advantages": micro.advantages, "token rewards": micro.token_rewards}
    return [name for name, values in checks.items() if values is not None and not bool(torch.isfinite(values[response]).all())]


class LossCheck:
    """Which of a minibatch's losses (by name: policy, flow) were not finite. The flags stay on the losses' device
    until :meth:`nonfinite` reads them once, before the optimizer step (no device sync per micro-batch)."""

    def __init__(self):
        self._finite: dict[str, Tensor] = {}

    def note(self, name: str, loss: Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()
        self._finite[name] = finite if name not in self._finite else self._finite[name] & finite

    def nonfinite(self) -> list[str]:
        return [name for name, finite in self._finite.items() if not bool(finite)]


# An optimizer parameter group → what the user calls it.
GROUP_NAMES = {"policy": "policy", "value": "value head", "reward": "flow"}


def nonfinite_groups(param_groups: list[dict[str, Any]], groups: Collection[str], what: str) -> list[str]:
    """``"<group> <what>"`` for each of an optimizer's ``param_groups`` named in ``groups`` whose gradients
    (``what="gradients"``) or weights (``"weights"``) hold a non-finite value; a ZeRO-3 parameter is checked through
    this rank's shard. A parameter without a gradient (DeepSpeed keeps them in its own partitions) is not checked."""
    bad = []
    for group in param_groups:
        if group.get("name") not in groups:
            continue
        if what == "gradients":
            tensors = [p.grad for p in group["params"] if p.grad is not None]
        else:
            tensors = [getattr(p, "ds_tensor", p) for p in group["params"]]
        checks = [torch.isfinite(t).all() for t in tensors if t.numel()]
        if checks and not bool(torch.stack(checks).all()):
            bad.append(f"{GROUP_NAMES.get(group['name'], group['name'])} {what}")
    return bad


def raise_if_nonfinite(bad: list[str]) -> None:
    """Ranks skip a step together: one that skipped alone would leave the others waiting in a collective (ZeRO's
    gradient reduction, the next forward's parameter gathering). Every rank checks at the same points of the step."""
    if all_reduce_int(int(bool(bad)), ReduceOp.MAX):
        raise NonFiniteStep(bad or ["values on another rank"])
