"""Triton kernels for the LM head's softmax over the vocabulary (``torch.ops.flowkit_triton``): one program per row
of float32 logits. The forward reads the row once with an online maximum (Σ e^y and Σ e^y·y rescaled when the
maximum grows, y = (z − max)/T); the backward writes the logits' gradient over them in one read-write pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# 4,096 logits per block for 8 warps: 16 per thread (the flow kernels' budget, benchmarks/compile_sm90.py checks).
BLOCK_VOCAB = 4096
NUM_WARPS = 8


@triton.jit
def _logprob_entropy_kernel(z_ptr, target_ptr, logprob_ptr, entropy_ptr, lse_ptr, vocab, inv_t,
                            BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * vocab
    top = -float("inf")
    total = 0.0
    moment = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < vocab, other=-float("inf"))
        new_top = tl.maximum(top, tl.max(z, axis=0))
        shift = tl.where(total > 0.0, (top - new_top) * inv_t, 0.0)  # ≤ 0; the sums are still 0 on the first block
        rescale = tl.exp(shift)
        moment = rescale * (moment + total * shift)
        total = rescale * total
        y = (z - new_top) * inv_t
        e = tl.exp(y)
        total += tl.sum(e, axis=0)
        moment += tl.sum(e * tl.where(e > 0.0, y, 0.0), axis=0)  # a −inf logit adds 0, not 0·(−inf)
        top = new_top
    log_sum = tl.log(total)
    lse = top * inv_t + log_sum
    tl.store(lse_ptr + row, lse)
    tl.store(entropy_ptr + row, log_sum - moment / total)
    target = tl.load(target_ptr + row)
    tl.store(logprob_ptr + row, tl.load(base + target) * inv_t - lse)


@triton.jit
def _logprob_entropy_backward_kernel(z_ptr, target_ptr, lse_ptr, entropy_ptr, grad_logprob_ptr, grad_entropy_ptr,
                                     vocab, inv_t, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * vocab
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    coef_p = tl.load(grad_logprob_ptr + row) * inv_t
    coef_h = tl.load(grad_entropy_ptr + row) * inv_t if HAS_GRAD_ENTROPY else 0.0
    target = tl.load(target_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < vocab
        log_p = tl.load(base + cols, mask=ok, other=0.0) * inv_t - lse
        p = tl.exp(log_p)
        grad = tl.where(p > 0.0, -(coef_p + coef_h * (log_p + entropy)) * p, 0.0)  # −inf logits: p = 0, gradient 0
        grad += tl.where(cols == target, coef_p, 0.0)
        tl.store(base + cols, grad, mask=ok)


@triton_op("flowkit_triton::logprob_entropy", mutates_args=())
def logprob_entropy(logits: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contract of :func:`flowkit.kernels.logprob_entropy.logprob_entropy` (contiguous float32 logits)."""
    rows, vocab = logits.shape
    logprob, entropy, log_normalizer = (logits.new_empty(rows) for _ in range(3))
    wrap_triton(_logprob_entropy_kernel)[(rows,)](logits, targets.contiguous(), logprob, entropy, log_normalizer,
                                                  vocab, 1.0 / temperature, BLOCK_V=BLOCK_VOCAB, num_warps=NUM_WARPS)
    return logprob, entropy, log_normalizer


@triton_op("flowkit_triton::logprob_entropy_backward_", mutates_args=("logits",))
def logprob_entropy_backward_(logits: torch.Tensor, targets: torch.Tensor, log_normalizer: torch.Tensor,
                              entropy: torch.Tensor, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None,
                              temperature: float) -> None:
    """Contract of :func:`flowkit.kernels.logprob_entropy.logprob_entropy_backward_`."""
    rows, vocab = logits.shape
    grad_logprob = grad_logprob.float().contiguous()
    has_grad_entropy = grad_entropy is not None
    grad_entropy = grad_entropy.float().contiguous() if has_grad_entropy else grad_logprob
    wrap_triton(_logprob_entropy_backward_kernel)[(rows,)](
        logits, targets.contiguous(), log_normalizer.contiguous(), entropy.contiguous(), grad_logprob, grad_entropy,
        vocab, 1.0 / temperature, HAS_GRAD_ENTROPY=has_grad_entropy, BLOCK_V=BLOCK_VOCAB, num_warps=NUM_WARPS)
