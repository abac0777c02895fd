"""FlowReward inside an RL step: micro-batch invariance of rewards and of the online loss, and the update cadence."""

from __future__ import annotations

import pytest
import torch

from flowkit.batch import RolloutBatch
from flowkit.rewards import FlowReward
from flow_options import flow_reward
from flowkit.rewards.flow.online import FlowStep
from backbone_stub import backbone_stub

P, D = 2, 8


def scored_batch(rows: int, generator: torch.Generator) -> RolloutBatch:
    """Rows with random latents and responses of different lengths; every other row is correct."""
    length = 7
    mask = torch.zeros(rows, length)
    for r in range(rows):
        mask[r, 2:2 + 2 + r % 4] = 1.0
    batch = RolloutBatch(input_ids=torch.zeros(rows, length, dtype=torch.long), attention_mask=torch.ones(rows, length),
                         response_mask=mask, group_ids=torch.arange(rows))
    batch.latents = torch.randn(P, rows, length, D, generator=generator)
    batch.correct = torch.arange(rows) % 2 == 0
    batch.entropy = torch.rand(rows, generator=generator)
    return batch


def bound_reward(**options) -> FlowReward:
    reward = flow_reward(percentiles=(0.25, 0.5), depth=1, seed=5, **options)
    reward.bind(backbone_stub(D), [0.25, 0.5])
    return reward


def in_micro_batches(reward: FlowReward, batch: RolloutBatch, size: int,
                     step: int = 3) -> tuple[FlowStep, torch.Tensor]:
    """What the RL step does: begin the step, then score micro-batch after micro-batch; the step's scorer and the
    rewards."""
    scorer = reward.begin_step(step, batch)
    parts = []
    for start in range(0, batch.batch_size, size):
        rows = torch.arange(start, min(start + size, batch.batch_size))
        parts.append(scorer.score(batch.select(rows), rows))
    return scorer, torch.cat(parts)


@pytest.mark.parametrize("metric", ["correct", "entropy"])
def test_rewards_and_flow_loss_do_not_depend_on_micro_batches_or_pieces(metric):
    """Micro-batches of the step (token rewards) and row budgets of the online loss's pieces change nothing."""
    batch = scored_batch(6, torch.Generator().manual_seed(0))
    results = {}
    for size, rows_per_piece in ((1, 2), (4, 7), (6, None)):
        reward = bound_reward(kappa=1, rejection_metric=metric, noise_draws=2, max_rows_per_piece=rows_per_piece)
        scorer, rewards = in_micro_batches(reward, batch, size)
        pieces = scorer.end_step(batch)
        loss = sum(piece() for piece in pieces)
        grads = torch.autograd.grad(loss, list(reward.parameters()), allow_unused=True)
        metrics = scorer.metrics()
        accepted = torch.arange(6)[accept(metric, batch)]
        tokens = int(reward.scored_token_counts(batch.response_mask[accepted]).sum())
        # a piece holds ⌊rows / (P·T)⌋ tokens (P = 2 layers, T = 1 timestep), at least one
        per_piece = tokens if rows_per_piece is None else max(1, rows_per_piece // P)
        assert len(pieces) == -(-tokens // per_piece)
        assert metrics["flow/loss"] == pytest.approx(float(loss))
        results[size] = (rewards, float(loss), grads)
    rewards, loss, grads = results[6]
    assert (rewards < 0).any()
    for size in (1, 4):
        torch.testing.assert_close(results[size][0], rewards, rtol=1e-5, atol=1e-7)
        assert results[size][1] == pytest.approx(loss, rel=1e-5)
        for got, want in zip(results[size][2], grads):
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def accept(metric: str, batch: RolloutBatch) -> torch.Tensor:
    from flowkit.rewards.flow.rejection import accept_rollouts

    return accept_rollouts(metric, batch.correct, batch.entropy)


def test_only_the_accepted_rollouts_latents_are_kept_on_cpu():
    batch = scored_batch(6, torch.Generator().manual_seed(1))
    reward = bound_reward(kappa=100, rejection_metric="correct")
    scorer, _ = in_micro_batches(reward, batch, 2)
    assert [candidate.row for candidate in scorer.candidates] == [0, 2, 4]
    assert all(candidate.latents.device.type == "cpu" for candidate in scorer.candidates)
    assert scorer.end_step(batch) == []
    assert len(reward.buffer) == 3 and not scorer.candidates


def test_kappa_cadence_waits_and_every_step_cadence_does_not():
    generator = torch.Generator().manual_seed(2)
    buffered, every_step = bound_reward(kappa=5), bound_reward(kappa=5, update_every_step=True)
    taken = {"buffered": [], "every_step": []}
    for step in range(3):
        batch = scored_batch(4, generator)  # 2 correct rollouts per step
        for name, reward in (("buffered", buffered), ("every_step", every_step)):
            scorer, _ = in_micro_batches(reward, batch, 4, step)
            taken[name].append(len(scorer.end_step(batch)) > 0)
    assert taken["buffered"] == [False, False, True]  # 2, 4, 6 ≥ κ = 5: one flow step on all 6
    assert taken["every_step"] == [True, True, True]
    assert len(buffered.buffer) == 0 and len(every_step.buffer) == 0
