"""One decoding step's attention in PyTorch: ``scaled_dot_product_attention`` called as transformers' ``sdpa``
attention calls it for one query per row, so that a decoding step built on it gives HF's outputs bitwise."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def decode_attention(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``query`` (B, Hkv, G, D): each row's new queries, the G heads sharing a KV head together; ``keys``, ``values``
    (B, Hkv, L, D); ``mask`` (B, L) bool, False where a key is left out (None: none is). (B, Hkv, G, D)."""
    rows, kv_heads, group, dim = query.shape
    if mask is None and group > 1 and dim <= 256:  # transformers lets SDPA repeat the KV heads when nothing is masked
        heads = query.reshape(rows, kv_heads * group, 1, dim)
        return F.scaled_dot_product_attention(heads, keys, values, scale=scale, enable_gqa=True).view(query.shape)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=None if mask is None else mask[:, None, None],
                                          scale=scale)
