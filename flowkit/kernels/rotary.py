"""Rotary position embedding of one decoding step's queries or keys: ``x·cos + rotate_half(x)·sin`` per head.

transformers computes it as seven ops (two products, a negation, two slices, a concatenation and a sum); in a
decoding step, where each is a few µs of dispatch over 128 rows, the query's and key's take ~56 ops per step of the
bundled 4-layer policy. The native CPU kernel (``csrc/rotary/``) makes one pass, each product and the sum rounded as
PyTorch rounds them, so it equals the reference to the bit. It has no backward: with gradients enabled on an input
that needs them, and everywhere else (CUDA, other dtypes, CPU autocast, a ``flowkit._C`` without the op,
``FLOWKIT_KERNELS=reference``), the reference runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backends import runs_native_cpu_float32
from .reference import rotary as reference


def backend_for(x: Tensor) -> str:
    """The implementation the op runs for this input: "native" or "reference"."""
    recorded = torch.is_grad_enabled() and x.requires_grad
    return "native" if not recorded and runs_native_cpu_float32(x, "rotary") else "reference"


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` (rows, heads, dim) rotated by ``cos`` and ``sin`` (rows, dim): (rows, heads, dim)."""
    if backend_for(x) == "native" and cos.dtype == sin.dtype == torch.float32:
        return torch.ops.flowkit.rotary(x.contiguous(), cos.contiguous(), sin.contiguous())
    return reference.rotary(x, cos[:, None], sin[:, None])
