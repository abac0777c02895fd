"""Triton kernels for the flow-token attention core (``torch.ops.flowkit_triton::flow_attention``).

One program per ``(b, s, kv head)`` holds that evaluation's ``F·G`` query rows (G = H / Hkv), streams the
context keys ``[0, prefix_len)`` in blocks with an online softmax, then the ``F`` flow keys. The backward
recomputes probabilities from the saved log-sum-exp; the flow keys belong to the program, so their gradients
need no atomics, and the context K/V get none.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

BLOCK_KEYS = 64


@triton.jit
def _query_rows(b, s, kvh, num_steps, num_flow, num_heads, group, head_dim, BLOCK_M: tl.constexpr):
    """Element offsets of the program's query rows (f, g) → q[b, s, f, kvh·G + g] and their validity."""
    i = tl.arange(0, BLOCK_M)
    f = i // group
    h = kvh * group + i % group
    rows = ((b * num_steps + s) * num_flow + f) * num_heads + h
    return rows.to(tl.int64) * head_dim, rows, i < num_flow * group


@triton.jit
def _flow_attention_fwd(q_ptr, fk_ptr, fv_ptr, ck_ptr, cv_ptr, len_ptr, out_ptr, lse_ptr, scale, num_steps, num_flow,
                        num_heads, num_kv_heads, num_context, head_dim, group,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
                        PRECISION: tl.constexpr):
    task = tl.program_id(0)
    kvh = task % num_kv_heads
    s = (task // num_kv_heads) % num_steps
    b = task // (num_kv_heads * num_steps)
    length = tl.load(len_ptr + b * num_steps + s)
    q_off, rows, row_ok = _query_rows(b, s, kvh, num_steps, num_flow, num_heads, group, head_dim, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    ctx_base = (b * num_kv_heads + kvh).to(tl.int64) * num_context * head_dim
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < length
        kv_off = ctx_base + n.to(tl.int64)[:, None] * head_dim + d[None, :]
        k = tl.load(ck_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(cv_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        scores = tl.where(n_ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    j = tl.arange(0, BLOCK_F)
    j_ok = j < num_flow
    f_off = (((b * num_steps + s) * num_flow + j) * num_kv_heads + kvh).to(tl.int64)[:, None] * head_dim + d[None, :]
    k = tl.load(fk_ptr + f_off, mask=j_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(fv_ptr + f_off, mask=j_ok[:, None] & d_ok[None, :], other=0.0)
    scores = tl.where(j_ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION), float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + q_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + rows, m_new + tl.log(l), mask=row_ok)


@triton.jit
def _flow_attention_bwd(grad_ptr, q_ptr, fk_ptr, fv_ptr, ck_ptr, cv_ptr, len_ptr, out_ptr, lse_ptr,
                        dq_ptr, dfk_ptr, dfv_ptr, scale, num_steps, num_flow, num_heads, num_kv_heads, num_context,
                        head_dim, group, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    task = tl.program_id(0)
    kvh = task % num_kv_heads
    s = (task // num_kv_heads) % num_steps
    b = task // (num_kv_heads * num_steps)
    length = tl.load(len_ptr + b * num_steps + s)
    q_off, rows, row_ok = _query_rows(b, s, kvh, num_steps, num_flow, num_heads, group, head_dim, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    qd_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=qd_ok, other=0.0)
    q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
    grad_out = tl.load(grad_ptr + q_off[:, None] + d[None, :], mask=qd_ok, other=0.0)
    out = tl.load(out_ptr + q_off[:, None] + d[None, :], mask=qd_ok, other=0.0)
    delta = tl.sum(grad_out.to(tl.float32) * out.to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    ctx_base = (b * num_kv_heads + kvh).to(tl.int64) * num_context * head_dim
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < length
        kv_off = ctx_base + n.to(tl.int64)[:, None] * head_dim + d[None, :]
        k = tl.load(ck_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(cv_ptr + kv_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.where(row_ok[:, None] & n_ok[None, :], tl.exp(scores - lse[:, None]), 0.0)
        dp = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    j = tl.arange(0, BLOCK_F)
    j_ok = j < num_flow
    f_off = (((b * num_steps + s) * num_flow + j) * num_kv_heads + kvh).to(tl.int64)[:, None] * head_dim + d[None, :]
    fd_ok = j_ok[:, None] & d_ok[None, :]
    k = tl.load(fk_ptr + f_off, mask=fd_ok, other=0.0)
    v = tl.load(fv_ptr + f_off, mask=fd_ok, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    p = tl.where(row_ok[:, None] & j_ok[None, :], tl.exp(scores - lse[:, None]), 0.0)
    dp = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)  # q carries the 1/√dh scale
    dv = tl.dot(tl.trans(p.to(grad_out.dtype)), grad_out, input_precision=PRECISION)
    tl.store(dq_ptr + q_off[:, None] + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=qd_ok)
    tl.store(dfk_ptr + f_off, dk.to(dfk_ptr.dtype.element_ty), mask=fd_ok)
    tl.store(dfv_ptr + f_off, dv.to(dfv_ptr.dtype.element_ty), mask=fd_ok)


def _launch_meta(q: torch.Tensor, flow_k: torch.Tensor) -> dict:
    num_flow, num_heads, head_dim = q.shape[2], q.shape[3], q.shape[4]
    group = num_heads // flow_k.shape[3]
    return dict(
        BLOCK_M=max(16, triton.next_power_of_2(num_flow * group)), BLOCK_N=BLOCK_KEYS,
        BLOCK_F=max(16, triton.next_power_of_2(num_flow)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _shape_args(q: torch.Tensor, flow_k: torch.Tensor, context_k: torch.Tensor) -> tuple:
    _, steps, num_flow, num_heads, head_dim = q.shape
    num_kv_heads = flow_k.shape[3]
    return (1.0 / math.sqrt(head_dim), steps, num_flow, num_heads, num_kv_heads, context_k.shape[2], head_dim,
            num_heads // num_kv_heads)


@triton_op("flowkit_triton::flow_attention", mutates_args=())
def flow_attention_core(q: torch.Tensor, flow_k: torch.Tensor, flow_v: torch.Tensor, context_k: torch.Tensor,
                        context_v: torch.Tensor, prefix_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(B, S, F, H, dh)`` and float32 log-sum-exp ``(B, S, F, H)``; same contract as the native op."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    grid = (q.shape[0] * q.shape[1] * flow_k.shape[3],)
    wrap_triton(_flow_attention_fwd)[grid](q, flow_k, flow_v, context_k, context_v, prefix_lengths, out, lse,
                                           *_shape_args(q, flow_k, context_k), **_launch_meta(q, flow_k))
    return out, lse


@triton_op("flowkit_triton::flow_attention_backward", mutates_args=())
def flow_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, flow_k: torch.Tensor, flow_v: torch.Tensor,
                            context_k: torch.Tensor, context_v: torch.Tensor, prefix_lengths: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. q and the flow keys / values (the context K/V are frozen)."""
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(flow_k), torch.empty_like(flow_v)
    grid = (q.shape[0] * q.shape[1] * flow_k.shape[3],)
    wrap_triton(_flow_attention_bwd)[grid](grad_out.contiguous(), q, flow_k, flow_v, context_k, context_v,
                                           prefix_lengths, out, lse, grad_q, grad_k, grad_v,
                                           *_shape_args(q, flow_k, context_k), **_launch_meta(q, flow_k))
    return grad_q, grad_k, grad_v


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, grad_out, grad_lse):
    q, flow_k, flow_v, context_k, context_v, prefix_lengths, out, lse = ctx.saved_tensors
    grads = flow_attention_backward(grad_out, q, flow_k, flow_v, context_k, context_v, prefix_lengths, out, lse)
    return *grads, None, None, None


flow_attention_core.register_autograd(_backward, setup_context=_setup_context)


def flow_attention(q, flow_k, flow_v, context_k, context_v, prefix_lengths) -> torch.Tensor:
    """Attention output only (what :func:`flowkit.kernels.flow_token_attention` needs)."""
    return flow_attention_core(q, flow_k, flow_v, context_k, context_v, prefix_lengths)[0]
