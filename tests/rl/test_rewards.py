import torch

from flowkit.rl.rewards import flow_token_rewards, keep_substantial, minmax_normalize


def test_minmax_by_hand():
    scores = torch.tensor([[1.0, 3.0, 2.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert torch.allclose(minmax_normalize(scores, mask), torch.tensor([[0.0, 1.0, 0.5, 0.0]]))


def test_minmax_constant_row_is_zero_not_nan():
    scores = torch.tensor([[2.0, 2.0, 2.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # a constant row and a single-token row
    out = minmax_normalize(scores, mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.zeros_like(out))


def test_threshold_keeps_only_values_above_eta():
    normalized = torch.tensor([[0.0, 0.6, 0.61, 1.0]])
    assert torch.allclose(keep_substantial(normalized, eta=0.6), torch.tensor([[0.0, 0.0, 0.61, 1.0]]))


def test_top_k_applies_only_to_rows_with_enough_survivors():
    normalized = torch.tensor([[0.7, 0.9, 0.8, 1.0, 0.1], [0.7, 0.0, 0.0, 0.0, 0.9]])
    out = keep_substantial(normalized, eta=0.6, top_k=3)
    # row 0 has 4 survivors → keep the 3 largest; row 1 has 2 (< k) → unchanged
    assert torch.allclose(out[0], torch.tensor([0.0, 0.9, 0.8, 1.0, 0.0]))
    assert torch.allclose(out[1], torch.tensor([0.7, 0.0, 0.0, 0.0, 0.9]))


def test_flow_token_rewards_eq10_by_hand():
    scores = torch.tensor([[0.0, 10.0, 8.0, 2.0]])  # min-max → [0, 1, 0.8, 0.2]
    mask = torch.ones(1, 4)
    rewards = flow_token_rewards(scores, mask, eta=0.6, beta=0.01)
    assert torch.allclose(rewards, torch.tensor([[0.0, -0.01, -0.008, 0.0]]))
