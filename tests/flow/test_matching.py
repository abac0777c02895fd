import math

import pytest
import torch

from flowkit import kernels
from flowkit.rewards.flow import (
    VelocityField,
    flow_matching_loss_pieces,
    pretraining_loss_pieces,
    sample_logit_normal,
    scored_token_mask,
    velocity_deviation_scores,
)
from flowkit.rewards.flow.field import sinusoidal_embedding


def flow_matching_loss(field, latents, response_mask, layer_positions, timesteps, seed, condition="next"):
    """Oracle: eq. 4 in one field call, the sum of flowkit's loss pieces (0 when no token is scored)."""
    pieces = flow_matching_loss_pieces(field, latents, response_mask, layer_positions, timesteps, seed, condition)
    return sum((piece() for piece in pieces), latents.new_zeros((), dtype=torch.float32))


def pretraining_flow_loss(field, latents, response_mask, layer_positions, copies, generator, condition="next",
                          logit_mean=0.0):
    """Oracle: the offline pretraining loss in one field call, the sum of flowkit's pretraining pieces."""
    pieces = pretraining_loss_pieces(field, latents, response_mask, layer_positions, copies, generator, condition,
                                     logit_mean)
    return sum((piece() for piece in pieces), latents.new_zeros((), dtype=torch.float32))


def test_scored_tokens_need_their_condition_token():
    response = torch.tensor([[0, 0, 1, 1, 1, 0]])
    assert scored_token_mask(response, "next").int().tolist() == [[0, 0, 1, 1, 0, 0]]
    # previous (official token_post): the first response token is scored against the last prompt token
    assert scored_token_mask(response, "previous").int().tolist() == [[0, 0, 1, 1, 1, 0]]
    assert scored_token_mask(response, "none").int().tolist() == [[0, 0, 1, 1, 1, 0]]
    # a token at position 0 has no previous token at all
    assert scored_token_mask(torch.tensor([[1, 1, 0]]), "previous").int().tolist() == [[0, 1, 0]]


def _random_field(hidden_size: int, conditioned: bool = True) -> VelocityField:
    field = VelocityField(hidden_size=hidden_size, depth=1, conditioned=conditioned)
    for p in field.parameters():  # leave the zero init so the field actually depends on its inputs
        torch.nn.init.normal_(p, std=0.3)
    return field


@pytest.mark.parametrize("condition, offset", [("previous", -1), ("next", +1)])
def test_condition_latent_by_hand(condition, offset):
    """Token j is scored from h_j conditioned on h_{j−1} (previous) or h_{j+1} (next), one layer, one t."""
    torch.manual_seed(3)
    d, t, seed = 6, 0.8, 11
    field = _random_field(d)
    latents = torch.randn(1, 1, 6, d)
    response = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0]])  # prompt at 0–1, response at 2–4
    scores = velocity_deviation_scores(field, latents, response, [0.5], [t], seed=seed, condition=condition)
    scored = [2, 3, 4] if condition == "previous" else [2, 3]  # next: the last response token has no condition
    assert scores[0].nonzero().flatten().tolist() == scored
    x1 = latents[0, 0, scored]
    eps = kernels.flow_noise((len(scored), 1, 1, d), seed=seed)[:, 0, 0]  # token-major counters
    x_t = t * x1 + (1 - t) * eps
    cond = latents[0, 0, [j + offset for j in scored]]
    with torch.no_grad():
        v = field(x_t, torch.full((len(scored),), t), torch.full((len(scored),), 0.5), cond)
    expected = t / (1 - t) * ((v - (x1 - eps)) ** 2).mean(-1)
    torch.testing.assert_close(scores[0, scored], expected, rtol=1e-5, atol=1e-6)


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
    from flow_options import flow_reward

    with pytest.raises(ValueError, match="timesteps"):
        flow_reward(timesteps=[1.0])


@pytest.mark.parametrize("logit_mean", [0.0, 1.5])
def test_pretraining_draws_one_logit_normal_t_per_row_by_hand(logit_mean):
    """Official offline objective: each scored token × layer enters ``copies`` times, each with its own
    t = sigmoid(n), n ~ N(logit_mean, 1) (official: mean 0)."""
    torch.manual_seed(4)
    P, d, copies = 2, 5, 3
    field = _random_field(d)
    latents = torch.randn(P, 1, 4, d)
    response = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # next: tokens 1, 2 are scored (N = 2)
    loss = pretraining_flow_loss(field, latents, response, [0.25, 0.75], copies, torch.Generator().manual_seed(9),
                                 logit_mean=logit_mean)

    replay = torch.Generator().manual_seed(9)
    rows = P * copies * 2
    t = torch.sigmoid(torch.randn(rows, generator=replay) + logit_mean)
    assert t.unique().numel() == rows  # one t per row, not one per batch
    eps = kernels.flow_noise((rows, d), int(torch.randint(0, 2**31 - 1, (1,), generator=replay)))
    x1 = latents[:, 0, 1:3].unsqueeze(1).expand(P, copies, 2, d).reshape(rows, d)  # rows (p, copy, n)
    cond = latents[:, 0, 2:4].unsqueeze(1).expand(P, copies, 2, d).reshape(rows, d)
    layer = torch.tensor([0.25, 0.75]).repeat_interleave(copies * 2)
    with torch.no_grad():
        v = field(t[:, None] * x1 + (1 - t[:, None]) * eps, t, layer, cond)
    torch.testing.assert_close(loss.detach(), ((v - (x1 - eps)) ** 2).mean(), rtol=1e-5, atol=1e-6)


def test_logit_normal_location_shifts_the_median_timestep():
    for mean in (0.0, 1.5):
        t = sample_logit_normal(20000, torch.Generator().manual_seed(0), mean=mean)
        assert abs(float(t.median()) - 1 / (1 + math.exp(-mean))) < 0.01 and 0 < float(t.min()) < float(t.max()) < 1


def test_sinusoidal_embedding_is_unscaled_by_hand():
    """No ×1000 time scale (official): 4 features of v = 0.5 with frequencies exp(−ln(1e4)·i/2) = 1, 0.01."""
    got = sinusoidal_embedding(torch.tensor([0.5]), dim=4)
    expected = torch.tensor([[math.cos(0.5), math.cos(0.005), math.sin(0.5), math.sin(0.005)]])
    torch.testing.assert_close(got, expected)


def test_official_initialisation_and_norm_eps():
    """xavier-uniform weights with zero biases; adaLN projections and the output Linear zero; ε as given."""
    torch.manual_seed(0)
    field = VelocityField(hidden_size=16, width=24, depth=2, norm_eps=1e-5)
    bound = math.sqrt(6 / (16 + 24))  # xavier-uniform bound of input_proj (fan_in 16, fan_out 24)
    w = field.input_proj.weight
    assert w.abs().max() <= bound and w.abs().max() > 0.8 * bound and w.std() > 0.5 * bound / math.sqrt(3)
    zeroed = {*(f"blocks.{i}.ada_ln.1.weight" for i in range(2)), "final_ada_ln.1.weight", "output_proj.weight"}
    for name, param in field.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        elif name in zeroed:
            assert torch.equal(param, torch.zeros_like(param)), name
        elif "norm" not in name:
            assert param.abs().min() < param.abs().max(), name  # a random matrix, not a constant
    assert [m.eps for m in field.modules() if isinstance(m, torch.nn.RMSNorm)] == [1e-5] * 3


def test_debias_weights_and_their_ablation_by_hand():
    """T = {0.5, 0.8}: eq. 7 weights R_FM by t/(1−t) = 1, 4; debias=False averages the plain R_FM (ablation)."""
    torch.manual_seed(5)
    d, seed, times = 6, 2, (0.5, 0.8)
    field = _random_field(d, conditioned=False)
    latents = torch.randn(1, 1, 5, d)
    response = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])
    args = (field, latents, response, [0.5], list(times))
    debiased = velocity_deviation_scores(*args, seed=seed, condition="none")[0, 1:]
    plain = velocity_deviation_scores(*args, seed=seed, condition="none", debias=False)[0, 1:]
    x1 = latents[0, 0, 1:]
    eps = kernels.flow_noise((4, 1, 2, d), seed=seed)[:, 0]  # token-major counters: (token, layer, t)
    r_fm = []
    for i, t in enumerate(times):
        with torch.no_grad():
            v = field(t * x1 + (1 - t) * eps[:, i], torch.full((4,), t), torch.full((4,), 0.5))
        r_fm.append(((v - (x1 - eps[:, i])) ** 2).mean(-1))
    torch.testing.assert_close(debiased, (1.0 * r_fm[0] + 4.0 * r_fm[1]) / 2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, (r_fm[0] + r_fm[1]) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_rows", [1, 5, 12, None])
def test_loss_pieces_sum_to_the_one_call_loss_and_gradient(max_rows):
    """Pieces of at most ``max_rows`` field rows (tokens × layers × timesteps) rebuild eq. 4 and its gradient."""
    torch.manual_seed(6)
    field = _random_field(8)
    latents = torch.randn(2, 3, 7, 8)
    response = (torch.rand(3, 7) > 0.3).float()
    timesteps = torch.tensor([0.7, 0.9])
    args = (field, latents, response, [0.25, 0.5], timesteps, 4)
    whole = flow_matching_loss(*args, condition="previous")
    expected = torch.autograd.grad(whole, list(field.parameters()))
    pieces = flow_matching_loss_pieces(*args, condition="previous", max_rows=max_rows)
    tokens = int(scored_token_mask(response, "previous").sum())
    assert len(pieces) == (1 if max_rows is None else -(-tokens // max(1, max_rows // 4)))
    total = sum(piece() for piece in pieces)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-7)
    for got, want in zip(torch.autograd.grad(total, list(field.parameters())), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_rows", [1, 7, None])
def test_pretraining_pieces_sum_to_the_one_call_loss(max_rows):
    torch.manual_seed(2)
    field = _random_field(6)
    latents, response = torch.randn(2, 2, 5, 6), torch.tensor([[0.0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    args = (field, latents, response, [0.25, 0.75], 3)
    whole = pretraining_flow_loss(*args, torch.Generator().manual_seed(9), logit_mean=0.5)
    pieces = pretraining_loss_pieces(*args, torch.Generator().manual_seed(9), logit_mean=0.5, max_rows=max_rows)
    rows = 2 * 3 * int(scored_token_mask(response, "next").sum())
    assert len(pieces) == (1 if max_rows is None else -(-rows // max_rows))
    torch.testing.assert_close(sum(piece() for piece in pieces), whole, rtol=1e-5, atol=1e-7)


def test_the_field_embeds_without_a_host_sync_and_layer_indices_equal_per_row_layers(monkeypatch):
    """``unique`` (a device-to-host sync on a GPU, once per field call) is never called: the stacked path embeds its
    T timesteps and P layers once each, pretraining passes its P layers with an index per row."""
    torch.manual_seed(2)
    field = _random_field(6)
    x, t = torch.randn(12, 6), torch.rand(12)
    layers, index = torch.tensor([0.25, 0.75]), torch.tensor([0, 1] * 6)
    monkeypatch.setattr(torch.Tensor, "unique", lambda *a, **k: pytest.fail("unique() called in a field forward"))
    monkeypatch.setattr(torch, "unique", lambda *a, **k: pytest.fail("torch.unique() called in a field forward"))
    cond = torch.randn(12, 6)
    per_row = field(x, t, layers[index], cond)
    torch.testing.assert_close(field(x, t, layers, cond, layer_index=index), per_row, rtol=1e-5, atol=1e-6)
    stacked = field(x, torch.tensor([0.5, 0.8, 0.9]), layers, torch.randn(2, 2, 6), stacked=True)
    assert stacked.shape == (12, 6)
