import math

import pytest
import torch

from flowkit.rbrl import sac

INF = float("inf")


def test_soft_q_target_hand_computed_with_padding():
    # π(s') = (0.25, 0.75, pad); min Q = (1, 1); α = 0.5, γ = 0.9, r = 1
    next_log_pi = torch.tensor([[math.log(0.25), math.log(0.75), -INF]] * 2)
    q1 = torch.tensor([[1.0, 2.0, 99.0]] * 2)
    q2 = torch.tensor([[2.0, 1.0, -99.0]] * 2)
    mask = torch.tensor([[True, True, False]] * 2)
    value = 1.0 - 0.5 * (0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # 1.281167
    target = sac.soft_q_target(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]), next_log_pi, q1, q2, mask, 0.5, 0.9)
    torch.testing.assert_close(target, torch.tensor([1.0 + 0.9 * value, 1.0]))
    assert target[0].item() == pytest.approx(2.153051, abs=1e-6)


def test_critic_loss_hand_computed():
    q1 = torch.tensor([[0.5, 3.0], [1.0, 0.0]])
    q2 = torch.tensor([[1.0, 2.0], [4.0, 2.0]])
    action = torch.tensor([1, 0])
    target = torch.tensor([2.0, 3.0])
    # Q1: (3−2)², (1−3)² → mean 2.5; Q2: (2−2)², (4−3)² → mean 0.5
    assert sac.critic_loss(q1, q2, action, target).item() == pytest.approx(3.0)


def test_actor_loss_hand_computed_and_gradient_only_through_policy():
    logits = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    log_pi = torch.log_softmax(logits.masked_fill(~mask, -INF), -1)
    q1 = torch.tensor([[1.0, 3.0, 50.0]], requires_grad=True)
    q2 = torch.tensor([[2.0, 2.0, 50.0]])
    loss = sac.actor_loss(log_pi, q1, q2, mask, 0.5)
    # Σ 0.5 (0.5 ln 0.5 − minQ) over minQ = (1, 2)
    assert loss.item() == pytest.approx(0.5 * math.log(0.5) - 1.5, abs=1e-6)
    loss.backward()
    assert q1.grad is None and logits.grad is not None and logits.grad[0, 2] == 0


def test_temperature_loss_hand_computed_and_direction():
    log_alpha = torch.tensor(math.log(0.5), requires_grad=True)
    log_pi = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    mask = torch.tensor([[True, True, False]])
    loss = sac.temperature_loss(log_alpha, log_pi, mask, ratio=0.5)
    gap = math.log(2) - 0.5 * math.log(2)  # entropy above target
    assert loss.item() == pytest.approx(math.log(0.5) * gap, abs=1e-6)
    loss.backward()
    assert log_alpha.grad.item() == pytest.approx(gap)  # > 0: a descent step lowers α
    torch.testing.assert_close(sac.entropy(log_pi, mask), torch.tensor([math.log(2)]))


def test_soft_update_is_polyak_average():
    target, source = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    torch.nn.init.zeros_(target.weight), torch.nn.init.ones_(source.weight)
    sac.soft_update(target, source, tau=0.1)
    torch.testing.assert_close(target.weight, torch.full((1, 2), 0.1))


def test_padded_rules_give_finite_gradients():
    logits = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    log_pi = torch.log_softmax(logits.masked_fill(~mask, -INF), -1)
    q = torch.randn(2, 4)
    log_alpha = torch.zeros((), requires_grad=True)
    loss = sac.actor_loss(log_pi, q, q, mask, 0.3) + sac.temperature_loss(log_alpha, log_pi, mask, 0.5)
    loss = loss + sac.soft_q_target(torch.zeros(2), torch.zeros(2), log_pi, q, q, mask, 0.3, 0.9).sum()
    loss.backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[~mask] == 0).all()
