"""RLStep on its own (no Lightning, no model): a fake engine, actor, reward model and optimizer record what the step
asks of them, so the order of calls, the micro-batches, the advantages and the optimizer steps are checked directly."""

from __future__ import annotations

import pytest
import torch

from flowkit.batch import RolloutBatch
from flowkit.step import (
    ActorOutput, AdvantageOptions, ExperienceMaker, LossOptions, NonFiniteStep, PolicyUpdate, PromptBatch, RLStep,
    SamplingControls, StepStats, UpdateOptions,
)
from flowkit.rewards.base import RewardModelError, TokenRewardModel

PROMPT, RESPONSE = 2, 3  # columns: left-padded prompt, then the response
SAMPLES = 2


def rollouts(prompts: list[str], n: int) -> RolloutBatch:
    rows = len(prompts) * n
    mask = torch.cat([torch.zeros(rows, PROMPT), torch.ones(rows, RESPONSE)], dim=1)
    return RolloutBatch(input_ids=torch.arange(rows * (PROMPT + RESPONSE)).view(rows, -1) % 7,
                        attention_mask=torch.ones(rows, PROMPT + RESPONSE, dtype=torch.long), response_mask=mask,
                        group_ids=torch.arange(len(prompts)).repeat_interleave(n),
                        prompts=[p for p in prompts for _ in range(n)], responses=["r"] * rows)


class FakeEngine:
    saw_nonfinite_logits = False
    policy_version = 0

    def generate(self, prompts, n=1, answers=None, temperature=None):
        return rollouts(prompts, n)

    def sync_weights(self, model, version):
        self.policy_version = version

    def close(self):
        pass


class FakeActor:
    """Log-probs that depend on one trainable weight; records every forward and the advantages each loss saw."""

    padding_free = False  # padded forwards (Actor.padding_free)

    def __init__(self, loss: LossOptions = LossOptions()):
        self.weight = torch.nn.Parameter(torch.tensor(0.5))
        self.options, self.reference, self.value_head, self.tap = loss, None, None, None
        self.forwards: list[tuple[int, bool]] = []  # (rows, grad enabled)
        self.advantages: list[torch.Tensor] = []
        self.paddings = 0

    def forward(self, batch: RolloutBatch, tap: bool = False, temperature: float | None = None) -> ActorOutput:
        self.forwards.append((batch.batch_size, torch.is_grad_enabled()))
        logprobs = -self.weight * torch.ones(batch.response_mask.shape) * batch.response_mask
        return ActorOutput(logprobs, torch.ones(batch.response_mask.shape))

    def loss(self, micro, out, denominator, tokens, stats: StepStats) -> torch.Tensor:
        self.advantages.append(micro.advantages.detach().clone())
        return -(out.logprobs * micro.advantages).sum() / denominator

    def padding_loss(self, out: ActorOutput) -> torch.Tensor:
        self.paddings += 1
        return out.logprobs.sum() * 0.0


class RecordingReward(TokenRewardModel):
    """−0.1 on every response token; one online-loss piece; records the calls."""

    percentiles = None

    def __init__(self, nonfinite: bool = False):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.calls: list[tuple] = []
        self.nonfinite = nonfinite

    def begin_step(self, step, batch):
        self.calls.append(("begin", step, batch.batch_size))
        return RecordingStep(self)


class RecordingStep:
    """RecordingReward's step scorer: records its calls on the reward model."""

    def __init__(self, reward: RecordingReward):
        self.reward = reward

    def score(self, micro, rows):
        self.reward.calls.append(("score", rows.tolist()))
        rewards = -0.1 * micro.response_mask
        return rewards * float("nan") if self.reward.nonfinite else rewards

    def end_step(self, batch):
        self.reward.calls.append(("end", batch.batch_size))
        return [lambda: self.reward.bias * 0.0 + self.reward.bias.sum()]

    def metrics(self):
        return {"pieces": 1.0}


class RecordingOptimizer:
    """A StepOptimizer recording each backward's loss and each step's groups."""

    def __init__(self):
        self.backwards: list[float] = []
        self.steps: list[list[str]] = []

    def backward(self, loss):
        self.backwards.append(float(loss.detach()))
        loss.backward()

    def nonfinite(self, groups):
        return []

    def step(self, groups):
        self.steps.append(sorted(groups))


def make_step(actor, reward=None, update=UpdateOptions(), advantage=AdvantageOptions(), outcomes=(1.0, 0.0, 0.0, 0.0)):
    optimizer = RecordingOptimizer()

    def grade(batch):
        batch.outcome_rewards = torch.tensor(outcomes[:batch.batch_size])
        batch.correct = batch.outcome_rewards > 0
        return {}

    maker = ExperienceMaker(actor, FakeEngine(), grade, reward, advantage, update, SamplingControls(), SAMPLES)
    step = RLStep(maker, PolicyUpdate(actor, update))
    return (lambda prompts, answers, index: step(PromptBatch(prompts, answers), index, optimizer)), \
        optimizer.backwards, optimizer.steps


def test_on_policy_step_scores_without_gradient_then_trains_and_steps_once(single_thread):
    actor, reward = FakeActor(), RecordingReward()
    step, backwards, steps = make_step(actor, reward, UpdateOptions(micro_batch_size=1))
    batch, stats = step(["a", "b"], ["1", "2"], 5)
    # the scoring pass (no gradient), then the update; one row per micro-batch
    assert actor.forwards == [(1, False)] * 4 + [(1, True)] * 4
    assert reward.calls == [("begin", 5, 4), ("score", [0]), ("score", [1]), ("score", [2]), ("score", [3]), ("end", 4)]
    assert len(backwards) == 5 and steps == [["policy", "reward", "value"]]  # 4 micro-batches + 1 flow piece
    # GRPO: group 0 has outcomes (1, 0) → ±1/(std 0.707 + ε); group 1 (0, 0) → 0; then the token rewards' reward-to-go
    outcome = torch.tensor([0.7071, -0.7071, 0.0, 0.0])
    to_go = torch.tensor([-0.3, -0.2, -0.1])
    for row, seen in enumerate(actor.advantages):
        torch.testing.assert_close(seen[0, PROMPT:], outcome[row] + to_go, atol=1e-4, rtol=0)
    torch.testing.assert_close(batch.token_rewards[:, PROMPT:], torch.full((4, RESPONSE), -0.1))
    assert "time/generate_s" in stats and stats["reward_model/pieces"] == 1.0  # the scorer's metrics, prefixed


def test_a_begin_step_without_a_step_scorer_is_one_line_naming_it(single_thread):
    class NoScorer(RecordingReward):
        def begin_step(self, step, batch):
            return None

    step, backwards, steps = make_step(FakeActor(), NoScorer())
    with pytest.raises(RewardModelError, match=r"^NoScorer\.begin_step must return a step scorer with score\(micro, "
                                               r"rows\) \(flowkit\.rewards\.StepScorer\); it returned a NoneType$"):
        step(["a", "b"], ["1", "2"], 0)
    assert backwards == [] and steps == []


def test_ppo_epochs_and_minibatches_score_first_and_step_per_minibatch(single_thread):
    actor, reward = FakeActor(), RecordingReward()
    step, backwards, steps = make_step(actor, reward, UpdateOptions(ppo_epochs=2, num_minibatches=2, micro_batch_size=2))
    step(["a", "b"], ["1", "2"], 0)
    no_grad = [f for f in actor.forwards if not f[1]]
    assert no_grad == [(2, False), (2, False)]  # the scoring pass, before any update
    assert [f for f in actor.forwards if f[1]] == [(2, True)] * 4  # 2 epochs × 2 minibatches × 1 micro-batch
    # the reward model's loss rides on the first minibatch only, so it moves once per step
    assert steps == [["policy", "reward", "value"], ["policy", "value"], ["policy", "value"], ["policy", "value"]]
    assert [c[0] for c in reward.calls] == ["begin", "score", "score", "end"]


def test_rows_without_advantage_do_not_run_and_an_empty_pass_pads(single_thread):
    actor = FakeActor()
    step, backwards, steps = make_step(actor, None, UpdateOptions(micro_batch_size=1))
    step(["a", "b"], ["1", "2"], 0)
    # no scoring pass (on-policy, no reward model); group 1's rows (equal outcomes) run no training forward
    assert actor.forwards == [(1, True)] * 2
    actor = FakeActor()
    step, backwards, steps = make_step(actor, None, UpdateOptions(micro_batch_size=1), outcomes=(0.0, 0.0, 1.0, 1.0))
    step(["a", "b"], ["1", "2"], 0)
    # no row has an advantage: one padding micro-batch (a forward of one row, zero loss)
    assert actor.forwards == [(1, True)] and actor.paddings == 1 and steps == [["policy", "value"]]


def test_non_finite_token_rewards_stop_the_step_before_any_optimizer_step(single_thread):
    actor = FakeActor()
    step, backwards, steps = make_step(actor, RecordingReward(nonfinite=True), UpdateOptions(micro_batch_size=2))
    with pytest.raises(NonFiniteStep, match="token rewards"):
        step(["a", "b"], ["1", "2"], 0)
    assert steps == []


def test_rloo_step_hands_each_row_its_leave_one_out_advantage(single_thread):
    """Groups of 2 with outcomes (1, 0) and (0, 0): RLOO gives 1 − 0 and 0 − 1, then 0 and 0 (skipped rows); with
    the reward model's −0.1 per token, the reward-to-go is added as for GRPO."""
    actor, reward = FakeActor(), RecordingReward()
    step, _, _ = make_step(actor, reward, UpdateOptions(micro_batch_size=1), AdvantageOptions(estimator="rloo"))
    step(["a", "b"], ["1", "2"], 0)
    outcome = torch.tensor([1.0, -1.0, 0.0, 0.0])
    to_go = torch.tensor([-0.3, -0.2, -0.1])
    assert len(actor.advantages) == 4  # the token rewards give every row an advantage: none is skipped
    for row, seen in enumerate(actor.advantages):
        torch.testing.assert_close(seen[0, PROMPT:], outcome[row] + to_go)
