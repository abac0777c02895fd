"""Masked attention with grouped KV heads in PyTorch: SDPA with ``enable_gqa``, output in transformers' layout."""

from __future__ import annotations

import torch
from torch import Tensor


def short_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """(B, H, Q, D) queries against (B, Hkv, K, D) keys and values where ``mask`` (B, 1, Q, K) is true: (B, Q, H, D)."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous()
