"""Flow-token attention fused with a frozen LLM's last layer (explanation rewards, seed 000 §3 / DESIGN §5.2)."""

from __future__ import annotations

import torch

from .backends import select_backend
from .reference import flow_attention as reference


def flow_token_attention(
    flow_hidden: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_bias: torch.Tensor | None,
    v_bias: torch.Tensor | None,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    prefix_lengths: torch.Tensor,
    flow_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    *,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Attention output of flow tokens that join a frozen last layer's attention, **before** ``o_proj``.

    Each flow token is projected with the frozen layer's ``q/k/v_proj`` (weights ``(H·dh, d)``,
    ``(Hkv·dh, d)``, ``(Hkv·dh, d)``, optional biases), its query and key get RoPE at ``flow_positions``
    (HF ``rotate_half`` convention, cos/sin multiplied by ``attention_scaling``), and its query attends with
    scale 1/√dh over the cached context keys ``[0, prefix_lengths[b, s])`` of example ``b`` plus the keys of all
    ``F`` flow tokens of the same evaluation ``(b, s)`` (flow tokens see each other fully). GQA repeats each KV
    head for ``H / Hkv`` query heads. Because the LLM is causal, the last layer's K/V of a prefix equal the
    prefix of the full sequence's K/V, so one cached ``context_k/v`` serves every prefix length.

    Args:
        flow_hidden: ``(B, S, F, d)`` flow-token hidden states (S independent evaluations per example).
        context_k, context_v: ``(B, Hkv, N, dh)`` cached last-layer keys (already RoPE'd, as HF caches them)
            and values.
        prefix_lengths: ``(B, S)`` int64 with ``0 < len ≤ N``.
        flow_positions: ``(B, S, F)`` int64 positions of the flow tokens.
        inv_freq: ``(dh / 2,)`` the model's ``rotary_emb.inv_freq``.

    Returns:
        ``(B, S, F, H·dh)``; apply the frozen ``o_proj`` to get the layer's attention output. Gradients flow
        to ``flow_hidden`` only: the weights and the context K/V are treated as frozen (detached).
    """
    head_dim = q_weight.shape[0] // num_heads
    if context_k.shape[-1] != head_dim or inv_freq.numel() * 2 != head_dim:
        raise ValueError(f"head_dim {head_dim} does not match context_k {tuple(context_k.shape)} / inv_freq")
    frozen = [t.detach() if t is not None else None for t in (q_weight, k_weight, v_weight, q_bias, k_bias, v_bias)]
    q, k, v = reference.project_flow_tokens(flow_hidden, *frozen, flow_positions, inv_freq, attention_scaling,
                                            num_heads, num_kv_heads)
    context_k, context_v = context_k.detach().to(q.dtype), context_v.detach().to(q.dtype)
    prefix_lengths = prefix_lengths.to(device=q.device, dtype=torch.long)
    backend = select_backend(flow_hidden.device)
    if backend == "reference":
        out = reference.attention_core(q, k, v, context_k, context_v, prefix_lengths)
    elif backend == "native":
        out, _ = torch.ops.flowkit.flow_attention(q.contiguous(), k.contiguous(), v.contiguous(), context_k.contiguous(),
                                                  context_v.contiguous(), prefix_lengths.contiguous())
    else:
        from .triton import flow_attention as triton_impl

        out = triton_impl.flow_attention(q.contiguous(), k.contiguous(), v.contiguous(), context_k.contiguous(),
                                         context_v.contiguous(), prefix_lengths.contiguous())
    return out.flatten(-2)
