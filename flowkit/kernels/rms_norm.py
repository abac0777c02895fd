"""RMSNorm over the last dimension, ``w · x / sqrt(mean(x²) + eps)``, differentiable in ``x`` and ``w``.

PyTorch runs it as a cast, pow, mean, add, rsqrt and two products, and the backward as about a dozen more passes over
the M × d activations. The native CPU kernel (``csrc/rms_norm/``) makes one pass per row each way, keeping each
row's 1/rms for the backward (0.6 ms forward and backward for 1024 × 128 floats in PyTorch on a Zen 4 core). It agrees
with the reference to float32 rounding (summation order), not bitwise. Everything else (CUDA, other dtypes, CPU
autocast, a ``flowkit._C`` without the op, ``FLOWKIT_KERNELS=reference``) runs the reference: transformers' formula, its casts
included.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .backends import runs_native_cpu_float32
from .reference import rms_norm as reference


def backend_for(x: Tensor) -> str:
    """The implementation the op runs for this input: "native" or "reference"."""
    return "native" if runs_native_cpu_float32(x, "rms_norm") else "reference"


class _NativeRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out, inverse_rms = torch.ops.flowkit.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, inverse_rms)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return *torch.ops.flowkit.rms_norm_backward(grad, *ctx.saved_tensors), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight · x / sqrt(mean(x², last dim) + eps)``, differentiable in ``x`` and ``weight``."""
    if backend_for(x) == "native" and weight.dtype == torch.float32:
        x, weight = x.contiguous(), weight.contiguous()
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _NativeRMSNorm.apply(x, weight, eps)
        return torch.ops.flowkit.rms_norm(x, weight, eps)[0]  # nothing to record: no autograd Function's Python
    return reference.rms_norm(x, weight, eps)
