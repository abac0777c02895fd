import torch

from flowkit.rl.advantages import group_normalized_advantage, reward_to_go, rlfr_advantages, token_advantages


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


def test_scale_rewards_group_batch_none_by_hand():
    """TRL's scale_rewards: the centred reward over the group's std, the whole batch's std, or unscaled."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    centered = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])  # group means 0.25 and 0.5
    assert torch.allclose(group_normalized_advantage(rewards, groups, 0.0, "none"), centered)
    batch_std = (1.875 / 7) ** 0.5  # Bessel-corrected std of all 8 rewards (mean 0.375)
    assert torch.allclose(group_normalized_advantage(rewards, groups, 0.0, "batch"), centered / batch_std)
    group_std = torch.tensor([0.5] * 4 + [(1 / 3) ** 0.5] * 4)  # sqrt(0.75/3) and sqrt(1/3)
    assert torch.allclose(group_normalized_advantage(rewards, groups, 0.0, "group"), centered / group_std)


def test_token_advantages_of_micro_batches_equal_the_whole_batch():
    outcome = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    token_rewards = torch.tensor([[0.0, -0.1, -0.2], [0.0, -0.3, 0.0], [-0.1, 0.0, -0.1]])
    whole = token_advantages(outcome, mask, token_rewards)
    assert torch.allclose(whole[0], torch.tensor([0.0, 1.0 - 0.3, 1.0 - 0.2]))
    parts = torch.cat([token_advantages(outcome[r], mask[r], token_rewards[r]) for r in (slice(0, 1), slice(1, 3))])
    assert torch.equal(parts, whole)
