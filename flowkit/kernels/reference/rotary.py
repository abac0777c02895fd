"""Rotary position embedding in PyTorch, op for op as transformers' Llama-family ``apply_rotary_pos_emb``."""

from __future__ import annotations

import torch
from torch import Tensor


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x·cos + rotate_half(x)·sin``; ``cos`` and ``sin`` broadcast against ``x``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
