"""The rectified-flow vector field φ(t, z_t | c, y) of seed 000 §3.1 / App. C.

Two ReLU + LayerNorm MLPs embed PE(t) and z_t into two flow tokens of the LLM width d; the frozen last
layer's W_Q/W_K/W_V project them and they attend jointly over that layer's cached context K/V (keys
[0, prefix_length)) and each other; the z_t token's attention output, through the frozen o_proj, feeds a
four-layer ReLU + LayerNorm projector that sees z_t and t again at every hidden layer (skip inputs) and
returns the velocity in R^|A|.

``use_attention=False`` is the paper's attention-free ablation: the projector reads the mean of the
backbone's final hidden states over the same prefix instead of the attended flow token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from flowkit.explain.context import ContextEncoding
from flowkit.kernels import flow_token_attention


def time_encoding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal PE(t) for t ∈ [0, 1]: ``[..., dim]``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = (t.float()[..., None] * 1000.0) * freqs
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


def embedding_mlp(in_dim: int, out_dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim), nn.ReLU(), nn.Linear(out_dim, out_dim),
                         nn.LayerNorm(out_dim))


class Projector(nn.Module):
    """Four linear layers, ReLU + LayerNorm between them, z_t and t appended to every layer's input."""

    def __init__(self, in_dim: int, hidden_dim: int, num_decisions: int, num_layers: int = 4):
        super().__init__()
        skip = num_decisions + 1
        in_dims = [in_dim] + [hidden_dim] * (num_layers - 2)
        self.hidden = nn.ModuleList(nn.Linear(d + skip, hidden_dim) for d in in_dims)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden_dim) for _ in in_dims)
        self.out = nn.Linear(hidden_dim + skip, num_decisions)

    def forward(self, h: Tensor, z_t: Tensor, t: Tensor) -> Tensor:
        dtype = self.out.weight.dtype  # bf16 when DeepSpeed casts the module; the inputs may be fp32
        skip = torch.cat((z_t, t[..., None]), dim=-1).to(dtype)
        h = h.to(dtype)
        for linear, norm in zip(self.hidden, self.norms):
            h = torch.relu(norm(linear(torch.cat((h, skip), dim=-1))))
        return self.out(torch.cat((h, skip), dim=-1)).float()


class ExplanationFlow(nn.Module):
    """φ_θ(t, z_t | c, y) over |A| decision logits (only these MLPs train; the backbone stays frozen)."""

    def __init__(self, num_decisions: int, hidden_size: int, time_dim: int = 64, projector_dim: int = 256,
                 use_attention: bool = True):
        super().__init__()
        self.num_decisions = num_decisions
        self.time_dim = time_dim
        self.use_attention = use_attention
        self.embed_time = embedding_mlp(time_dim, hidden_size)
        self.embed_state = embedding_mlp(num_decisions, hidden_size)
        self.embed_pooled = None if use_attention else embedding_mlp(hidden_size, hidden_size)
        self.projector = Projector(hidden_size, projector_dim, num_decisions)

    def flow_tokens(self, t: Tensor, z_t: Tensor) -> Tensor:
        """H_Emb = (h_{Emb,t}, h_{Emb,z_t}): ``[B, S, 2, d]``, in the MLPs' dtype."""
        dtype = self.embed_time[0].weight.dtype
        return torch.stack((self.embed_time(time_encoding(t, self.time_dim).to(dtype)), self.embed_state(z_t.to(dtype))),
                           dim=-2)

    def forward(self, t: Tensor, z_t: Tensor, context: ContextEncoding, prefix_lengths: Tensor) -> Tensor:
        """Velocity ``[B, S, |A|]`` for ``t`` [B, S], ``z_t`` [B, S, |A|], ``prefix_lengths`` [B, S]: row b's
        evaluation s reads context keys [0, prefix_lengths[b, s]) of row b."""
        tokens = self.flow_tokens(t, z_t)
        if self.use_attention:
            h = self.attend(tokens, context, prefix_lengths)
        else:
            pooled = prefix_means(context.hidden, prefix_lengths).to(tokens.dtype)
            h = tokens[..., 0, :] + tokens[..., 1, :] + self.embed_pooled(pooled)
        return self.projector(h, z_t, t)

    def attend(self, tokens: Tensor, context: ContextEncoding, prefix_lengths: Tensor) -> Tensor:
        """h_{Attn, z_t}: the z_t flow token after joint attention with the frozen last layer (after o_proj)."""
        layer = context.last_layer
        dtype = context.keys.dtype
        hidden = layer.input_layernorm(tokens.to(dtype))
        positions = prefix_lengths[..., None] + torch.arange(tokens.shape[-2], device=tokens.device)
        attended = flow_token_attention(
            hidden, layer.q_weight, layer.k_weight, layer.v_weight, layer.q_bias, layer.k_bias, layer.v_bias,
            context.keys, context.values, prefix_lengths, positions, layer.inv_freq, layer.attention_scaling,
            num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
        )
        return layer.o_proj(attended[..., 1, :]).float()


def prefix_means(hidden: Tensor, prefix_lengths: Tensor) -> Tensor:
    """Mean of ``hidden`` [B, N, d] over positions [0, prefix_lengths[b, s]): ``[B, S, d]`` (one cumsum)."""
    sums = torch.cat((hidden.new_zeros(hidden.shape[0], 1, hidden.shape[-1]), hidden.float().cumsum(1)), dim=1)
    index = prefix_lengths[..., None].expand(-1, -1, hidden.shape[-1])
    return sums.gather(1, index) / prefix_lengths[..., None].clamp(min=1)
