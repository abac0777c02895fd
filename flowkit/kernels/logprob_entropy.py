"""The LM head's softmax over the vocabulary for a chunk of tokens: log p(target), the entropy and the
log-normaliser of z/T from raw float32 logits z, and the gradient w.r.t. z written over z.

The reference makes about eight passes over each N×V chunk and allocates four chunk-sized tensors; on CPU, where
every fresh allocation of that size is page-faulted in anew, those passes cost more than the chunk's matmul. The
native CPU kernel (``csrc/logprob_entropy/``) reads each row twice while it sits in cache and writes the gradient
in place. CUDA tensors, other dtypes and ``FLOWKIT_KERNELS=reference|triton`` run the reference (no Triton or CUDA
kernel yet: on a GPU the reference's passes run at memory bandwidth and the caching allocator reuses the buffers).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backends import native_has, select_backend
from .reference import logprob_entropy as reference


def _native(logits: Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and native_has("cpu", "logprob_entropy") and select_backend(logits.device) == "native")


def logprob_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``logits`` (N, V) float32: log p(``targets``), the entropy H and log Σ_v e^{z_v/T}, all float32 (N,).
    No autograd: :func:`logprob_entropy_backward_` is the backward."""
    if _native(logits):
        return torch.ops.flowkit.logprob_entropy(logits, targets, temperature)
    return reference.logprob_entropy(logits, targets, temperature)


def logprob_entropy_backward_(logits: Tensor, targets: Tensor, log_normalizer: Tensor, entropy: Tensor,
                              grad_logprob: Tensor, grad_entropy: Tensor | None, temperature: float = 1.0) -> Tensor:
    """Overwrite ``logits`` z with ∂(Σ_n g_p[n]·log p_n + g_H[n]·H_n)/∂z — (g_p·(onehot − p) − g_H·p ⊙ (log p + H))/T
    — from the forward's ``log_normalizer`` and ``entropy``; ``grad_entropy`` None: no entropy term. Returns it."""
    if _native(logits):
        torch.ops.flowkit.logprob_entropy_backward_(logits, targets, log_normalizer, entropy, grad_logprob,
                                                    grad_entropy, temperature)
        return logits
    return reference.logprob_entropy_backward_(logits, targets, log_normalizer, entropy, grad_logprob, grad_entropy,
                                               temperature)
