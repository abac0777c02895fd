"""VelocityField's two fast paths compute what its row-wise autograd forward computes: the stacked (layer, timestep,
token) layout of the reward path bit for bit, and the in-place forward it takes without autograd up to rounding."""

import pytest
import torch

from flowkit.rewards.flow import VelocityField


def random_field(conditioned: bool) -> VelocityField:
    torch.manual_seed(0)
    field = VelocityField(32, depth=2, conditioned=conditioned)
    with torch.no_grad():
        for param in field.parameters():
            param.normal_(0, 0.1)  # adaLN-Zero starts at v = 0, which would hide every difference
    return field


@pytest.mark.parametrize("conditioned", [True, False])
def test_stacked_layout_and_in_place_scoring_equal_the_row_wise_forward(conditioned):
    field = random_field(conditioned)
    layers, times, tokens = torch.tensor([0.25, 0.5, 0.75]), torch.tensor([0.4, 0.8]), 5
    x_t = torch.randn(3 * 2 * tokens, 32)
    condition = torch.randn(3, tokens, 32) if conditioned else None
    t_rows = times.repeat_interleave(tokens).repeat(3)
    layer_rows = layers.repeat_interleave(2 * tokens)
    condition_rows = condition.unsqueeze(1).expand(3, 2, tokens, 32).reshape(-1, 32) if conditioned else None
    row_wise = field(x_t, t_rows, layer_rows, condition_rows)
    assert row_wise.abs().max() > 0 and row_wise.requires_grad
    # the stacked path embeds each t and ℓ once, the row-wise one per row (no unique(): a host sync on a GPU), so
    # the two agree to float rounding
    torch.testing.assert_close(field(x_t, times, layers, condition, stacked=True), row_wise, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(field(x_t, t_rows, layer_rows, condition_rows), row_wise, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(field(x_t, times, layers, condition, stacked=True), row_wise, rtol=1e-5, atol=1e-6)


def test_in_place_scoring_leaves_its_inputs_untouched():
    field = random_field(True)
    x_t, t, layer, condition = torch.randn(6, 32), torch.rand(6), torch.rand(6), torch.randn(6, 32)
    before = [x_t.clone(), t.clone(), layer.clone(), condition.clone()]
    with torch.no_grad():
        field(x_t, t, layer, condition)
    assert all(torch.equal(a, b) for a, b in zip([x_t, t, layer, condition], before))
