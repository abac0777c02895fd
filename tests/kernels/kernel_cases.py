"""Input builders shared by the kernel tests (plain functions, no fixtures, so the Triton subprocess reuses them)."""

from __future__ import annotations

import torch

from flowkit.kernels import debias_weights, flow_noise, interpolate_latents, velocity_deviation
from flowkit.kernels.reference import velocity_deviation as deviation_reference


def deviation_inputs(layers, steps, tokens, dim, dtype=torch.float32, seed=0, device="cpu"):
    """x1 (P, N, d), timesteps/weights (T,), a mask with some tokens off, and v (P·T·N, d) requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    x1 = torch.randn(layers, tokens, dim, generator=gen).to(device=device, dtype=dtype)
    timesteps = torch.linspace(0.3, 0.9, steps) if steps > 1 else torch.tensor([0.8])
    mask = torch.rand(tokens, generator=gen) > 0.3
    mask[0] = True
    v = torch.randn(layers * steps * tokens, dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    return x1, timesteps.to(device), debias_weights(timesteps).to(device), mask.to(device), v


def attention_inputs(batch, steps, heads, kv_heads, head_dim, context, num_flow=2, dtype=torch.float32, seed=0,
                     bias=True, device="cpu"):
    """Keyword arguments for ``flow_token_attention`` with random frozen weights and prefix lengths in [1, N]."""
    gen = torch.Generator().manual_seed(seed)
    hidden = heads * head_dim // 2 if heads * head_dim >= 32 else 32

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    prefix = torch.randint(1, context + 1, (batch, steps), generator=gen)
    prefix[0, 0] = context
    positions = prefix.unsqueeze(-1) + torch.arange(num_flow)
    return dict(
        flow_hidden=rand(batch, steps, num_flow, hidden).requires_grad_(),
        q_weight=rand(heads * head_dim, hidden, scale=hidden ** -0.5),
        k_weight=rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
        v_weight=rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
        q_bias=rand(heads * head_dim, scale=0.1) if bias else None,
        k_bias=rand(kv_heads * head_dim, scale=0.1) if bias else None,
        v_bias=rand(kv_heads * head_dim, scale=0.1) if bias else None,
        context_k=rand(batch, kv_heads, context, head_dim),
        context_v=rand(batch, kv_heads, context, head_dim),
        prefix_lengths=prefix.to(device),
        flow_positions=positions.to(device),
        inv_freq=(1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(device),
        attention_scaling=1.0,
        num_heads=heads,
        num_kv_heads=kv_heads,
    )


def core_inputs(batch, steps, heads, kv_heads, head_dim, context, num_flow=2, dtype=torch.float64, seed=0):
    """Inputs of the attention core op: q (B,S,F,H,dh), flow K/V (B,S,F,Hkv,dh), context K/V, prefix lengths."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, steps, num_flow, heads, head_dim, generator=gen, dtype=dtype)
    fk = torch.randn(batch, steps, num_flow, kv_heads, head_dim, generator=gen, dtype=dtype)
    fv = torch.randn(batch, steps, num_flow, kv_heads, head_dim, generator=gen, dtype=dtype)
    ck = torch.randn(batch, kv_heads, context, head_dim, generator=gen, dtype=dtype)
    cv = torch.randn(batch, kv_heads, context, head_dim, generator=gen, dtype=dtype)
    prefix = torch.randint(1, context + 1, (batch, steps), generator=gen)
    return q, fk, fv, ck, cv, prefix


def deviation_noise(layers, steps, tokens, dim, seed, token_offset=0):
    """ε as the RLFR ops index it, (P, T, N, d): counters token-major over the global token, then p, t, d."""
    offset = token_offset * layers * steps * dim
    return flow_noise((tokens, layers, steps, dim), seed, offset=offset).permute(1, 2, 0, 3)


def assert_deviation_ops_match_reference(x1, ts, w, mask, v, tol):
    """The dispatched prologue, epilogue and epilogue gradient equal the reference (seed 3), for the whole batch
    and for the chunk of tokens 1.. given as ``token_offset = 1``."""
    layers, tokens, dim = x1.shape
    chunk_rows = v.detach().view(layers, ts.numel(), tokens, dim)[:, :, 1:].reshape(-1, dim).requires_grad_()
    for x1_part, v_part, mask_part, offset in ((x1, v, mask, 0), (x1[:, 1:], chunk_rows, mask[1:], 1)):
        expected = deviation_reference.velocity_deviation(v_part, x1_part, ts, w, 3, mask_part, offset)
        (expected_grad,) = torch.autograd.grad(expected.sum(), v_part)
        scores = velocity_deviation(v_part, x1_part, ts, w, 3, mask_part, token_offset=offset)
        (grad,) = torch.autograd.grad(scores.sum(), v_part)
        torch.testing.assert_close(interpolate_latents(x1_part, ts, 3, token_offset=offset),
                                   deviation_reference.interpolate_latents(x1_part, ts, 3, offset),
                                   atol=tol * 10, rtol=tol)
        torch.testing.assert_close(scores, expected, atol=tol, rtol=tol)
        torch.testing.assert_close(grad, expected_grad, atol=tol, rtol=tol)


def softmax_inputs(rows, vocab, scale, seed=0, device="cpu"):
    """Float32 logits (rows, vocab) of spread ``scale``, int64 targets, and two float32 upstream gradients."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * scale
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    grads = torch.randn(rows, generator=generator), torch.randn(rows, generator=generator)
    return tuple(t.to(device) for t in (logits, targets, *grads))


def softmax_float64_truth(logits, targets, temperature, grad_logprob, grad_entropy):
    """log p(target), entropy and log-normaliser of z/T, and ∂(Σ g_p·log p + g_H·H)/∂z by float64 autograd."""
    z = logits.double().requires_grad_()
    tempered = z / temperature
    log_normalizer = torch.logsumexp(tempered, -1)
    log_probs = tempered - log_normalizer[:, None]
    logprob = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    objective = (logprob * grad_logprob.double()).sum()
    if grad_entropy is not None:
        objective = objective + (entropy * grad_entropy.double()).sum()
    objective.backward()
    return logprob.detach(), entropy.detach(), log_normalizer.detach(), z.grad


def assert_softmax_op_matches_float64(rows, vocab, scale, temperature, with_entropy, gradient_tolerance=1e-6,
                                      device="cpu"):
    """:mod:`flowkit.kernels.logprob_entropy` (whichever backend runs) against float64, with tolerances that grow
    with |z/T| (float32 rounding of z/T and of the log-normaliser) and, for the gradient, with its size."""
    from flowkit.kernels import logprob_entropy as op

    logits, targets, grad_logprob, grad_entropy = softmax_inputs(rows, vocab, scale, device=device)
    grad_entropy = grad_entropy if with_entropy else None
    truth = softmax_float64_truth(logits, targets, temperature, grad_logprob, grad_entropy)
    values = op.logprob_entropy(logits, targets, temperature)
    magnitude = max(1.0, logits.abs().max().item() / temperature)
    for value, expected in zip(values, truth[:3]):
        assert value.dtype == torch.float32 and value.shape == (rows,)
        torch.testing.assert_close(value.double(), expected, atol=1e-5 * magnitude, rtol=1e-5)
    buffer = logits.clone()
    grad = op.logprob_entropy_backward_(buffer, targets, values[2], values[1], grad_logprob, grad_entropy, temperature)
    assert grad.data_ptr() == buffer.data_ptr()  # written over the logits
    scale = magnitude * max(1.0, truth[3].abs().max().item()) * gradient_tolerance
    torch.testing.assert_close(grad.double(), truth[3], atol=scale, rtol=1e-5)
