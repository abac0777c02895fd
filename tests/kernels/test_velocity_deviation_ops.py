"""RLFR prologue / epilogue ops: reference vs the paper's formulas, native (C++) vs reference, autograd, opcheck."""

import pytest
import torch
from kernel_cases import assert_deviation_ops_match_reference, deviation_inputs, deviation_noise

from flowkit.kernels import (
    available_backends,
    debias_weights,
    interpolate_latents,
    velocity_deviation,
    velocity_deviation_in_chunks,
)
from flowkit.kernels.reference import velocity_deviation as reference

NATIVE = "native" in available_backends("cpu")
needs_native = pytest.mark.skipif(not NATIVE, reason="flowkit._C is not built")


def naive_scores(v, x1, timesteps, weights, seed, mask):
    """Per-(p, t) loop as the official RLFR code does it, with the noise materialised (RLFR eqs. 5 and 7)."""
    layers, tokens, dim = x1.shape
    noise = deviation_noise(layers, len(timesteps), tokens, dim, seed)
    v = v.view(layers, len(timesteps), tokens, dim)
    total = torch.zeros(tokens)
    for p in range(layers):
        for i, t in enumerate(timesteps.tolist()):
            eps = noise[p, i]
            total += weights[i] * ((v[p, i] - (x1[p] - eps)) ** 2).mean(-1)
    return total / (layers * len(timesteps)) * mask.float()


def test_debias_weights_are_t_over_one_minus_t():
    torch.testing.assert_close(debias_weights(torch.tensor([0.5, 0.8])), torch.tensor([1.0, 4.0]))


def test_reference_matches_the_per_layer_per_timestep_loop():
    x1, ts, w, mask, v = deviation_inputs(3, 4, 10, 24)
    x_t = reference.interpolate_latents(x1, ts, seed=5).view(3, 4, 10, 24)
    noise = deviation_noise(3, 4, 10, 24, 5)
    torch.testing.assert_close(x_t[1, 2], ts[2] * x1[1] + (1 - ts[2]) * noise[1, 2])
    torch.testing.assert_close(reference.velocity_deviation(v, x1, ts, w, 5, mask), naive_scores(v.detach(), x1, ts, w, 5, mask))


def test_exact_velocity_scores_zero_and_unit_weights_give_the_flow_loss():
    """v = x1 − ε is the flow target, so its deviation is 0; eq. 4 is the masked mean with unit weights."""
    x1, ts, _, mask, _ = deviation_inputs(2, 3, 8, 16)
    target = (x1.unsqueeze(1) - deviation_noise(2, 3, 8, 16, 9)).reshape(-1, 16)
    assert velocity_deviation(target, x1, ts, torch.ones(3), 9, mask).abs().max() < 1e-5
    v = target + 0.5
    loss = velocity_deviation(v, x1, ts, torch.ones(3), 9, mask)
    torch.testing.assert_close(loss[mask], torch.full((int(mask.sum()),), 0.25))
    assert (loss[~mask] == 0).all()


@pytest.mark.parametrize("backend", [b for b in available_backends("cpu") if b != "triton"])
def test_a_token_chunk_regenerates_the_whole_batch_noise(backend, monkeypatch):
    """x1[:, a:b] with token_offset = a gives the rows, scores and gradients of tokens a..b of the whole batch."""
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    x1, ts, w, mask, v = deviation_inputs(3, 2, 11, 24)
    whole_x_t = interpolate_latents(x1, ts, 8).view(3, 2, 11, 24)
    whole = velocity_deviation(v, x1, ts, w, 8, mask)
    (whole_grad,) = torch.autograd.grad(whole.sum(), v)
    rows = v.detach().view(3, 2, 11, 24)[:, :, 4:9].reshape(-1, 24).requires_grad_()
    x_t = interpolate_latents(x1[:, 4:9], ts, 8, token_offset=4)
    part = velocity_deviation(rows, x1[:, 4:9], ts, w, 8, mask[4:9], token_offset=4)
    (grad,) = torch.autograd.grad(part.sum(), rows)
    torch.testing.assert_close(x_t, whole_x_t[:, :, 4:9].reshape(-1, 24))
    torch.testing.assert_close(part, whole[4:9])
    torch.testing.assert_close(grad, whole_grad.view(3, 2, 11, 24)[:, :, 4:9].reshape(-1, 24))
    assert not torch.allclose(interpolate_latents(x1[:, 4:9], ts, 8), x_t)  # the offset matters


@pytest.mark.parametrize("max_rows", [None, 1, 12, 13, 64])
def test_chunked_deviation_equals_one_call(max_rows):
    """velocity_deviation_in_chunks through a nonlinear velocity equals the single stacked call."""
    x1, ts, w, mask, _ = deviation_inputs(2, 3, 10, 16)
    weight = torch.randn(16, 16) / 4
    calls = []

    def velocity(x_t, tokens):
        calls.append(x_t.shape[0])
        return torch.tanh(x_t @ weight)

    expected = velocity_deviation(torch.tanh(interpolate_latents(x1, ts, 2) @ weight), x1, ts, w, 2, mask)
    scores = velocity_deviation_in_chunks(velocity, x1, ts, w, 2, mask, max_rows)
    torch.testing.assert_close(scores, expected)
    assert max(calls) <= max(max_rows or 60, 6) and sum(calls) == 60  # ≥ one token (P·T = 6 rows) per call


def test_chunk_budget_must_be_positive():
    x1, ts, w, mask, _ = deviation_inputs(1, 1, 4, 8)
    with pytest.raises(ValueError, match="max_rows"):
        velocity_deviation_in_chunks(lambda x_t, tokens: x_t, x1, ts, w, 0, mask, max_rows=0)


def test_wrong_seed_or_shape_is_caught():
    x1, ts, w, mask, v = deviation_inputs(1, 1, 5, 8)
    assert not torch.allclose(velocity_deviation(v, x1, ts, w, 1, mask), velocity_deviation(v, x1, ts, w, 2, mask))
    with pytest.raises(ValueError):
        velocity_deviation(v[:-1], x1, ts, w, 1, mask)


SHAPES = [(1, 1, 37, 64), (3, 4, 13, 64), (3, 1, 5, 1536), (1, 4, 3, 1536)]


@needs_native
@pytest.mark.parametrize("layers, steps, tokens, dim", SHAPES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_native_matches_reference(layers, steps, tokens, dim, dtype, tol, monkeypatch):
    x1, ts, w, mask, v = deviation_inputs(layers, steps, tokens, dim, dtype=dtype)
    monkeypatch.setenv("FLOWKIT_KERNELS", "native")
    x_t = interpolate_latents(x1, ts, 3)
    scores = velocity_deviation(v, x1, ts, w, 3, mask)
    (grad,) = torch.autograd.grad(scores.sum(), v)
    assert x_t.dtype == dtype and scores.dtype == torch.float32 and grad.dtype == dtype
    assert_deviation_ops_match_reference(x1, ts, w, mask, v, tol)


@pytest.mark.parametrize("backend", [b for b in available_backends("cpu") if b != "triton"])
def test_gradcheck_float64(backend, monkeypatch):
    monkeypatch.setenv("FLOWKIT_KERNELS", backend)
    x1, ts, w, mask, v = deviation_inputs(2, 2, 4, 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda v: velocity_deviation(v, x1, ts, w, 7, mask), (v,))


@needs_native
def test_opcheck_native_ops():
    x1, ts, w, mask, v = deviation_inputs(2, 3, 6, 20)
    v, mask = v.detach().requires_grad_(), mask.float()
    for offset in (0, 5):
        torch.library.opcheck(torch.ops.flowkit.interpolate_latents.default, (x1, ts, 4, offset))
        torch.library.opcheck(torch.ops.flowkit.velocity_deviation.default, (v, x1, ts, w, 4, offset, mask))
        grad = torch.randn(6)
        torch.library.opcheck(torch.ops.flowkit.velocity_deviation_backward.default,
                              (grad, v.detach(), x1, ts, w, 4, offset, mask))
