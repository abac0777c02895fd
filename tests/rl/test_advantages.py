import typing

import pytest
import torch

from flowkit.rl.advantages import (
    ESTIMATORS,
    AdvantageContext,
    AdvantageInputs,
    entropy_shaped_advantages,
    gae_tokens,
    group_normalized_advantage,
    outcome_and_reward_to_go,
    raw_outcome,
    reinforce_tokens,
    reward_to_go,
    rloo_outcome,
    sequence_gae,
    token_advantages,
)


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
    """Eq. 9: A_k = Σ_{s≥k} γ^{s−k} r_s + Â_o on response tokens, as the GRPO estimator composes it."""
    outcome = torch.tensor([1.0, 0.0])
    groups = torch.tensor([0, 0])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    token_rewards = torch.tensor([[0.0, -0.01, -0.02], [0.0, -0.03, 0.0]])
    adv = token_advantages(group_normalized_advantage(outcome, groups, eps=0.0), mask, token_rewards, gamma=1.0)
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


def test_entropy_shaped_advantages_by_hand():
    """A_t + min(α·H_t, |A_t|/κ) with α = 0.4, κ = 2 (Cheng et al. 2025)."""
    advantages = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, -1.5, -1.5, -1.5], [0.0, 0.0, 0.0, 0.0]])
    entropy = torch.tensor([[9.0, 0.5, 2.0, 1.25], [9.0, 0.5, 3.0, 0.0], [9.0, 2.0, 2.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    shaped = entropy_shaped_advantages(advantages, entropy, mask, alpha=0.4, kappa=2.0)
    # column 0 is the prompt (mask 0): it stays 0 although its entropy is large
    expected = torch.tensor([
        [0.0, 1.0 + 0.2, 1.0 + 0.5, 1.0 + 0.5],       # α·H = 0.2 < |A|/κ = 0.5; 0.8 and 0.5 are capped at 0.5
        [0.0, -1.5 + 0.2, -1.5 + 0.75, -1.5 + 0.0],   # cap |A|/κ = 0.75: a negative advantage shrinks, keeps its sign
        [0.0, 0.0, 0.0, 0.0],                          # A = 0 (an all-wrong group): the cap is 0, nothing is added
    ])
    assert torch.allclose(shaped, expected)


def test_entropy_shaped_advantages_detach_the_entropy():
    logits = torch.tensor([[[0.3, -1.0, 2.0], [1.0, 1.0, 1.0]]], requires_grad=True)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    shaped = entropy_shaped_advantages(torch.tensor([[5.0, 5.0]]), entropy, torch.ones(1, 2), alpha=1.0, kappa=2.0)
    assert not shaped.requires_grad
    assert torch.allclose(shaped, 5.0 + entropy.detach())  # α·H ≤ ln 3 < |A|/κ = 2.5: the bonus is α·H itself


@pytest.mark.parametrize("alpha, kappa", [(-0.1, 2.0), (0.4, 1.0), (0.4, 0.5)])
def test_entropy_shaped_advantages_reject_sign_flipping_settings(alpha, kappa):
    with pytest.raises(ValueError, match="kappa > 1"):
        entropy_shaped_advantages(torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1), alpha, kappa)


def test_rloo_leaves_each_row_out_of_its_own_baseline_by_hand():
    """A_i = r_i − mean of the other rows of its group. Group 0 (1, 0, 0, 1): 1 − 1/3, 0 − 2/3, 0 − 2/3, 1 − 1/3;
    group 1 (1, 1): 0; group 2, one row: no other sample, 0."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0])
    torch.testing.assert_close(rloo_outcome(rewards, groups, AdvantageContext()), expected)
    # interleaved group ids: rows 0, 2 form group 5 (1, 3), rows 1, 3 group 2 (2, 6)
    interleaved = rloo_outcome(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.tensor([5, 2, 5, 2]), AdvantageContext())
    torch.testing.assert_close(interleaved, torch.tensor([1.0 - 3.0, 2.0 - 6.0, 3.0 - 1.0, 6.0 - 2.0]))


def test_rloo_ignores_scale_rewards_and_rescales_the_centred_reward_by_k_over_k_minus_1():
    rewards = torch.tensor([0.3, -1.2, 2.0, 0.5, 4.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    centered = group_normalized_advantage(rewards, groups, scale_rewards="none")
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(rloo_outcome(rewards, groups, AdvantageContext(scale_rewards=scale)),
                                   centered * 3 / 2)


def test_estimators_are_registered_with_their_stages_and_flags():
    flags = {name: (e.value_head, e.whiten) for name, e in ESTIMATORS.items()}
    assert flags == {"grpo": (False, False), "rloo": (False, False), "gae": (True, True), "reinforce": (False, True)}
    assert ESTIMATORS["rloo"].outcome is rloo_outcome and ESTIMATORS["rloo"].tokens is outcome_and_reward_to_go
    assert ESTIMATORS["gae"].outcome is raw_outcome is ESTIMATORS["reinforce"].outcome
    assert (ESTIMATORS["gae"].tokens, ESTIMATORS["reinforce"].tokens) == (gae_tokens, reinforce_tokens)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_outcome_stage_is_the_group_normalised_advantage_bit_for_bit(scale):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (12,), generator=generator).float() * 0.5
    groups = torch.arange(3).repeat_interleave(4)
    ours = ESTIMATORS["grpo"].outcome(rewards, groups, AdvantageContext(scale_rewards=scale))
    assert torch.equal(ours, group_normalized_advantage(rewards, groups, scale_rewards=scale))
    assert torch.equal(raw_outcome(rewards.half(), groups, AdvantageContext()), rewards)  # gae / reinforce: r_o


def test_token_stages_by_hand():
    """One row, prompt then two response tokens, token rewards (0, −0.1, −0.2), outcome term 1, γ = 0.5.
    every_token: Â_o + reward-to-go = 1 + (−0.1 − 0.1, −0.2) = (0.8, 0.8). last_token and reinforce: rewards
    (−0.1, −0.2 + 1) → to-go (−0.1 + 0.4, 0.8). gae (λ = 1) with V = (0.5, 0.2): δ = (−0.1 + 0.5·0.2 − 0.5, 0.8 − 0.2)
    = (−0.5, 0.6), A = (−0.5 + 0.5·0.6, 0.6) = (−0.2, 0.6), returns A + V = (0.3, 0.8)."""
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    inputs = AdvantageInputs(torch.tensor([1.0]), mask, torch.tensor([[0.0, -0.1, -0.2]]))
    every, none = outcome_and_reward_to_go(inputs, AdvantageContext(gamma=0.5))
    torch.testing.assert_close(every, torch.tensor([[0.0, 0.8, 0.8]]))
    assert none is None
    last = torch.tensor([[0.0, 0.3, 0.8]])
    torch.testing.assert_close(outcome_and_reward_to_go(inputs, AdvantageContext(0.5, outcome_placement="last_token"))[0],
                               last)
    torch.testing.assert_close(reinforce_tokens(inputs, AdvantageContext(gamma=0.5))[0], last)
    with pytest.raises(ValueError, match="value-head"):
        gae_tokens(inputs, AdvantageContext())
    valued = AdvantageInputs(inputs.outcome, mask, inputs.token_rewards, torch.tensor([[0.0, 0.5, 0.2]]))
    advantages, returns = gae_tokens(valued, AdvantageContext(gamma=0.5, lam=1.0))
    torch.testing.assert_close(advantages, torch.tensor([[0.0, -0.2, 0.6]]))
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.3, 0.8]]))


def test_sequence_estimators_skip_the_tokens_off_the_mask_as_if_they_were_not_there():
    """An agent episode's policy tokens with the environment's between them: reward-to-go and GAE step from one
    policy token to the next (no discount, no value, no reward at the environment's), as over the policy tokens
    alone."""
    policy = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 1, 1]]).float()
    rewards, values = torch.randn(2, 8), torch.randn(2, 8)
    for row in range(2):
        tokens = policy[row].bool()
        alone = torch.ones(1, int(tokens.sum()))
        torch.testing.assert_close(reward_to_go(rewards, policy, 0.9)[row, tokens],
                                   reward_to_go(rewards[row:row + 1, tokens], alone, 0.9)[0])
        advantages, returns = sequence_gae(rewards, values, policy, 0.9, 0.8)
        expected = sequence_gae(rewards[row:row + 1, tokens], values[row:row + 1, tokens], alone, 0.9, 0.8)
        torch.testing.assert_close(advantages[row, tokens], expected[0][0])
        torch.testing.assert_close(returns[row, tokens], expected[1][0])
        assert not advantages[row, ~tokens].any() and not returns[row, ~tokens].any()
