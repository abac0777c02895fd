import math

import pytest
import torch

from flowkit.rl.losses import aggregation_denominator, clipped_policy_loss, kl_penalty
from flowkit.rl.metrics import pass_at_k
from flowkit.rl.rejection import RolloutLatentBuffer, accept_rollouts


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, info = clipped_policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # min(ρA, clip(ρ)A): 1.2 (clipped), 0.5 (unclipped is smaller), -2.2 (unclipped is smaller)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 2.2) / 3)
    assert info["clip_fraction"].item() == pytest.approx(1 / 3)


def test_clip_high_is_asymmetric_and_seq_mean_differs_from_token_mean():
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.5, 1.5], [1.5, 1.0]]))
    adv = torch.ones(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    token, _ = clipped_policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="token-mean")
    assert token.item() == pytest.approx(-1.28)
    seq, _ = clipped_policy_loss(new, old, adv * torch.tensor([[1.0], [2.0]]), mask, 0.2, 0.28, "seq-mean")
    assert seq.item() == pytest.approx(-(1.28 + 2.56) / 2)


def test_kl_penalty_zero_when_equal_and_positive_otherwise():
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    mask = torch.ones(1, 2)
    assert kl_penalty(lp, lp, mask).item() == 0.0
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    expected = (0.5 - math.log(0.5) - 1) / 2
    assert kl_penalty(lp, ref, mask).item() == pytest.approx(expected)


def test_pass_at_k_by_hand():
    values = pass_at_k(4, torch.tensor([0, 1, 4]), 2)
    assert torch.allclose(values, torch.tensor([0.0, 1 - 3 / 6, 1.0]))


def test_accept_rollouts_metrics():
    correct = torch.tensor([True, False, True, False])
    entropy = torch.tensor([0.1, 0.9, 0.8, 0.2])
    assert accept_rollouts("correct", correct, entropy).tolist() == [True, False, True, False]
    assert accept_rollouts("entropy", correct, entropy).tolist() == [False, True, True, False]
    assert accept_rollouts("both", correct, entropy).tolist() == [False, False, True, False]


def test_latent_buffer_pops_oldest_padded():
    buffer = RolloutLatentBuffer()
    latents = torch.arange(2 * 2 * 3 * 1, dtype=torch.float32).view(2, 2, 3, 1)
    buffer.add(latents, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]))
    assert len(buffer) == 2
    popped, mask = buffer.pop(2)
    assert popped.shape == (2, 2, 3, 1) and len(buffer) == 0
    assert mask.tolist() == [[0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
    assert torch.equal(popped[:, 0, :2], latents[:, 0, :2]) and torch.equal(popped[:, 0, 2], torch.zeros(2, 1))


def test_dr_grpo_divides_by_rows_times_max_new_tokens():
    zero = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = clipped_policy_loss(zero, zero, adv, mask, aggregation="dr-grpo", max_new_tokens=4)
    assert loss.item() == pytest.approx(-(1 + 2 + 3) / (2 * 4))  # ratio 1: −A summed, over B·max_new_tokens
    with pytest.raises(ValueError, match="max_new_tokens"):
        clipped_policy_loss(zero, zero, adv, mask, aggregation="dr-grpo")


def test_dual_clip_caps_negative_advantage_tokens_at_c():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[5.0, 5.0]]))  # ratio 5 on both tokens
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    plain, _ = clipped_policy_loss(new, old, adv, mask, 0.2, 0.2)
    assert plain.item() == pytest.approx((5.0 - 1.2) / 2)  # A<0: max(5, 1.2) = 5; A>0: max(−5, −1.2) = −1.2
    dual, _ = clipped_policy_loss(new, old, adv, mask, 0.2, 0.2, clip_ratio_c=3.0)
    assert dual.item() == pytest.approx((3.0 - 1.2) / 2)  # A<0 capped at −c·A = 3; A>0 unchanged


def test_importance_weights_scale_each_token():
    zero = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 1.0]])
    loss, _ = clipped_policy_loss(zero, zero, adv, torch.ones(1, 2), importance_weights=torch.tensor([[0.5, 2.0]]))
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean", "dr-grpo"])
def test_micro_batch_losses_over_the_minibatch_denominator_add_up(aggregation):
    generator = torch.Generator().manual_seed(0)
    new, old, adv = (torch.randn(5, 6, generator=generator) * 0.1 for _ in range(3))
    mask = (torch.rand(5, 6, generator=generator) > 0.3).float()
    mask[2] = 0.0  # an empty response counts in no aggregation but dr-grpo's B
    whole, _ = clipped_policy_loss(new, old, adv, mask, aggregation=aggregation, max_new_tokens=6)
    denominator = aggregation_denominator(mask, aggregation, max_new_tokens=6)
    parts = [clipped_policy_loss(new[r], old[r], adv[r], mask[r], aggregation=aggregation, denominator=denominator)[0]
             for r in (slice(0, 1), slice(1, 4), slice(4, 5))]
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)
    kl_whole = kl_penalty(new, old, mask, aggregation, max_new_tokens=6)
    kl_parts = [kl_penalty(new[r], old[r], mask[r], aggregation, denominator) for r in (slice(0, 2), slice(2, 5))]
    assert sum(kl_parts).item() == pytest.approx(kl_whole.item(), rel=1e-6)


def test_entropy_ties_with_the_median_are_not_above_it():
    """Identical responses get entropies equal up to float noise of the batched forward; that noise must not decide."""
    entropy = torch.tensor([0.5, 0.5 + 1e-7, 0.5 - 1e-7, 0.9, 0.1, 0.5])
    assert accept_rollouts("entropy", torch.zeros(6, dtype=torch.bool), entropy).tolist() == [False] * 3 + [True] + [False] * 2


def test_an_outlier_token_keeps_the_loss_and_gradient_finite():
    """A log-ratio of 100 (exp overflows float32) and a KL of e^60 are clamped as verl clamps them: log-ratio to
    ±20 before exp, the k3 value to 10."""
    logprobs = torch.tensor([[0.0, 100.0, -1.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, _ = clipped_policy_loss(logprobs, old, torch.tensor([[1.0, -1.0, 1.0]]), mask, clip_ratio_c=None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    # tokens 0 and 2: ρ = 1, A = 1 → −1 each; token 1: A = −1, ρ = e^20 (clamped) → max(e^20, 1.2) = e^20
    assert float(loss) == pytest.approx((-1.0 + math.exp(20.0) - 1.0) / 3, rel=1e-5)
    kl = kl_penalty(torch.tensor([[0.0, -60.0]]), torch.tensor([[0.0, 0.0]]), torch.ones(1, 2))
    assert float(kl) == pytest.approx((0.0 + 10.0) / 2)


def test_kl_estimators_by_hand_and_as_verl_defines_them():
    """log π = [−1, −2], log π_ref = [−1.5, −1]: r = ref − logπ = [−0.5, 1]. k1 = logπ − ref = [0.5, −1];
    k2 = ½(logπ − ref)² = [0.125, 0.5]; k3 = e^r − r − 1 = [e^−0.5 − 0.5, e − 2] (verl's k3 and low_var_kl alike)."""
    from flowkit.rl.losses import kl_estimate, kl_shaped_rewards

    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    k3 = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0]])
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), k3)
    torch.testing.assert_close(kl_estimate(logp, ref, "low_var_kl"), k3)
    shaped = kl_shaped_rewards(torch.tensor([[0.0, 1.0]]), logp, ref, torch.tensor([[1.0, 1.0]]), 0.1, "k2")
    torch.testing.assert_close(shaped, torch.tensor([[-0.0125, 0.95]]))
    assert float(kl_penalty(logp, ref, torch.ones(1, 2), estimator="k1")) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="KL estimator"):
        kl_estimate(logp, ref, "k4")
