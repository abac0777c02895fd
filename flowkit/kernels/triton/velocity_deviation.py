"""Triton kernels for the RLFR prologue / epilogue (``torch.ops.flowkit_triton``), noise regenerated from the seed.

Rows of the stacked batch are ``(p, t, n)`` with p slowest; ε at ``(p, t, n, j)`` uses counter
``((token_offset + n)·P·T + p·T + t)·d + j`` (see :mod:`flowkit.kernels.velocity_deviation`).
Kernels accumulate in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..rng import stream_keys
from .rng import noise_at

# Tiles of at most 2,048 elements for 4 warps: 16 per thread keep the noise hash and its operands in registers on
# sm_90 (16 x 1024 tiles spilled 3-5 KB per thread and took 12-18 s to compile; benchmarks/compile_sm90.py checks).
BLOCK_ROWS = 4
BLOCK_TOKENS = 4
MAX_BLOCK_DIM = 512
NUM_WARPS = 4
# Run-time sizes, offsets and seed keys change every step: specialising on their values (== 1, divisible by 16)
# would compile a new variant per step (names a kernel lacks are ignored).
DYNAMIC_ARGS = ["k0", "k1", "num_rows", "num_tokens", "token_offset"]


def _block_dim(dim: int) -> int:
    return min(triton.next_power_of_2(dim), MAX_BLOCK_DIM)


def _int32_keys(seed: int) -> tuple[int, int]:
    """The stream keys as the int32 bit patterns of their uint32 values, so every seed binds the same i32 argument."""
    return tuple(key - (1 << 32) if key >= 1 << 31 else key for key in stream_keys(seed))


@triton.jit
def _noise_base(tokens, token_offset, groups, group, dim):
    """Counter of ε[p, t, n, 0]: ((token_offset + n)·P·T + p·T + t)·d (csrc/flow_noise.h deviation_noise_base)."""
    return ((tokens.to(tl.int64) + token_offset) * groups + group) * dim


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _interpolate_kernel(x1_ptr, t_ptr, out_ptr, k0, k1, num_rows, num_layers, num_tokens, num_steps, dim, token_offset,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    n = rows % num_tokens
    pt = rows // num_tokens
    p = pt // num_steps
    t = tl.load(t_ptr + pt % num_steps, mask=row_ok, other=0.0)
    x_rows = (p * num_tokens + n).to(tl.int64) * dim
    out_rows = rows.to(tl.int64) * dim
    noise_rows = _noise_base(n, token_offset, num_layers * num_steps, pt, dim)
    for start in range(0, dim, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (cols < dim)[None, :]
        x = tl.load(x1_ptr + x_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        eps = noise_at(noise_rows[:, None] + cols[None, :], k0, k1)
        x_t = t[:, None] * x + (1.0 - t[:, None]) * eps
        tl.store(out_ptr + out_rows[:, None] + cols[None, :], x_t.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _deviation_kernel(v_ptr, x1_ptr, w_ptr, mask_ptr, score_ptr, k0, k1, num_layers, num_steps, num_tokens, dim,
                      token_offset, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_ok = tokens < num_tokens
    keep = tl.load(mask_ptr + tokens, mask=token_ok, other=0.0)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for p in range(num_layers):
        x_rows = (p * num_tokens + tokens).to(tl.int64) * dim
        for t in range(num_steps):
            v_rows = ((p * num_steps + t) * num_tokens + tokens).to(tl.int64) * dim
            noise_rows = _noise_base(tokens, token_offset, num_layers * num_steps, p * num_steps + t, dim)
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for start in range(0, dim, BLOCK_D):
                cols = start + tl.arange(0, BLOCK_D)
                ok = token_ok[:, None] & (cols < dim)[None, :]
                v = tl.load(v_ptr + v_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                x = tl.load(x1_ptr + x_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                eps = noise_at(noise_rows[:, None] + cols[None, :], k0, k1)
                diff = tl.where(ok, v - x + eps, 0.0)
                acc += tl.sum(diff * diff, axis=1)
            total += tl.load(w_ptr + t) * acc
    score = keep * total / (num_layers * num_steps * dim)
    tl.store(score_ptr + tokens, score.to(score_ptr.dtype.element_ty), mask=token_ok)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _deviation_backward_kernel(grad_ptr, v_ptr, x1_ptr, w_ptr, mask_ptr, grad_v_ptr, k0, k1, num_rows, num_layers,
                               num_tokens, num_steps, dim, token_offset, norm, BLOCK_R: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    n = rows % num_tokens
    pt = rows // num_tokens
    p = pt // num_steps
    coef = (norm * tl.load(grad_ptr + n, mask=row_ok, other=0.0).to(tl.float32)
            * tl.load(mask_ptr + n, mask=row_ok, other=0.0) * tl.load(w_ptr + pt % num_steps, mask=row_ok, other=0.0))
    x_rows = (p * num_tokens + n).to(tl.int64) * dim
    v_rows = rows.to(tl.int64) * dim
    noise_rows = _noise_base(n, token_offset, num_layers * num_steps, pt, dim)
    for start in range(0, dim, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (cols < dim)[None, :]
        v = tl.load(v_ptr + v_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x1_ptr + x_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        eps = noise_at(noise_rows[:, None] + cols[None, :], k0, k1)
        grad_v = coef[:, None] * (v - x + eps)
        tl.store(grad_v_ptr + v_rows[:, None] + cols[None, :], grad_v.to(grad_v_ptr.dtype.element_ty), mask=ok)


@triton_op("flowkit_triton::interpolate_latents", mutates_args=())
def interpolate_latents(x1: torch.Tensor, timesteps: torch.Tensor, seed: int, token_offset: int) -> torch.Tensor:
    """Prologue; contract of :func:`flowkit.kernels.interpolate_latents` (contiguous inputs, float32 timesteps)."""
    num_layers, num_tokens, dim = x1.shape
    num_rows = num_layers * timesteps.shape[0] * num_tokens
    out = torch.empty((num_rows, dim), device=x1.device, dtype=x1.dtype)
    k0, k1 = _int32_keys(seed)
    grid = (triton.cdiv(num_rows, BLOCK_ROWS),)
    wrap_triton(_interpolate_kernel)[grid](x1, timesteps, out, k0, k1, num_rows, num_layers, num_tokens,
                                           timesteps.shape[0], dim, token_offset,
                                           BLOCK_R=BLOCK_ROWS, BLOCK_D=_block_dim(dim), num_warps=NUM_WARPS)
    return out


@triton_op("flowkit_triton::velocity_deviation", mutates_args=())
def velocity_deviation(v: torch.Tensor, x1: torch.Tensor, timesteps: torch.Tensor, weights: torch.Tensor, seed: int,
                       token_offset: int, mask: torch.Tensor) -> torch.Tensor:
    """Epilogue; contract of :func:`flowkit.kernels.velocity_deviation` (contiguous inputs, float32 vectors)."""
    num_layers, num_tokens, dim = x1.shape
    score_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    score = torch.empty((num_tokens,), device=v.device, dtype=score_dtype)
    k0, k1 = _int32_keys(seed)
    grid = (triton.cdiv(num_tokens, BLOCK_TOKENS),)
    wrap_triton(_deviation_kernel)[grid](v, x1, weights, mask, score, k0, k1, num_layers, timesteps.shape[0],
                                         num_tokens, dim, token_offset, BLOCK_N=BLOCK_TOKENS, BLOCK_D=_block_dim(dim),
                                         num_warps=NUM_WARPS)
    return score


@triton_op("flowkit_triton::velocity_deviation_backward", mutates_args=())
def velocity_deviation_backward(grad_score: torch.Tensor, v: torch.Tensor, x1: torch.Tensor, timesteps: torch.Tensor,
                                weights: torch.Tensor, seed: int, token_offset: int, mask: torch.Tensor) -> torch.Tensor:
    """∂score/∂v · grad_score without storing ε (2·g·mask·w_t / (P·T·d) · (v − x1 + ε))."""
    num_layers, num_tokens, dim = x1.shape
    num_rows = v.shape[0]
    grad_v = torch.empty_like(v)
    k0, k1 = _int32_keys(seed)
    norm = 2.0 / (num_layers * timesteps.shape[0] * dim)
    grid = (triton.cdiv(num_rows, BLOCK_ROWS),)
    wrap_triton(_deviation_backward_kernel)[grid](grad_score.contiguous(), v, x1, weights, mask, grad_v, k0, k1,
                                                  num_rows, num_layers, num_tokens, timesteps.shape[0], dim,
                                                  token_offset, norm,
                                                  BLOCK_R=BLOCK_ROWS, BLOCK_D=_block_dim(dim), num_warps=NUM_WARPS)
    return grad_v


def _setup_context(ctx, inputs, output):
    v, x1, timesteps, weights, seed, token_offset, mask = inputs
    ctx.save_for_backward(v, x1, timesteps, weights, mask)
    ctx.seed, ctx.token_offset = seed, token_offset


def _backward(ctx, grad_score):
    v, x1, timesteps, weights, mask = ctx.saved_tensors
    grad_v = velocity_deviation_backward(grad_score, v, x1, timesteps, weights, ctx.seed, ctx.token_offset, mask)
    return grad_v, None, None, None, None, None, None


velocity_deviation.register_autograd(_backward, setup_context=_setup_context)
