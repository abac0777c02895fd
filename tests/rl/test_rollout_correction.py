"""Rollout corrections (flowkit.rl.rollout_correction) against hand-computed values and against the formulas of TRL's
``GRPOTrainer`` and verl's rollout-correction docs, written out here (not imported: neither is a dependency)."""

import math

import pytest
import torch

from flowkit.rl.rollout_correction import (
    CORRECTIONS, RolloutCorrection, correction_fractions, correction_weights, mismatch_metrics,
    off_policy_sequence_mask, rollout_log_ratio,
)

# Two rows, three positions; row 1's last position is padding.
TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -1.0, -9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# log ρ = train − rollout on the mask: row 0: 0.5, −1, 0 (sum −0.5); row 1: 0, −2, (pad) (sum −2)
LOG_RATIO = torch.tensor([[0.5, -1.0, 0.0], [0.0, -2.0, 0.0]])


def test_log_ratio_is_masked_and_bounded():
    assert torch.equal(rollout_log_ratio(TRAIN, ROLLOUT, MASK), LOG_RATIO)
    far = rollout_log_ratio(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.ones(1, 1))
    assert float(far) == 20.0  # verl's safety bound: ρ ≤ e^20


def test_token_tis_truncates_each_token_at_the_cap():
    weights = correction_weights(LOG_RATIO, MASK, "token_tis", cap=1.5)
    expected = torch.tensor([[1.5, math.exp(-1), 1.0], [1.0, math.exp(-2), 0.0]])  # e^0.5 = 1.65 → 1.5
    torch.testing.assert_close(weights, expected)
    floored = correction_weights(LOG_RATIO, MASK, "token_tis", cap=1.5, floor=0.3)
    torch.testing.assert_close(floored, torch.tensor([[1.5, math.exp(-1), 1.0], [1.0, 0.3, 0.0]]))


def test_seq_tis_puts_the_rows_truncated_product_on_every_token():
    weights = correction_weights(LOG_RATIO, MASK, "seq_tis", cap=2.0)
    expected = torch.tensor([[math.exp(-0.5)] * 3, [math.exp(-2), math.exp(-2), 0.0]])
    torch.testing.assert_close(weights, expected)


def test_masked_modes_zero_what_leaves_the_band():
    token = correction_weights(LOG_RATIO, MASK, "token_mis", cap=1.5, floor=0.2)
    torch.testing.assert_close(token, torch.tensor([[0.0, math.exp(-1), 1.0], [1.0, 0.0, 0.0]]))
    seq = correction_weights(LOG_RATIO, MASK, "seq_mis", cap=2.0, floor=0.5)  # row 0: e^−0.5 = 0.61 kept; e^−2 not
    torch.testing.assert_close(seq, torch.tensor([[math.exp(-0.5)] * 3, [0.0, 0.0, 0.0]]))


def test_icepop_is_token_masking_in_the_band_half_to_five():
    option = RolloutCorrection(mode="icepop")
    assert (option.lower, option.upper) == (0.5, 5.0)
    log_ratio = torch.log(torch.tensor([[0.4, 0.5, 1.0, 5.0, 5.1]]))
    weights = correction_weights(log_ratio, torch.ones(1, 5), "icepop", option.upper, option.lower)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.5, 1.0, 5.0, 0.0]]))


@pytest.mark.parametrize("mode, cap, floor, expected", [
    # ρ per token: row 0: e^0.5 = 1.65, e^−1 = 0.37, 1; row 1: 1, e^−2 = 0.14 (5 tokens). ∏ρ: e^−0.5 = 0.61, e^−2
    ("token_tis", 1.5, None, {"truncated_frac": 1 / 5, "masked_frac": 0.0}),  # 1.65 clamped to 1.5
    ("token_tis", 1.5, 0.3, {"truncated_frac": 2 / 5, "masked_frac": 0.0}),  # and 0.14 raised to 0.3
    ("token_mis", 1.5, 0.2, {"masked_frac": 2 / 5, "truncated_frac": 0.0}),  # 1.65 and 0.14 leave [0.2, 1.5]
    ("icepop", 5.0, 0.5, {"masked_frac": 2 / 5, "truncated_frac": 0.0}),  # 0.37 and 0.14 below the band
    ("seq_mis", 2.0, 0.5, {"masked_frac": 2 / 5, "truncated_frac": 0.0, "seq_masked_frac": 1 / 2}),  # row 1
    ("seq_tis", 2.0, 0.5, {"truncated_frac": 2 / 5, "masked_frac": 0.0, "seq_truncated_frac": 1 / 2}),  # row 1
    ("seq_tis", 2.0, None, {"truncated_frac": 0.0, "masked_frac": 0.0, "seq_truncated_frac": 0.0}),
])
def test_correction_fractions_by_hand(mode, cap, floor, expected):
    fractions = correction_fractions(LOG_RATIO, MASK, mode, cap, floor)
    assert {name: pytest.approx(float(value)) for name, value in fractions.items()} == expected
    if expected.get("masked_frac"):  # what the masked modes zero is what the weights zero
        zeroed = (correction_weights(LOG_RATIO, MASK, mode, cap, floor) == 0) & MASK.bool()
        assert float(fractions["masked_frac"]) == pytest.approx(float(zeroed.sum()) / float(MASK.sum()))


@pytest.mark.parametrize("mode", ["token_tis", "seq_tis", "token_mis", "seq_mis"])
def test_every_mode_equals_trls_formula(mode):
    """TRL ``GRPOTrainer._generate_and_score_completions`` (trl/trainer/grpo_trainer.py ~L2578-2622 at f2cd577):
    per_token_logps_diff = (old − sampling) · mask; the sequence modes sum it over the row; ratio = exp(diff);
    ``*_truncate``: clamp(ratio, min=clip_min, max=clip_max); ``*_mask``: ratio where clip_min ≤ ratio ≤ clip_max,
    else 0 (an unset bound is ±inf). The (B, 1) sequence ratio broadcasts over the row's tokens in the loss."""
    torch.manual_seed(0)
    old, sampling = -torch.rand(4, 7) * 3, -torch.rand(4, 7) * 3
    mask = (torch.rand(4, 7) > 0.2).float()
    clip_min, clip_max = 0.3, 2.5
    diff = (old - sampling) * mask
    if mode.startswith("seq"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("tis"):
        trl = ratio.clamp(min=clip_min, max=clip_max)
    else:
        trl = ratio.masked_fill((ratio < clip_min) | (ratio > clip_max), 0.0)
    ours = correction_weights(rollout_log_ratio(old, sampling, mask), mask, mode, clip_max, clip_min)
    torch.testing.assert_close(ours, trl.expand_as(mask) * mask)


def test_off_policy_sequence_mask_drops_negative_advantages_of_drifted_rows():
    """TRL ``get_off_policy_mask`` (DeepSeek-V3.2, grpo_trainer.py ~L2920): kl = sampling − π_θ (detached), mean over
    the row's tokens; keep where advantage ≥ 0 or mean kl ≤ δ."""
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-0.5, -0.5], [-0.9, -1.1]])  # row 0 drifted by 0.5 per token, row 1 by 0 on average
    advantages = torch.tensor([[-1.0, 2.0], [-1.0, -1.0]])
    keep = off_policy_sequence_mask(logprobs, rollout, advantages, torch.ones(2, 2), threshold=0.25)
    assert torch.equal(keep, torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    assert not keep.requires_grad


def test_mismatch_metrics_by_hand():
    metrics = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    deltas = torch.tensor([0.5, -1.0, 0.0, 0.0, -2.0])  # the masked tokens' log ρ
    assert float(metrics["abs_diff_mean"]) == pytest.approx(3.5 / 5)
    assert float(metrics["abs_diff_max"]) == 2.0
    # k3 of KL(π_rollout ‖ π_train) from the rollout's samples: ρ − 1 − log ρ (verl's rollout_corr/k3_kl)
    assert float(metrics["k3_kl"]) == pytest.approx(float((deltas.exp() - 1 - deltas).mean()))
    assert float(mismatch_metrics(TRAIN, TRAIN, MASK)["k3_kl"]) == 0.0


def test_every_mode_is_registered_and_checked():
    assert set(CORRECTIONS) == {"token_tis", "seq_tis", "token_mis", "seq_mis", "icepop"}
    for mode in CORRECTIONS:
        RolloutCorrection(mode=mode).check("PolicyModule")
    RolloutCorrection(bypass=True, off_policy_mask=0.1).check("PolicyModule")
