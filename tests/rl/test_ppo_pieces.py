"""GAE (over time steps and over token sequences), KL shaping, the clipped value loss and whitening (PPO as TRL runs it)."""

import torch

from flowkit.rl.advantages import gae, sequence_gae, whitened
from flowkit.rl.losses import clipped_value_loss, kl_shaped_rewards


def test_gae_matches_the_recursion_by_hand_and_ignores_padding():
    # Row 0: prompt token then three response tokens; row 1: two response tokens then padding (values 7 ignored).
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.2, 0.1], [0.5, 0.5, 7.0, 7.0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    advantages, returns = sequence_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # δ3 = 2 − 0.1; δ2 = 0.9·0.1 − 0.2; δ1 = 1 + 0.9·0.2 − 0.5; A_t = δ_t + 0.45·A_{t+1}.
    a3 = 1.9
    a2 = -0.11 + 0.45 * a3
    a1 = 0.68 + 0.45 * a2
    b1 = 1 - 0.5
    b0 = 1 + 0.9 * 0.5 - 0.5 + 0.45 * b1
    torch.testing.assert_close(advantages, torch.tensor([[0.0, a1, a2, a3], [b0, b1, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.0, a1 + 0.5, a2 + 0.2, a3 + 0.1], [b0 + 0.5, b1 + 0.5, 0, 0]]))


def test_gae_with_lambda_one_and_zero_values_is_the_reward_to_go():
    rewards = torch.tensor([[0.5, -1.0, 2.0]])
    advantages, _ = sequence_gae(rewards, torch.zeros(1, 3), torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[1.5, 1.0, 2.0]]))


def test_kl_shaping_subtracts_beta_times_the_log_ratio_on_the_response():
    shaped = kl_shaped_rewards(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.0, -1.0, -2.0]]),
                               torch.tensor([[0.0, -1.5, -1.0]]), torch.tensor([[0, 1, 1]]), kl_coef=0.1)
    torch.testing.assert_close(shaped, torch.tensor([[0.0, -0.05, 1.1]]))


def test_value_loss_takes_the_worse_of_clipped_and_unclipped_errors():
    loss = clipped_value_loss(torch.tensor([[1.0, 0.0, 5.0]]), torch.tensor([[0.5, 0.5, 0.0]]),
                              torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0]]), clip=0.2)
    # token 0: max((1 − 2)², (0.7 − 2)²) = 1.69; token 1: max(0², (0.3 − 0)²) = 0.09; token 2 is masked.
    torch.testing.assert_close(loss, torch.tensor(0.5 * (1.69 + 0.09) / 2))


def test_whitened_is_zero_mean_unit_std_on_the_mask():
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    out = whitened(values, mask)
    picked = out[mask.bool()]
    assert abs(picked.mean().item()) < 1e-6 and abs(picked.pow(2).mean().sqrt().item() - 1) < 1e-4
    assert (out[~mask.bool()] == 0).all()


def test_gae_hand_computed_with_an_episode_end():
    # one env, 3 steps, the episode ends at t = 1; γ = 0.5, λ = 0.5
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [1.0], [2.0]])
    dones = torch.tensor([[0.0], [1.0], [0.0]])
    advantages, returns = gae(rewards, values, dones, torch.tensor([4.0]), gamma=0.5, lam=0.5)
    a2 = 3.0 + 0.5 * 4.0 - 2.0  # 3
    a1 = 2.0 - 1.0  # terminal: no bootstrap, no carry-over
    a0 = (1.0 + 0.5 * 1.0 - 0.5) + 0.25 * a1  # 1.25
    torch.testing.assert_close(advantages, torch.tensor([[a0], [a1], [a2]]))
    torch.testing.assert_close(returns, advantages + values)
