import math

import pytest
import torch

from flowkit.rl.losses import (
    POLICY_LOSSES, LossContext, aggregation_denominator, cispo_policy_loss, clipped_policy_loss, gspo_policy_loss, kl_estimate,
    kl_penalty,
)
from flowkit.rl.metrics import pass_at_k
from flowkit.rewards.flow.rejection import RolloutLatentBuffer, accept_rollouts


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, info = clipped_policy_loss(new, old, adv, mask, LossContext(clip_low=0.2, clip_high=0.2))
    # min(ρA, clip(ρ)A): 1.2 (clipped), 0.5 (unclipped is smaller), -2.2 (unclipped is smaller)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 2.2) / 3)
    assert info["clip_fraction"].item() == pytest.approx(1 / 3)


def test_clip_high_is_asymmetric_and_seq_mean_differs_from_token_mean():
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.5, 1.5], [1.5, 1.0]]))
    adv = torch.ones(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    token, _ = clipped_policy_loss(new, old, adv, mask, LossContext(0.2, 0.28, aggregation="token-mean"))
    assert token.item() == pytest.approx(-1.28)
    seq, _ = clipped_policy_loss(new, old, adv * torch.tensor([[1.0], [2.0]]), mask,
                             LossContext(0.2, 0.28, aggregation="seq-mean"))
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
    loss, _ = clipped_policy_loss(zero, zero, adv, mask, LossContext(aggregation="dr-grpo", max_new_tokens=4))
    assert loss.item() == pytest.approx(-(1 + 2 + 3) / (2 * 4))  # ratio 1: −A summed, over B·max_new_tokens
    with pytest.raises(ValueError, match="max_new_tokens"):
        clipped_policy_loss(zero, zero, adv, mask, LossContext(aggregation="dr-grpo"))


def test_dual_clip_caps_negative_advantage_tokens_at_c():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[5.0, 5.0]]))  # ratio 5 on both tokens
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    plain, _ = clipped_policy_loss(new, old, adv, mask, LossContext(0.2, 0.2))
    assert plain.item() == pytest.approx((5.0 - 1.2) / 2)  # A<0: max(5, 1.2) = 5; A>0: max(−5, −1.2) = −1.2
    dual, _ = clipped_policy_loss(new, old, adv, mask, LossContext(0.2, 0.2, clip_ratio_c=3.0))
    assert dual.item() == pytest.approx((3.0 - 1.2) / 2)  # A<0 capped at −c·A = 3; A>0 unchanged


def test_importance_weights_scale_each_token():
    zero = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 1.0]])
    loss, _ = clipped_policy_loss(zero, zero, adv, torch.ones(1, 2),
                                  LossContext(importance_weights=torch.tensor([[0.5, 2.0]])))
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)


@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean", "dr-grpo"])
def test_micro_batch_losses_over_the_minibatch_denominator_add_up(aggregation, policy_loss):
    generator = torch.Generator().manual_seed(0)
    new, old, adv = (torch.randn(5, 6, generator=generator) * 0.1 for _ in range(3))
    mask = (torch.rand(5, 6, generator=generator) > 0.3).float()
    mask[2] = 0.0  # an empty response counts in no aggregation but dr-grpo's B
    loss = POLICY_LOSSES[policy_loss].fn
    whole, _ = loss(new, old, adv, mask, LossContext(aggregation=aggregation, max_new_tokens=6))
    denominator = aggregation_denominator(mask, aggregation, max_new_tokens=6)
    parts = [loss(new[r], old[r], adv[r], mask[r], LossContext(aggregation=aggregation, denominator=denominator))[0]
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
    loss, _ = clipped_policy_loss(logprobs, old, torch.tensor([[1.0, -1.0, 1.0]]), mask, LossContext(clip_ratio_c=None))
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


def test_policy_losses_are_registered_by_name_with_one_signature():
    assert {name: loss.fn for name, loss in POLICY_LOSSES.items()} == {
        "ppo": clipped_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}
    assert all(loss.args == {} for loss in POLICY_LOSSES.values())  # the built-in losses read only the shared fields
    generator = torch.Generator().manual_seed(1)
    new, old, adv = (torch.randn(3, 4, generator=generator) * 0.1 for _ in range(3))
    ctx = LossContext(clip_low=0.2, clip_high=0.28, aggregation="token-mean", max_new_tokens=4)
    for name, loss in POLICY_LOSSES.items():  # every tensor by name and one context, as the actor calls them
        value, info = loss.fn(logprobs=new, old_logprobs=old, advantages=adv, mask=torch.ones(3, 4), ctx=ctx)
        assert value.dim() == 0 and set(info) == {"clip_fraction", "approx_kl"}, name


def test_gspo_by_hand():
    """Row 0: token ratios 1.5, 0.9 → s = √1.35 ≈ 1.1619 inside [0.8, 1.2], A = 1: −s on both tokens. Row 1: ratios
    2, 2 (and a padded token) → s = 2, A = −1: max(−sA, −clip(s)A) = max(2, 1.2) = 2. Token mean over 4 tokens.
    Gradient w.r.t. log π_t: ∂s_i,t/∂log π_t = s_i, so −A·s_i / 4 per token (the unclipped branch is active)."""
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 0.9, 1.0], [2.0, 2.0, 7.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    s = math.sqrt(1.35)
    loss, info = gspo_policy_loss(new, old, adv, mask, LossContext(0.2, 0.2))
    assert loss.item() == pytest.approx((-2 * s + 2 * 2.0) / 4)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-s / 4, -s / 4, 0.0], [0.5, 0.5, 0.0]]))
    assert info["clip_fraction"].item() == 0.0  # row 1's clip is inactive (the unclipped branch is larger)
    clipped, info = gspo_policy_loss(new.detach(), old, -adv, mask, LossContext(0.2, 0.2))  # row 1 with A = +1: clipped at 1.2
    assert clipped.item() == pytest.approx((2 * s - 2 * 1.2) / 4)
    assert info["clip_fraction"].item() == 0.5


def test_gspo_is_sequence_level_gspo_as_trl_defines_it_with_constant_row_advantages():
    """TRL's importance_sampling_level="sequence" (GRPOTrainer._compute_loss): log w_i = Σ_t log ρ_t·m_t / max(|y_i|, 1)
    with its gradient, per-token loss −min(w_i·A, clip(w_i)·A) on every token, here with TRL's ``loss_type="grpo"``
    aggregation (mean of the rows' token means = flowkit's seq-mean). For advantages constant along each row,
    flowkit's GSPO-token gives the same loss and the same gradient."""
    generator = torch.Generator().manual_seed(2)
    old = torch.randn(4, 6, generator=generator) * 0.3
    new = (old + torch.randn(4, 6, generator=generator) * 0.2).requires_grad_()
    adv = torch.randn(4, 1, generator=generator).expand(4, 6)
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [1.0] * 2 + [0.0] * 4, [1.0] * 5 + [0.0]])
    log_w = ((new - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    w = torch.exp(log_w)
    per_token = -torch.minimum(w * adv, w.clamp(0.8, 1.28) * adv)
    trl = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    trl_grad, = torch.autograd.grad(trl, new)
    ours, _ = gspo_policy_loss(new, old, adv, mask, LossContext(0.2, 0.28, aggregation="seq-mean"))
    ours_grad, = torch.autograd.grad(ours, new)
    torch.testing.assert_close(ours, trl)
    torch.testing.assert_close(ours_grad, trl_grad)


def test_gspo_token_as_verl_defines_it_with_token_advantages():
    """verl's compute_policy_loss_gspo: log s_i,t = log π − sg(log π) + sg(mean_t(log π − log π_old)), the clipped
    surrogate per token, ``seq-mean-token-mean`` aggregation; with advantages that vary along the row (dense rewards)."""
    generator = torch.Generator().manual_seed(3)
    old = torch.randn(3, 5, generator=generator) * 0.3
    new = (old + torch.randn(3, 5, generator=generator) * 0.3).requires_grad_()
    adv = torch.randn(3, 5, generator=generator)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [0.0] + [1.0] * 4])
    lengths = mask.sum(-1).clamp(min=1)
    log_s = ((new - old) * mask).sum(-1) / lengths
    ratio = torch.exp(new - new.detach() + log_s.detach()[:, None])
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    verl = ((per_token * mask).sum(-1) / lengths).mean()
    verl_grad, = torch.autograd.grad(verl, new)
    ours, _ = gspo_policy_loss(new, old, adv, mask, LossContext(0.2, 0.2, aggregation="seq-mean"))
    ours_grad, = torch.autograd.grad(ours, new)
    torch.testing.assert_close(ours, verl)
    torch.testing.assert_close(ours_grad, verl_grad)


def test_cispo_by_hand_and_as_verl_defines_it():
    """Ratios 1.5, 0.5, 1.1, A = 1, 1, −2, ε = 0.2: clipped weights r̂ = 1.2, 0.8, 1.1 (two clipped); value −r̂·A per
    token, token mean (−1.2 − 0.8 + 2.2) / 3; gradient −r̂·A / 3 per token — also for the clipped tokens, whose PPO
    gradient would be 0. verl's compute_policy_loss_cispo, −sg(clip(ρ))·A·log π, has the same gradient."""
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, info = cispo_policy_loss(new, old, adv, mask, LossContext(0.2, 0.2))
    assert loss.item() == pytest.approx((-1.2 - 0.8 + 2.2) / 3)
    assert info["clip_fraction"].item() == pytest.approx(2 / 3)
    grad, = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -0.8, 2.2]]) / 3)
    ratio = torch.exp(new - old)
    verl = (-ratio.clamp(0.8, 1.2).detach() * adv * new * mask).sum() / mask.sum()
    verl_grad, = torch.autograd.grad(verl, new)
    torch.testing.assert_close(grad, verl_grad)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        cispo_policy_loss(new, old, adv, mask, LossContext(clip_ratio_c=3.0))


def test_verl_kl_variants_abs_and_straight_through():
    """verl's kl_penalty: ``abs`` = |log π − log π_ref|; ``k1+`` / ``k3+`` / ``low_var_kl+`` take the value of k1 / k3
    and the gradient of k2, (log π − log π_ref) per token."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_estimate(logp, ref, "abs"), torch.tensor([[0.5, 1.0]]))
    for estimator in ("k1", "k3", "low_var_kl"):
        straight = kl_estimate(logp, ref, estimator + "+")
        torch.testing.assert_close(straight, kl_estimate(logp, ref, estimator))
        grad, = torch.autograd.grad(straight.sum(), logp)
        torch.testing.assert_close(grad, torch.tensor([[0.5, -1.0]]))


def test_loss_context_pieces_by_hand():
    """aggregated: weights (2, 0.5 | 1, 1), per-token (1, 2 | 3, 4), mask (1, 1 | 1, 0): token-mean (2 + 1 + 3) / 3;
    seq-mean (1.5 + 3) / 2; over a given denominator 4: 6 / 4. token_ratio clamps the log-ratio at ±20;
    policy_metrics: the token means of the clipped flags and of logπ_old − logπ."""
    from flowkit.rl.losses import aggregated, policy_metrics, token_ratio

    per_token = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    weights = torch.tensor([[2.0, 0.5], [1.0, 1.0]])
    assert aggregated(per_token, mask, LossContext(importance_weights=weights)).item() == pytest.approx(6 / 3)
    seq = aggregated(per_token, mask, LossContext(aggregation="seq-mean", importance_weights=weights))
    assert seq.item() == pytest.approx((1.5 + 3.0) / 2)
    assert aggregated(per_token, mask, LossContext(importance_weights=weights, denominator=4.0)).item() == 1.5
    ratio = token_ratio(torch.tensor([[0.0, 50.0, math.log(2.0)]]), torch.tensor([[0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ratio, torch.tensor([[1.0, math.exp(20.0), 2.0]]))
    metrics = policy_metrics(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2),
                             torch.tensor([[True, False]]))
    assert metrics["clip_fraction"].item() == 0.5 and metrics["approx_kl"].item() == pytest.approx((-0.5 + 1.0) / 2)
