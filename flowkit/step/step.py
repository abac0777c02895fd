"""One RL step: rollout → outcome rewards → token rewards from the reward model → advantages → micro-batched update.

Plain PyTorch (no Lightning). What depends on the training strategy enters as callables: ``backward(loss)`` (one of
the step's several backward passes) and ``step_optimizer(groups)`` (clip, move the named parameter groups, zero the
gradients). Memory is set by ``micro_batch_size`` or ``micro_batch_tokens``, not by the batch: every pass over the
rollouts runs in micro-batches, the reward model scores each micro-batch right after its forward, and the loss of
every micro-batch is its share of the whole minibatch's, so results do not depend on the micro-batch size. With a
token budget the step's rows are put longest first and packed into runs of consecutive rows
(:mod:`flowkit.step.micro_batches`); minibatches keep the rows they would have had.

Multi-rank rule (docs/design.md): every forward/backward is a collective under DDP and ZeRO, so the number of
minibatches, of micro-batches and of loss pieces agrees over ranks before the first one runs — also when ranks hold
different numbers of rows (dynamic sampling keeps its own groups on each rank); a rank with fewer runs padding
micro-batches (one row through every module a real one reaches, zero loss), and ranks decide to skip a step
together.

Finite state: a non-finite quantity (logits, rewards, advantages, the policy or the flow loss, the gradients of a
parameter group) skips the step before the optimizer moves anything (:class:`NonFiniteStep`, agreed over ranks);
:func:`nonfinite_groups` also lets the caller check the gradients before clipping and the weights after the step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from flowkit.batch import RolloutBatch, pad_columns
from flowkit.distributed import all_reduce_int
from flowkit.step.actor import Actor, ActorOutput
from flowkit.step.micro_batches import longest_first, pack_by_token_budget, sequence_lengths
from flowkit.step.options import AdvantageOptions, SamplingControls, UpdateOptions
from flowkit.step.stats import StepStats
from flowkit.llm.engines import RolloutEngine
from flowkit.options import registry_entry
from flowkit.rewards.base import (
    LearnsOnline, PadsScoring, ReportsMetrics, StepScorer, TokenRewardModel, check_step_scorer, check_token_rewards,
)
from flowkit.rl.advantages import ESTIMATORS, AdvantageInputs, entropy_shaped_advantages, whitened
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
        rollout: the rollout engine (:class:`~flowkit.llm.engines.RolloutEngine`).
        reward_model: dense token rewards (and an online loss), or None.
        grade: fills ``outcome_rewards`` and ``correct`` of a generated batch.
        advantage, update: option groups; ``num_samples``: responses per prompt.
        backward, step_optimizer: see the module docstring.
        controls: DAPO's sampling controls (:class:`~flowkit.step.options.SamplingControls`).
        draw_prompts: ``draw_prompts(step, draw)`` → (prompts, answers, columns) of dynamic sampling's extra draw
            ``draw`` ≥ 1 of step ``step`` (a pure function of both, so a resumed run draws the same).
    """

    def __init__(self, actor: Actor, rollout: RolloutEngine, reward_model: TokenRewardModel | None,
                 grade: Callable[[RolloutBatch], RolloutBatch], advantage: AdvantageOptions, update: UpdateOptions,
                 num_samples: int, backward: Callable[[Tensor], None],
                 step_optimizer: Callable[[Collection[str]], None], controls: SamplingControls = SamplingControls(),
                 draw_prompts: Callable[[int, int], tuple[list[str], list[str], dict[str, list]]] | None = None):
        self.actor, self.rollout, self.reward_model, self.grade = actor, rollout, reward_model, grade
        self.advantage, self.update, self.num_samples = advantage, update, num_samples
        self.backward, self.step_optimizer = backward, step_optimizer
        self.controls, self.draw_prompts = controls, draw_prompts
        self.estimator, self.estimator_context = registry_entry(ESTIMATORS, advantage.estimator), advantage.context()

    def __call__(self, prompts: list[str], answers: list[str], step: int,
                 columns: dict[str, list] | None = None) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """Generate, score and train on one prompt batch (``columns``: the data's other fields, one value per prompt,
        which the reward model reads from ``RolloutBatch.columns``); returns the batch (with rewards, token rewards,
        entropies; longest row first under ``micro_batch_tokens``) and the step's statistics, timings and step scorer's
        metrics. Raises
        :class:`NonFiniteStep`."""
        timings = {"time/generate_s": 0.0}
        batch = self._generated(prompts, answers, columns, timings)
        control_stats: dict[str, float] = {}
        if self.controls.dynamic_sampling_max_draws is not None:
            batch = self._dynamic_sampling(batch, step, timings, control_stats)
        in_loss = self._apply_length_controls(batch, control_stats)
        order = None  # the generated row at each position of the batch, when reordered
        if self.update.micro_batch_tokens is not None:  # every micro-batch a run of consecutive rows (a reward model's)
            order = longest_first(sequence_lengths(batch.attention_mask))
            batch = batch.select(order)
            in_loss = None if in_loss is None else in_loss[order]
        outcome = self.estimator.outcome(batch.outcome_rewards, batch.group_ids, self.estimator_context)
        scorer = None if self.reward_model is None else check_step_scorer(self.reward_model,
                                                                           self.reward_model.begin_step(step, batch))
        batch.entropy = torch.full((batch.batch_size,), float("nan"), device=batch.input_ids.device)  # NaN: not run
        frozen = self.reward_model is not None and self.reward_model.freezes_policy(step)
        fused = self._fused() and not frozen
        if not fused:
            score_start = time.perf_counter()
            self._score(batch, outcome, scorer)
            timings["time/score_s"] = time.perf_counter() - score_start
        update_start = time.perf_counter()
        stats = (self._reward_model_only(batch, timings, scorer) if frozen
                 else self._update(batch, outcome, fused, timings, order, in_loss, scorer))
        timings["time/update_s"] = time.perf_counter() - update_start - timings.get("time/reward_model_s", 0.0)
        return batch, {**timings, **control_stats, **stats, **_reward_model_metrics(scorer)}

    # ------------------------------------------------------------------------------------------ sampling controls
    def _generated(self, prompts: list[str], answers: list[str], columns: dict[str, list] | None,
                   timings: dict[str, float]) -> RolloutBatch:
        """``num_samples`` responses per prompt, graded (the generation time added to ``timings``)."""
        start = time.perf_counter()
        batch = self.rollout.generate(prompts, self.num_samples, answers)
        batch.columns = {key: [value for value in values for _ in range(self.num_samples)]  # rows are prompt-major
                         for key, values in (columns or {}).items()}
        timings["time/generate_s"] += time.perf_counter() - start
        raise_if_nonfinite(["generation logits"] if self.rollout.saw_nonfinite_logits else [])
        return self.grade(batch)

    def _dynamic_sampling(self, batch: RolloutBatch, step: int, timings: dict[str, float],
                          stats: dict[str, float]) -> RolloutBatch:
        """DAPO's dynamic sampling: keep the groups whose raw outcomes differ, draw more prompts until as many groups
        as the step's prompts are kept on every rank (or ``max_draws`` generations ran: every rank draws as often,
        each draw being a collective under ZeRO-3), then keep the first that many. A rank that kept no group trains
        on its first draw as it came (all its outcome advantages are 0)."""
        if self.draw_prompts is None:
            raise ValueError("dynamic sampling needs RLStep.draw_prompts (a source of extra prompt batches)")
        target = int(batch.group_ids.unique().numel())
        first, parts, drawn, kept, draws = batch, [], 0, 0, 0
        while True:
            parts.append(batch.select(_informative_rows(batch)))
            drawn += int(batch.group_ids.unique().numel())
            kept += int(parts[-1].group_ids.unique().numel())
            draws += 1
            if draws >= self.controls.dynamic_sampling_max_draws or all_reduce_int(kept, ReduceOp.MIN) >= target:
                break
            next_id = int(batch.group_ids.max()) + 1
            batch = self._generated(*self.draw_prompts(step, draws), timings)
            batch.group_ids = batch.group_ids + next_id  # groups of every draw stay apart
        stats.update({"train/groups_drawn": float(drawn), "train/groups_kept": float(min(kept, target)),
                      "train/sampling_draws": float(draws), "train/zero_advantage_group_frac": 1.0 - kept / drawn})
        if kept == 0:
            return first
        batch = RolloutBatch.cat([part for part in parts if part.batch_size])
        if kept > target:  # the first ``target`` kept groups, in the order they were drawn (rows are prompt-major)
            batch = batch.select(torch.isin(batch.group_ids, torch.unique_consecutive(batch.group_ids)[:target]))
        return batch

    def _apply_length_controls(self, batch: RolloutBatch, stats: dict[str, float]) -> Tensor | None:
        """``overlong_buffer``: DAPO eq. 13's penalty added to the outcome rewards (after dynamic sampling read
        the raw ones); ``mask_truncated``: the B float rows that stay in the policy loss (None: all). Logs the
        truncated fraction when any control is on."""
        controls = self.controls
        if not controls.active:
            return None
        truncated = self._truncated(batch)
        stats["train/truncated_frac"] = float(truncated.float().mean())
        if "train/zero_advantage_group_frac" not in stats:
            drawn = int(batch.group_ids.unique().numel())
            kept = int(batch.group_ids[_informative_rows(batch)].unique().numel())
            stats["train/zero_advantage_group_frac"] = 1.0 - kept / max(1, drawn)
        if controls.overlong_buffer_length is not None:
            batch.outcome_rewards = batch.outcome_rewards.float() + overlong_penalty(
                batch.response_lengths, self.actor.options.max_new_tokens, controls.overlong_buffer_length,
                controls.overlong_penalty)
        return (~truncated).float() if controls.mask_truncated else None

    def _truncated(self, batch: RolloutBatch) -> Tensor:
        """B bool: responses without an EOS token (cut at ``max_new_tokens``; without an EOS id: that long)."""
        eos = self.rollout.tokenizer.eos_token_id
        if eos is None:
            return batch.response_lengths >= self.actor.options.max_new_tokens
        return ~((batch.input_ids == eos) & batch.response_mask.bool()).any(-1)

    def _fused(self) -> bool:
        """On-policy (one update) with nothing computed over the whole batch first: the training forward is also the
        scoring pass (no separate no-grad forward)."""
        return self.update.updates == 1 and not self.estimator.whiten

    # ------------------------------------------------------------------------------------------ scoring
    def _fill(self, micro: RolloutBatch, rows: Tensor, out: ActorOutput, outcome: Tensor, batch: RolloutBatch,
              scorer: StepScorer | None) -> None:
        """What the update needs of a micro-batch, right after its forward: old log-probs (the forward's, detached),
        entropies, reference log-probs, token rewards (the reward model reads the latents, then they go), values and
        advantages."""
        micro.old_logprobs = out.logprobs.detach()
        mask = micro.response_mask
        micro.entropy = batch.entropy[rows] = (out.entropy.detach() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        if self.actor.reference is not None:
            micro.ref_logprobs = self.actor.reference_logprobs(micro)
        if scorer is not None:
            micro.latents, micro.token_entropy = out.latents, out.entropy.detach()
            micro.token_rewards = check_token_rewards(type(scorer).__name__, scorer.score(micro, rows), micro)
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
        micro.advantages, micro.returns = self.estimator.tokens(inputs, self.estimator_context)
        if self.advantage.entropy_alpha > 0:
            micro.advantages = entropy_shaped_advantages(micro.advantages, out.entropy, mask,
                                                         self.advantage.entropy_alpha, self.advantage.entropy_kappa)

    @torch.no_grad()
    def _score(self, batch: RolloutBatch, outcome: Tensor, scorer: StepScorer | None) -> None:
        """A no-grad pass in micro-batches fixing old log-probs, token rewards, values and advantages for every row
        (before updates that change the policy: μ > 1, several minibatches, or a batch-wide whitening)."""
        length = batch.input_ids.shape[1]
        names = ["old_logprobs", "ref_logprobs", "old_values", "advantages", "returns"]
        parts: dict[str, list[Tensor]] = {name: [] for name in names}
        for rows in self._micro_batches(batch):  # runs of consecutive rows, in order
            if rows is None:
                self._padding(batch, scorer, scoring=True)
                raise_if_nonfinite([])  # the other ranks check their micro-batch here
                continue
            micro = batch.select(rows).trimmed()
            self._fill(micro, rows, self.actor.forward(micro, tap=True), outcome, batch, scorer)
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
                order: Tensor | None, in_loss: Tensor | None, scorer: StepScorer | None) -> dict[str, Tensor]:
        """``ppo_epochs`` passes × ``num_minibatches`` minibatches, each micro-batched and ended by one optimizer step;
        ``fused``: one pass whose forward also scores (old log-probs = its own, detached: ρ = 1 with gradient ∇logπ).
        A minibatch holds the same generated rows whatever ``order`` the batch is in; there are ``num_minibatches``
        of them on every rank whatever its rows (sizes differing by at most one; a rank with fewer rows than
        minibatches has empty ones, which run padding micro-batches). ``in_loss`` (B float): rows outside the policy
        loss and its normalisation (``mask_truncated``) are 0."""
        stats = StepStats()
        position = torch.arange(batch.batch_size) if order is None else torch.argsort(order)
        minibatches = [position[rows].sort().values for _ in range(self.update.ppo_epochs)
                       for rows in torch.arange(batch.batch_size).tensor_split(self.update.num_minibatches)]
        for index, minibatch_rows in enumerate(minibatches):
            mini = batch if fused else batch.select(minibatch_rows)
            options = self.actor.options
            mini_in_loss = None if in_loss is None else in_loss if fused else in_loss[minibatch_rows]
            loss_mask = mini.response_mask if mini_in_loss is None else mini.response_mask * mini_in_loss[:, None]
            denominator = aggregation_denominator(loss_mask, options.aggregation, options.max_new_tokens)
            tokens = loss_mask.sum().clamp(min=1)
            losses = LossCheck()
            for rows in self._micro_batches(mini, self._rows_with_gradient(mini, outcome, fused)):
                if rows is None:
                    loss = self._padding(batch, scorer, scoring=fused)
                    if fused:
                        raise_if_nonfinite([])  # the other ranks check their micro-batch here
                    losses.note("policy loss", loss)  # 0 × the outputs: NaN when the weights are
                    self.backward(loss)
                    continue
                micro = mini.select(rows).trimmed()
                out = self.actor.forward(micro, tap=fused)
                if fused:
                    self._fill(micro, rows, out, outcome, batch, scorer)
                    raise_if_nonfinite(_nonfinite(micro))
                if mini_in_loss is not None:
                    micro = dataclasses.replace(micro, response_mask=micro.response_mask * mini_in_loss[rows, None])
                loss = self.actor.loss(micro, out, denominator, tokens, stats)
                losses.note("policy loss", loss)
                self.backward(loss)
            self._finish_minibatch(batch, stats, timings, losses, scorer if index == 0 else None)
        return stats.means()

    def _reward_model_only(self, batch: RolloutBatch, timings: dict[str, float],
                           scorer: StepScorer | None) -> dict[str, Tensor]:
        """A step whose policy is frozen (:meth:`TokenRewardModel.freezes_policy`, e.g. the flow's warm-up): the
        scoring pass ran, the reward model's online loss is backpropagated and only its group moves (every rank
        alike: the step index decides)."""
        stats = StepStats()
        self._finish_minibatch(batch, stats, timings, LossCheck(), scorer, policy_groups=())
        return stats.means()

    def _padding(self, batch: RolloutBatch, scorer: StepScorer | None, scoring: bool) -> Tensor:
        """A padding micro-batch (another rank runs a real one here): the step's first row through every module a
        real micro-batch of the pass reaches — the policy (and value head); in a ``scoring`` pass also the KL
        reference and the step scorer (:class:`~flowkit.rewards.base.PadsScoring`) — each a collective under
        ZeRO-3. Returns the zero loss to backpropagate (a no-grad pass drops it)."""
        row = batch.select([0]).trimmed()
        out = self.actor.forward(row, tap=scoring and scorer is not None)
        if scoring and self.actor.reference is not None:
            self.actor.reference_logprobs(row)
        if scoring and isinstance(scorer, PadsScoring):
            row.latents, row.token_entropy = out.latents, out.entropy.detach()
            scorer.pad(row)
        return self.actor.padding_loss(out)

    def _rows_with_gradient(self, mini: RolloutBatch, outcome: Tensor, fused: bool) -> Tensor | None:
        """``skip_zero_advantage_rows``: the rows whose advantages are not all 0 (None: every row runs). The policy
        loss of a token is proportional to its advantage, so such a row adds nothing — unless a KL, value or entropy
        term, or a reward model that must see every row, also reads it."""
        if (not self.update.skip_zero_advantage_rows or self.actor.reference is not None
                or self.actor.value_head is not None or (fused and self.reward_model is not None)
                or self.actor.options.entropy_coef > 0):
            return None
        nonzero = (outcome if fused else mini.advantages * mini.response_mask).ne(0)
        return nonzero if fused else nonzero.any(-1)

    def _micro_batches(self, batch: RolloutBatch, keep: Tensor | None = None) -> list[Tensor | None]:
        """Row indices of each micro-batch of ``batch``, in order: ``micro_batch_size`` rows each, or with
        ``micro_batch_tokens`` (the rows come longest first) runs of rows packed under the token budget
        (:func:`~flowkit.step.micro_batches.pack_by_token_budget`, at most ``micro_batch_size`` rows when that is
        set too; a rank splits its runs until it has as many as the rank that packs the most, or one row each).
        With ``keep`` (a bool per row), only the kept rows. Every rank runs as many micro-batches as the rank with
        the most (at least one): a rank with fewer (fewer rows, kept or held) adds ``None`` entries (padding
        micro-batches). Counts are agreed before the first micro-batch runs."""
        index = torch.arange(batch.batch_size) if keep is None else keep.cpu().nonzero().flatten()
        budget, max_rows = self.update.micro_batch_tokens, self.update.micro_batch_size
        if budget is None:
            parts: list[Tensor | None] = list(index.split(max_rows or batch.batch_size)) if len(index) else []
            return parts + [None] * (all_reduce_int(max(1, len(parts)), ReduceOp.MAX) - len(parts))
        lengths = sequence_lengths(batch.attention_mask)[index]
        count = all_reduce_int(max(1, len(pack_by_token_budget(lengths, budget, max_rows))), ReduceOp.MAX)
        runs = pack_by_token_budget(lengths, budget, max_rows, min(count, len(index)))
        return [index[run] for run in runs] + [None] * (count - len(runs))

    def _finish_minibatch(self, batch: RolloutBatch, stats: StepStats, timings: dict[str, float],
                          losses: LossCheck, scorer: StepScorer | None,
                          policy_groups: Collection[str] = ("policy", "value")) -> None:
        """The step scorer's online loss (``scorer`` is given on the first minibatch only; piece by piece), then the
        optimizer step of ``policy_groups`` (and the reward model's) — unless a policy or flow loss was not finite:
        then the step is skipped (on every rank) before ``step_optimizer``'s shared gradient clipping would spread one
        group's NaN gradients into the other's."""
        groups = set(policy_groups)
        if isinstance(scorer, LearnsOnline):
            start = time.perf_counter()
            pieces = scorer.end_step(batch)
            for piece in pieces:
                loss = piece()
                losses.note("flow loss", loss)
                self.backward(loss)
            if pieces:
                groups.add("reward")
            timings["time/reward_model_s"] = time.perf_counter() - start
        stats.close_minibatch()
        raise_if_nonfinite(losses.nonfinite())
        self.step_optimizer(groups)  # the reward model only moves on the minibatch that carried its loss


def _reward_model_metrics(scorer: StepScorer | None) -> dict[str, float]:
    """The step scorer's own scalars; a key without a prefix gets ``reward_model/`` (``flowkit plot`` draws them)."""
    if not isinstance(scorer, ReportsMetrics):
        return {}
    return {key if "/" in key else f"reward_model/{key}": value for key, value in scorer.metrics().items()}


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
