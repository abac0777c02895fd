"""The LM head's softmax over the vocabulary for a chunk of tokens: log p(target), the entropy and the
log-normaliser of z/T from raw float32 logits z, and the gradient w.r.t. z written over z.

The reference makes about eight passes over each N×V chunk and allocates four chunk-sized tensors; on CPU, where
every fresh allocation of that size is page-faulted in anew, those passes cost more than the chunk's matmul. The
native CPU kernel (``csrc/logprob_entropy/``) reads each row twice while it sits in cache and writes the gradient
in place; the Triton kernels (CUDA tensors, where each of the reference's passes is a trip through HBM) read each
row once. Dispatch as :func:`~flowkit.kernels.backends.select_backend`, except that there is no native CUDA kernel
(CUDA takes Triton); other dtypes and non-contiguous logits take the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backends import available_backends, native_has, select_backend
from .reference import logprob_entropy as reference


def backend_for(logits: Tensor) -> str:
    """The implementation the op runs for these logits: "native", "triton" or "reference"."""
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        return "reference"
    backend = select_backend(logits.device)
    if backend == "native" and not native_has(logits.device.type, "logprob_entropy"):
        return "triton" if "triton" in available_backends(logits.device.type) else "reference"
    return backend


def logprob_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``logits`` (N, V) float32: log p(``targets``), the entropy H and log Σ_v e^{z_v/T}, all float32 (N,).
    No autograd: :func:`logprob_entropy_backward_` is the backward."""
    backend = backend_for(logits)
    if backend == "native":
        return torch.ops.flowkit.logprob_entropy(logits, targets, temperature)
    if backend == "triton":
        from .triton import logprob_entropy as triton_impl

        return triton_impl.logprob_entropy(logits, targets, float(temperature))
    return reference.logprob_entropy(logits, targets, temperature)


def logprob_entropy_backward_(logits: Tensor, targets: Tensor, log_normalizer: Tensor, entropy: Tensor,
                              grad_logprob: Tensor, grad_entropy: Tensor | None, temperature: float = 1.0) -> Tensor:
    """Overwrite ``logits`` z with ∂(Σ_n g_p[n]·log p_n + g_H[n]·H_n)/∂z — (g_p·(onehot − p) − g_H·p ⊙ (log p + H))/T
    — from the forward's ``log_normalizer`` and ``entropy``; ``grad_entropy`` None: no entropy term. Returns it."""
    backend = backend_for(logits)
    if backend == "native":
        torch.ops.flowkit.logprob_entropy_backward_(logits, targets, log_normalizer, entropy, grad_logprob,
                                                    grad_entropy, temperature)
        return logits
    if backend == "triton":
        from .triton import logprob_entropy as triton_impl

        triton_impl.logprob_entropy_backward_(logits, targets, log_normalizer, entropy, grad_logprob, grad_entropy,
                                              float(temperature))
        return logits
    return reference.logprob_entropy_backward_(logits, targets, log_normalizer, entropy, grad_logprob, grad_entropy,
                                               temperature)
