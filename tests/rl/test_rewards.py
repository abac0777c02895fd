import pytest
import torch

from flowkit.rewards.flow.scoring import flow_token_rewards, keep_substantial, minmax_normalize, normalize_scores


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


def test_top_k_keeps_exactly_k_on_ties():
    """Official: exactly k tokens (flowkit used to keep every tie: 42 instead of 15); earliest ties first."""
    normalized = torch.zeros(1, 50)
    normalized[0, 5:47] = 1.0  # 42 tokens tied at the maximum
    out = keep_substantial(normalized, eta=0.6, top_k=15)
    assert out.count_nonzero() == 15
    assert out[0].nonzero().flatten().tolist() == list(range(5, 20))


def test_bilateral_reward_by_hand():
    """Paper eq. 10: r̂ = 2·minmax − 1 ∈ [−1, 1], keep |r̂| > η; low-deviation tokens earn a bonus."""
    scores = torch.tensor([[0.0, 10.0, 9.0, 1.0, 5.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])  # the last position is padding
    assert torch.allclose(normalize_scores(scores, mask, "bilateral"), torch.tensor([[-1.0, 1.0, 0.8, -0.8, 0.0, 0.0]]))
    rewards = flow_token_rewards(scores, mask, eta=0.6, beta=0.01, normalization="bilateral")
    assert torch.allclose(rewards, torch.tensor([[0.01, -0.01, -0.008, 0.008, 0.0, 0.0]]))


def test_mean_normalization_by_hand():
    """Official ``mean``: minmax minus its row mean over scored tokens, then |r̂| > η."""
    scores = torch.tensor([[0.0, 10.0, 9.0, 1.0, 5.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    # minmax [0, 1, .9, .1, .5] has mean 0.5
    assert torch.allclose(normalize_scores(scores, mask, "mean"), torch.tensor([[-0.5, 0.5, 0.4, -0.4, 0.0, 0.0]]))
    rewards = flow_token_rewards(scores, mask, eta=0.45, beta=0.01, normalization="mean")
    assert torch.allclose(rewards, torch.tensor([[0.005, -0.005, 0.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("normalization", ["minmax", "bilateral", "mean"])
def test_constant_rows_give_zero_in_every_normalization(normalization):
    scores = torch.tensor([[2.0, 2.0, 2.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = normalize_scores(scores, mask, normalization)
    assert torch.equal(out, torch.zeros_like(out))


def test_bilateral_top_k_splits_k_per_side():
    """Two-sided top-k: ⌊k/2⌋ largest positive and ⌊k/2⌋ most negative survivors (official split)."""
    normalized = torch.tensor([[0.9, -0.95, 0.8, -0.7, 0.7, -0.65, 0.1],
                               [0.9, 0.8, 0.7, 0.65, -0.7, 0.0, 0.0]])
    out = keep_substantial(normalized, eta=0.6, top_k=4, two_sided=True)
    assert torch.allclose(out[0], torch.tensor([0.9, -0.95, 0.8, -0.7, 0.0, 0.0, 0.0]))
    # one negative survivor only: that side keeps it, the positive side still keeps just its 2
    assert torch.allclose(out[1], torch.tensor([0.9, 0.8, 0.0, 0.0, -0.7, 0.0, 0.0]))
