import torch

from flowkit.rl.advantages import group_normalized_advantage, reward_to_go, rlfr_advantages


def test_group_normalized_advantage_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_normalized_advantage(rewards, groups, eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # Bessel-corrected: sqrt(1/3)
    expected = torch.tensor([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert torch.allclose(adv[:4], expected)
    # a group with equal rewards has zero advantage (eps keeps it finite)
    assert torch.equal(group_normalized_advantage(rewards, groups)[4:], torch.zeros(2))


def test_reward_to_go_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 2.0, 4.0, 8.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])  # position 4 is padding: its reward is ignored
    assert torch.allclose(reward_to_go(rewards, mask, gamma=1.0), torch.tensor([[0.0, 7.0, 6.0, 4.0, 0.0]]))
    assert torch.allclose(reward_to_go(rewards, mask, gamma=0.5), torch.tensor([[0.0, 3.0, 4.0, 4.0, 0.0]]))


def test_rlfr_advantage_adds_outcome_and_reward_to_go():
    outcome = torch.tensor([1.0, 0.0])
    groups = torch.tensor([0, 0])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    token_rewards = torch.tensor([[0.0, -0.01, -0.02], [0.0, -0.03, 0.0]])
    adv = rlfr_advantages(outcome, groups, mask, token_rewards, gamma=1.0, eps=0.0)
    a = 0.5 / torch.tensor([1.0, 0.0]).std()
    expected = torch.tensor([[0.0, a - 0.03, a - 0.02], [0.0, -a - 0.03, 0.0]])
    assert torch.allclose(adv, expected)
