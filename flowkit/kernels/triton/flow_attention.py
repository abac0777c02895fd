"""Triton kernels for the flow-token attention core (``torch.ops.flowkit_triton::flow_attention``).

A task is one ``(b, s, kv head)`` evaluation with ``F·G`` query rows (G = H / Hkv). The forward and the ``dq`` pass
run one program per (task, block of ``BLOCK_M`` rows), streaming the context keys ``[0, prefix_len)`` and then the
``F`` flow keys in blocks with an online softmax; the flow-key pass runs one program per (task, block of
``BLOCK_F`` flow keys) and loops over the task's row blocks, so the flow keys' gradients need no atomics and the
context K/V get none. Blocks are bounded, so shared memory stays within a block's at any ``F·G``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# Bounded blocks, so a program's tiles fit sm_90's registers (no spills) and shared memory (< 50 KB of 227 KB) at
# head dim 128 whatever F·G is: the old one-block-per-task kernels needed a 512-row block at F·G 448, and 294,912 B
# of shared memory in the backward at 128 rows. fp32 gets half the rows: without tensor cores (``ieee``) its dots
# run on the FMA units with the operands in registers. benchmarks/compile_sm90.py checks these.
BLOCK_KEYS = 32
MAX_BLOCK_ROWS = {torch.float32: 16}  # other dtypes: DEFAULT_MAX_BLOCK_ROWS
DEFAULT_MAX_BLOCK_ROWS = 32
MAX_BLOCK_FLOW = 16
NUM_WARPS = 8
NUM_STAGES = 2
# Batch, evaluations per example and context length change every step (see velocity_deviation.DYNAMIC_ARGS).
DYNAMIC_ARGS = ["num_steps", "num_context"]


@triton.jit
def _task(num_steps, num_kv_heads):
    task = tl.program_id(0)
    return task // (num_kv_heads * num_steps), (task // num_kv_heads) % num_steps, task % num_kv_heads


@triton.jit
def _query_rows(b, s, kvh, row_start, num_steps, num_flow, num_heads, group, head_dim, BLOCK_M: tl.constexpr):
    """Element offsets of query rows ``row_start + i`` = (f, g) → q[b, s, f, kvh·G + g] and their validity."""
    i = row_start + tl.arange(0, BLOCK_M)
    f = i // group
    h = kvh * group + i % group
    rows = ((b * num_steps + s) * num_flow + f) * num_heads + h
    return rows.to(tl.int64) * head_dim, rows, i < num_flow * group


@triton.jit
def _flow_keys(b, s, kvh, key_start, num_steps, num_flow, num_kv_heads, head_dim, BLOCK_F: tl.constexpr):
    """Element offsets (without the head-dim column) of flow keys ``key_start + j`` and their validity."""
    j = key_start + tl.arange(0, BLOCK_F)
    return (((b * num_steps + s) * num_flow + j) * num_kv_heads + kvh).to(tl.int64) * head_dim, j < num_flow


@triton.jit
def _key_block(i, context_blocks, length, ctx_base, ck_ptr, cv_ptr, fk_ptr, fv_ptr, b, s, kvh, num_steps, num_flow,
               num_kv_heads, head_dim, d, d_ok, BLOCK_N: tl.constexpr):
    """Key block ``i`` of the task: context keys ``[i·BLOCK_N, …) ∩ [0, length)``, then (i ≥ context_blocks) flow keys."""
    if i < context_blocks:
        n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = n < length
        kv_off = ctx_base + n.to(tl.int64)[:, None] * head_dim + d[None, :]
        k = tl.load(ck_ptr + kv_off, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(cv_ptr + kv_off, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        f_off, key_ok = _flow_keys(b, s, kvh, (i - context_blocks) * BLOCK_N, num_steps, num_flow, num_kv_heads,
                                   head_dim, BLOCK_N)
        k = tl.load(fk_ptr + f_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(fv_ptr + f_off[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    return k, v, key_ok


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _flow_attention_fwd(q_ptr, fk_ptr, fv_ptr, ck_ptr, cv_ptr, len_ptr, out_ptr, lse_ptr, scale, num_steps, num_flow,
                        num_heads, num_kv_heads, num_context, head_dim, group,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    b, s, kvh = _task(num_steps, num_kv_heads)
    length = tl.load(len_ptr + b * num_steps + s)
    q_off, rows, row_ok = _query_rows(b, s, kvh, tl.program_id(1) * BLOCK_M, num_steps, num_flow, num_heads, group,
                                      head_dim, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    ctx_base = (b * num_kv_heads + kvh).to(tl.int64) * num_context * head_dim
    context_blocks = tl.cdiv(length, BLOCK_N)
    # the context keys, then the flow keys: one online softmax over both
    for i in range(0, context_blocks + tl.cdiv(num_flow, BLOCK_N)):
        k, v, key_ok = _key_block(i, context_blocks, length, ctx_base, ck_ptr, cv_ptr, fk_ptr, fv_ptr, b, s, kvh,
                                  num_steps, num_flow, num_kv_heads, head_dim, d, d_ok, BLOCK_N)
        scores = tl.where(key_ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + q_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + rows, m + tl.log(l), mask=row_ok)


@triton.jit
def _load_rows(grad_ptr, q_ptr, out_ptr, lse_ptr, q_off, rows, row_ok, d, d_ok, scale):
    """A row block's scaled q, dO, lse and delta = rowsum(dO ∘ O) (the softmax backward's correction)."""
    qd_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=qd_ok, other=0.0)
    q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
    grad_out = tl.load(grad_ptr + q_off[:, None] + d[None, :], mask=qd_ok, other=0.0)
    out = tl.load(out_ptr + q_off[:, None] + d[None, :], mask=qd_ok, other=0.0)
    delta = tl.sum(grad_out.to(tl.float32) * out.to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    return q, grad_out, lse, delta


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _flow_attention_bwd_dq(grad_ptr, q_ptr, fk_ptr, fv_ptr, ck_ptr, cv_ptr, len_ptr, out_ptr, lse_ptr, dq_ptr, scale,
                           num_steps, num_flow, num_heads, num_kv_heads, num_context, head_dim, group,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           PRECISION: tl.constexpr):
    b, s, kvh = _task(num_steps, num_kv_heads)
    length = tl.load(len_ptr + b * num_steps + s)
    q_off, rows, row_ok = _query_rows(b, s, kvh, tl.program_id(1) * BLOCK_M, num_steps, num_flow, num_heads, group,
                                      head_dim, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q, grad_out, lse, delta = _load_rows(grad_ptr, q_ptr, out_ptr, lse_ptr, q_off, rows, row_ok, d, d_ok, scale)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    ctx_base = (b * num_kv_heads + kvh).to(tl.int64) * num_context * head_dim
    context_blocks = tl.cdiv(length, BLOCK_N)
    for i in range(0, context_blocks + tl.cdiv(num_flow, BLOCK_N)):
        k, v, key_ok = _key_block(i, context_blocks, length, ctx_base, ck_ptr, cv_ptr, fk_ptr, fv_ptr, b, s, kvh,
                                  num_steps, num_flow, num_kv_heads, head_dim, d, d_ok, BLOCK_N)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.where(row_ok[:, None] & key_ok[None, :], tl.exp(scores - lse[:, None]), 0.0)
        dp = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dq_ptr + q_off[:, None] + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _flow_attention_bwd_dkv(grad_ptr, q_ptr, fk_ptr, fv_ptr, out_ptr, lse_ptr, dfk_ptr, dfv_ptr, scale, num_steps,
                            num_flow, num_heads, num_kv_heads, head_dim, group, BLOCK_M: tl.constexpr,
                            BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    b, s, kvh = _task(num_steps, num_kv_heads)
    f_off, key_ok = _flow_keys(b, s, kvh, tl.program_id(1) * BLOCK_F, num_steps, num_flow, num_kv_heads, head_dim,
                               BLOCK_F)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    fd_ok = key_ok[:, None] & d_ok[None, :]
    k = tl.load(fk_ptr + f_off[:, None] + d[None, :], mask=fd_ok, other=0.0)
    v = tl.load(fv_ptr + f_off[:, None] + d[None, :], mask=fd_ok, other=0.0)
    dk = tl.zeros((BLOCK_F, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_F, BLOCK_D), tl.float32)
    for row_start in range(0, num_flow * group, BLOCK_M):
        q_off, rows, row_ok = _query_rows(b, s, kvh, row_start, num_steps, num_flow, num_heads, group, head_dim,
                                          BLOCK_M)
        q, grad_out, lse, delta = _load_rows(grad_ptr, q_ptr, out_ptr, lse_ptr, q_off, rows, row_ok, d, d_ok, scale)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.where(row_ok[:, None] & key_ok[None, :], tl.exp(scores - lse[:, None]), 0.0)
        dp = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)  # q carries the 1/√dh scale
        dv += tl.dot(tl.trans(p.to(grad_out.dtype)), grad_out, input_precision=PRECISION)
    tl.store(dfk_ptr + f_off[:, None] + d[None, :], dk.to(dfk_ptr.dtype.element_ty), mask=fd_ok)
    tl.store(dfv_ptr + f_off[:, None] + d[None, :], dv.to(dfv_ptr.dtype.element_ty), mask=fd_ok)


def _precision(dtype: torch.dtype) -> str:
    """Tensor cores for fp32 inputs (tf32) only where PyTorch's own matmul setting allows them; bf16/fp16 always."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _launch_meta(q: torch.Tensor) -> dict:
    return dict(BLOCK_D=max(16, triton.next_power_of_2(q.shape[4])), PRECISION=_precision(q.dtype),
                num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _block_rows(q: torch.Tensor, flow_k: torch.Tensor) -> int:
    rows = q.shape[2] * (q.shape[3] // flow_k.shape[3])
    return min(MAX_BLOCK_ROWS.get(q.dtype, DEFAULT_MAX_BLOCK_ROWS), max(16, triton.next_power_of_2(rows)))


def _block_flow(flow_k: torch.Tensor) -> int:
    return min(MAX_BLOCK_FLOW, max(16, triton.next_power_of_2(flow_k.shape[2])))


def _shape_args(q: torch.Tensor, flow_k: torch.Tensor, context_k: torch.Tensor) -> tuple:
    _, steps, num_flow, num_heads, head_dim = q.shape
    num_kv_heads = flow_k.shape[3]
    return (1.0 / math.sqrt(head_dim), steps, num_flow, num_heads, num_kv_heads, context_k.shape[2], head_dim,
            num_heads // num_kv_heads)


def _tasks(q: torch.Tensor, flow_k: torch.Tensor) -> int:
    return q.shape[0] * q.shape[1] * flow_k.shape[3]


@triton_op("flowkit_triton::flow_attention", mutates_args=())
def flow_attention_core(q: torch.Tensor, flow_k: torch.Tensor, flow_v: torch.Tensor, context_k: torch.Tensor,
                        context_v: torch.Tensor, prefix_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(B, S, F, H, dh)`` and float32 log-sum-exp ``(B, S, F, H)``; same contract as the native op."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    block_rows = _block_rows(q, flow_k)
    grid = (_tasks(q, flow_k), triton.cdiv(q.shape[2] * (q.shape[3] // flow_k.shape[3]), block_rows))
    wrap_triton(_flow_attention_fwd)[grid](q, flow_k, flow_v, context_k, context_v, prefix_lengths, out, lse,
                                           *_shape_args(q, flow_k, context_k), BLOCK_M=block_rows, BLOCK_N=BLOCK_KEYS,
                                           **_launch_meta(q))
    return out, lse


@triton_op("flowkit_triton::flow_attention_backward", mutates_args=())
def flow_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, flow_k: torch.Tensor, flow_v: torch.Tensor,
                            context_k: torch.Tensor, context_v: torch.Tensor, prefix_lengths: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. q and the flow keys / values (the context K/V are frozen)."""
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(flow_k), torch.empty_like(flow_v)
    grad_out = grad_out.contiguous()
    scale, steps, num_flow, num_heads, num_kv_heads, num_context, head_dim, group = _shape_args(q, flow_k, context_k)
    block_rows, block_flow = _block_rows(q, flow_k), _block_flow(flow_k)
    wrap_triton(_flow_attention_bwd_dq)[(_tasks(q, flow_k), triton.cdiv(num_flow * group, block_rows))](
        grad_out, q, flow_k, flow_v, context_k, context_v, prefix_lengths, out, lse, grad_q, scale, steps, num_flow,
        num_heads, num_kv_heads, num_context, head_dim, group, BLOCK_M=block_rows, BLOCK_N=BLOCK_KEYS,
        **_launch_meta(q))
    wrap_triton(_flow_attention_bwd_dkv)[(_tasks(q, flow_k), triton.cdiv(num_flow, block_flow))](
        grad_out, q, flow_k, flow_v, out, lse, grad_k, grad_v, scale, steps, num_flow, num_heads, num_kv_heads,
        head_dim, group, BLOCK_M=block_rows, BLOCK_F=block_flow, **_launch_meta(q))
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
