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


def test_official_target_entropy_is_over_the_environment_actions():
    """official: H̄ = 0.89 · log |A| for every state, however many rules it has; flowkit's: 0.89 · log |R_s|."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    torch.testing.assert_close(sac.target_entropy(mask, 0.89, num_actions=9), torch.full((2,), 0.89 * math.log(9)))
    torch.testing.assert_close(sac.target_entropy(mask, 0.89), 0.89 * torch.log(torch.tensor([2.0, 3.0])))
    log_alpha = torch.tensor(0.0, requires_grad=True)
    log_pi = torch.log(torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]))
    # uniform policies: entropy log 2 and log 3, both below 0.89 · log 9 = 1.956 → the gradient raises α
    sac.temperature_loss(log_alpha, log_pi, mask, 0.89, num_actions=9).backward()
    expected = ((math.log(2) - 0.89 * math.log(9)) + (math.log(3) - 0.89 * math.log(9))) / 2
    assert log_alpha.grad.item() == pytest.approx(expected, abs=1e-6) and expected < 0


def test_target_update_is_polyak_average_and_tau_one_a_hard_copy():
    target, source = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    torch.nn.init.zeros_(target.weight), torch.nn.init.ones_(source.weight)
    sac.target_update(target, source, tau=0.1)
    torch.testing.assert_close(target.weight, torch.full((1, 2), 0.1))
    with torch.no_grad():
        source.weight.copy_(torch.tensor([[0.1 + 1e-7, -3.3]]))
    sac.target_update(target, source, tau=1.0)
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)


def test_softmin_blend_hand_computed_and_tends_to_the_min():
    q1, q2 = torch.tensor([1.0, 0.0, 5.0]), torch.tensor([1.1, 0.0, -5.0])
    # weights softmax(−10 · (q1, q2)): (1, 1.1) → 1/(1+e^−1) on q1
    w = 1.0 / (1.0 + math.exp(-1.0))
    expected = torch.tensor([w * 1.0 + (1 - w) * 1.1, 0.0, -5.0])
    torch.testing.assert_close(sac.blend_twin_q(q1, q2, "softmin"), expected)
    torch.testing.assert_close(sac.blend_twin_q(q1, q2, "min"), torch.tensor([1.0, 0.0, -5.0]))
    with pytest.raises(ValueError, match="softmin"):
        sac.blend_twin_q(q1, q2, "mean")


def test_soft_q_target_with_softmin_blend_hand_computed_and_padding_ignored():
    # one state, two real rules π = (0.5, 0.5) and one pad holding huge values that must not matter
    next_log_pi = torch.tensor([[math.log(0.5), math.log(0.5), -INF]])
    q1 = torch.tensor([[1.0, 2.0, 1e9]])
    q2 = torch.tensor([[1.1, 2.0, -1e9]])
    mask = torch.tensor([[True, True, False]])
    w = 1.0 / (1.0 + math.exp(-1.0))
    blended = (w * 1.0 + (1 - w) * 1.1, 2.0)
    value = 0.5 * (blended[0] - 0.1 * math.log(0.5)) + 0.5 * (blended[1] - 0.1 * math.log(0.5))
    target = sac.soft_q_target(torch.tensor([0.5]), torch.tensor([0.0]), next_log_pi, q1, q2, mask, 0.1, 0.95, "softmin")
    assert target.item() == pytest.approx(0.5 + 0.95 * value, abs=1e-6)
    assert torch.isfinite(target).all()


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
