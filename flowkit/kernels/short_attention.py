"""Masked attention of short sequences with grouped KV heads: a padded training forward's attention on CPU.

A training forward over padded rows (left padding, or responses reading a group's cached prompt) attends each of
~30 queries per row and head to ~45 keys under a mask. PyTorch's flash kernel for CPU tiles queries and keys into
blocks sized for long sequences, and at these lengths its setup outweighs the arithmetic. The native CPU kernel
(``csrc/short_attention/``) takes each (row, KV head) pair as one task: each query's scores against the pair's keys
16 at a time, the softmax, the weighted values, the group's query heads reading keys and values while they are in
cache; the backward recomputes the probabilities from the saved log-normalisers. It runs at head dimensions 32, 64
and 128 up to :data:`MAX_KEYS` keys (a pair's keys and values stay in a core's cache) and agrees with the reference to
float32 rounding (summation order); a query with every key masked gets zeros and no gradient. Everything else (CUDA,
other dtypes, CPU autocast, a ``flowkit._C`` without the op, ``FLOWKIT_KERNELS=reference``) runs the reference: SDPA
with ``enable_gqa``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .backends import runs_native_cpu_float32
from .reference import short_attention as reference

NATIVE_HEAD_DIMS = (32, 64, 128)
MAX_KEYS = 512  # 512 keys and values of dimension 128: 512 KB, a Zen 4 core's L2 half full


def backend_for(query: Tensor, key: Tensor) -> str:
    """The implementation the op runs for these inputs: "native" or "reference"."""
    native = (query.shape[-1] in NATIVE_HEAD_DIMS and key.shape[-2] <= MAX_KEYS
              and runs_native_cpu_float32(query, "short_attention"))
    return "native" if native else "reference"


class _NativeShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
        out, lse = torch.ops.flowkit.short_attention(query, key, value, mask, scale)
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        query, key, value, out, lse, mask = ctx.saved_tensors
        grads = torch.ops.flowkit.short_attention_backward(grad.contiguous(), query, key, value, out, lse, mask,
                                                           ctx.scale)
        return *grads, None, None


def short_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """(B, H, Q, D) queries against (B, Hkv, K, D) keys and values (Hkv dividing H; any strides but a dense last
    one) where the bool ``mask`` (B, 1, Q, K) is true: (B, Q, H, D), differentiable in the three."""
    if (backend_for(query, key) == "native" and key.dtype == value.dtype == torch.float32
            and mask.dtype == torch.bool and mask.shape[1] == 1):
        return _NativeShortAttention.apply(query, key, value, mask, scale)
    return reference.short_attention(query, key, value, mask, scale)
