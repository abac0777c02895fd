"""SwiGLU in PyTorch, as transformers' Llama-family MLPs compute it."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up
