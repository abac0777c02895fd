"""Plain PyTorch reference for flow-token attention over a frozen last layer's cached context (TPL, seed 000 §3)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half: (x1, x2) → (−x2, x1) on the two halves of the head dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    """RoPE as HF Llama/Qwen2 apply it: x·cos + rotate_half(x)·sin, angles ``position · inv_freq`` duplicated.

    ``x``: ``(..., heads, head_dim)``; ``positions``: ``x.shape[:-2]``.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    freqs = positions.unsqueeze(-1).to(compute) * inv_freq.to(compute)
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
    cos, sin = angles.cos() * attention_scaling, angles.sin() * attention_scaling
    return (x.to(compute) * cos + rotate_half(x.to(compute)) * sin).to(x.dtype)


def project_flow_tokens(flow_hidden, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, flow_positions, inv_freq,
                        attention_scaling, num_heads, num_kv_heads):
    """Q, K, V of the flow tokens with RoPE at their positions: ``(B, S, F, heads, head_dim)`` each."""
    head_dim = q_weight.shape[0] // num_heads
    lead = flow_hidden.shape[:-1]
    q = F.linear(flow_hidden, q_weight, q_bias).view(*lead, num_heads, head_dim)
    k = F.linear(flow_hidden, k_weight, k_bias).view(*lead, num_kv_heads, head_dim)
    v = F.linear(flow_hidden, v_weight, v_bias).view(*lead, num_kv_heads, head_dim)
    q = apply_rope(q, flow_positions, inv_freq, attention_scaling)
    k = apply_rope(k, flow_positions, inv_freq, attention_scaling)
    return q, k, v


def attention_core(q, flow_k, flow_v, context_k, context_v, prefix_lengths):
    """softmax(q·[ctx_k[:len], flow_k]ᵀ/√dh)·[ctx_v[:len], flow_v] with GQA; returns ``(B, S, F, H, dh)``.

    Materialises the full score tensor ``(B, S, F, H, N + F)``; fused implementations stream over the context.
    """
    batch, steps, num_flow, num_heads, head_dim = q.shape
    num_kv_heads, num_context = context_k.shape[1], context_k.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    ctx_k = context_k.repeat_interleave(group, dim=1).to(q.dtype)  # (B, H, N, dh)
    ctx_v = context_v.repeat_interleave(group, dim=1).to(q.dtype)
    f_k = flow_k.repeat_interleave(group, dim=3)  # (B, S, F, H, dh)
    f_v = flow_v.repeat_interleave(group, dim=3)
    ctx_scores = torch.einsum("bsfhd,bhnd->bsfhn", q, ctx_k) * scale
    outside = torch.arange(num_context, device=q.device).view(1, 1, -1) >= prefix_lengths.unsqueeze(-1)
    ctx_scores = ctx_scores.masked_fill(outside.view(batch, steps, 1, 1, num_context), float("-inf"))
    flow_scores = torch.einsum("bsfhd,bsghd->bsfhg", q, f_k) * scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    probs = torch.softmax(torch.cat((ctx_scores, flow_scores), dim=-1).to(compute), dim=-1).to(q.dtype)
    ctx_probs, flow_probs = probs.split((num_context, num_flow), dim=-1)
    return torch.einsum("bsfhn,bhnd->bsfhd", ctx_probs, ctx_v) + torch.einsum("bsfhg,bsghd->bsfhd", flow_probs, f_v)


def flow_token_attention(flow_hidden, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, context_k, context_v,
                         prefix_lengths, flow_positions, inv_freq, attention_scaling=1.0, *, num_heads, num_kv_heads):
    """Reference flow-token attention; see :func:`flowkit.kernels.flow_token_attention` for the contract."""
    q, k, v = project_flow_tokens(flow_hidden, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, flow_positions,
                                  inv_freq, attention_scaling, num_heads, num_kv_heads)
    out = attention_core(q, k, v, context_k, context_v, prefix_lengths)
    return out.flatten(-2)
