"""The SwiGLU gate of Llama-family MLPs, ``silu(gate) · up``, differentiable in both.

PyTorch runs it as silu, a product and, in the backward, their gradients: about seven passes over the M ×
intermediate activations and four fresh tensors of that size, which on CPU cost more than the products around them
at small hidden sizes (2.2 ms forward and backward for 1024 × 512 floats on a Zen 4 core). The native CPU kernel
(``csrc/swiglu/``) makes one pass each way, recomputing the sigmoid in the backward. It agrees with the reference to
float32 rounding (its own exponential: ≤ 2 ulp), not bitwise. Everything else (CUDA, other dtypes, CPU autocast,
a ``flowkit._C`` without the op, ``FLOWKIT_KERNELS=reference``) runs the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .backends import runs_native_cpu_float32
from .reference import swiglu as reference


def backend_for(gate: Tensor) -> str:
    """The implementation the op runs for this input: "native" or "reference"."""
    return "native" if runs_native_cpu_float32(gate, "swiglu") else "reference"


class _NativeSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return torch.ops.flowkit.swiglu(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return torch.ops.flowkit.swiglu_backward(grad, *ctx.saved_tensors)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) · up`` for two tensors of one shape, differentiable in both."""
    if backend_for(gate) == "native" and up.dtype == torch.float32:
        gate, up = gate.contiguous(), up.contiguous()
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _NativeSwiGLU.apply(gate, up)
        return torch.ops.flowkit.swiglu(gate, up)  # nothing to record: no autograd Function's Python
    return reference.swiglu(gate, up)
