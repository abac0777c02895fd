import pytest
import torch

from flowkit import kernels
from flowkit.flow import VelocityField, flow_matching_loss, scored_token_mask, velocity_deviation_scores


def test_scored_tokens_need_their_condition_token():
    response = torch.tensor([[0, 0, 1, 1, 1, 0]])
    assert scored_token_mask(response, "next").int().tolist() == [[0, 0, 1, 1, 0, 0]]
    assert scored_token_mask(response, "previous").int().tolist() == [[0, 0, 0, 1, 1, 0]]
    assert scored_token_mask(response, "none").int().tolist() == [[0, 0, 1, 1, 1, 0]]


def test_fresh_field_outputs_zero_velocity():
    field = VelocityField(hidden_size=8, depth=2)
    v = field(torch.randn(5, 8), torch.rand(5), torch.rand(5), torch.randn(5, 8))
    assert torch.equal(v, torch.zeros(5, 8))  # zero-initialised output projection (adaLN-Zero)


def test_debiased_deviation_by_hand():
    """With v = 0, R_CFM = mean_{ℓ,t} t/(1−t) · mean_d (x1 − ε)² (eq. 5, 7)."""
    torch.manual_seed(0)
    P, B, S, d = 2, 1, 4, 8
    field = VelocityField(hidden_size=d, depth=1, conditioned=False)
    latents = torch.randn(P, B, S, d)
    response = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    timesteps = [0.5, 0.8]
    scores = velocity_deviation_scores(field, latents, response, [0.25, 0.5], timesteps, seed=7, condition="none")
    x1 = latents[:, 0, 1:]  # P×N×d with N = 3 scored tokens
    eps = kernels.flow_noise((3, P, len(timesteps), d), seed=7).permute(1, 2, 0, 3)  # token-major counters
    weights = torch.tensor([1.0, 4.0])  # t/(1−t) for t = 0.5, 0.8
    per = ((x1[:, None] - eps) ** 2).mean(-1)  # P×T×N
    expected = (weights[None, :, None] * per).mean(dim=(0, 1))
    assert scores[0, 0] == 0.0
    assert torch.allclose(scores[0, 1:], expected, rtol=1e-5)


def test_seeded_scores_are_reproducible_and_draws_average():
    torch.manual_seed(1)
    field = VelocityField(hidden_size=8, depth=1)
    for p in field.parameters():  # leave the zero init so the field actually depends on its inputs
        torch.nn.init.normal_(p, std=0.1)
    latents = torch.randn(3, 2, 5, 8)
    response = torch.ones(2, 5)
    args = (field, latents, response, [0.25, 0.5, 0.75], [0.8])
    a = velocity_deviation_scores(*args, seed=3)
    assert torch.equal(a, velocity_deviation_scores(*args, seed=3))
    b = velocity_deviation_scores(*args, seed=4)
    assert not torch.allclose(a, b)
    both = velocity_deviation_scores(*args, seed=3, num_draws=2)
    assert torch.allclose(both, (a + b) / 2, rtol=1e-5, atol=1e-6)


def test_scores_do_not_depend_on_the_row_budget():
    """Chunking the stacked batch (max_rows) bounds memory only: every score stays the same."""
    torch.manual_seed(2)
    field = VelocityField(hidden_size=8, depth=2)
    for p in field.parameters():
        torch.nn.init.normal_(p, std=0.1)
    latents = torch.randn(3, 4, 9, 8)
    response = (torch.rand(4, 9) > 0.2).float()
    args = (field, latents, response, [0.25, 0.5, 0.75], [0.6, 0.8])
    whole = velocity_deviation_scores(*args, seed=5, max_rows=None)
    assert whole.count_nonzero() > 10
    for max_rows in (1, 6, 7, 50, 10_000):  # one token per call, exact chunks, ragged chunks, one call
        torch.testing.assert_close(velocity_deviation_scores(*args, seed=5, max_rows=max_rows), whole, rtol=1e-6, atol=1e-7)


def test_flow_loss_decreases_on_synthetic_latents():
    """Latents on a noisy 2-D subspace of R^16: the field learns the velocity, eq. 4's loss falls."""
    torch.manual_seed(0)
    basis = torch.randn(2, 16)
    field = VelocityField(hidden_size=16, width=32, depth=2)
    optimizer = torch.optim.Adam(field.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(150):
        latents = (torch.randn(2, 4, 12, 2) @ basis + 0.05 * torch.randn(2, 4, 12, 16))
        timesteps = torch.sigmoid(torch.randn(4, generator=generator))
        loss = flow_matching_loss(field, latents, torch.ones(4, 12), [0.25, 0.5], timesteps, seed=step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.6 * first, (first, last)


def test_rewarding_timestep_must_be_inside_unit_interval():
    from flowkit.rewards import FlowReward

    with pytest.raises(ValueError, match="timesteps"):
        FlowReward(timesteps=[1.0])
