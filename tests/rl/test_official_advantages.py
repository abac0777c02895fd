"""The official code's γ form of eq. 9: the outcome advantage sits on the last response token, discounted."""

import torch

from flowkit.rl.advantages import AdvantageContext, AdvantageInputs, outcome_and_reward_to_go, token_advantages


def outcome_at_last_token_advantages(outcome, mask, token_rewards, gamma):
    context = AdvantageContext(gamma=gamma, outcome_placement="last_token")
    return outcome_and_reward_to_go(AdvantageInputs(outcome, mask, token_rewards), context)[0]


def test_outcome_at_last_token_by_hand():
    outcome = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0]])
    token_rewards = torch.tensor([[0.0, -0.1, 0.0, -0.2, 5.0], [0.0, 0.0, -0.4, 0.0, 0.0]])  # 5.0 sits on padding
    adv = outcome_at_last_token_advantages(outcome, mask, token_rewards, gamma=0.5)
    # row 0: rewards + outcome at position 3 → [-0.1, 0, 0.8]; returns 0.8, 0.4, −0.1 + 0.2
    # row 1: [0, −0.4 − 2] → returns −2.4, −1.2
    expected = torch.tensor([[0.0, 0.1, 0.4, 0.8, 0.0], [0.0, -1.2, -2.4, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_outcome_at_last_token_equals_every_token_form_when_gamma_is_one():
    torch.manual_seed(0)
    outcome = torch.randn(3)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2: no response
    token_rewards = torch.randn(3, 4) * mask
    torch.testing.assert_close(outcome_at_last_token_advantages(outcome, mask, token_rewards, gamma=1.0),
                               token_advantages(outcome, mask, token_rewards, gamma=1.0))
