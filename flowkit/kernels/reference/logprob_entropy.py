"""Plain PyTorch reference for the LM head's softmax over the vocabulary (the tests' ground truth and the route
on every device without the native kernel)."""

from __future__ import annotations

import torch
from torch import Tensor


def _rowwise_dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_v a[n, v]·b[n, v] per row as a batched matmul (no N×V product in memory)."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).flatten()


def logprob_entropy(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    tempered = logits / temperature
    log_normalizer = torch.logsumexp(tempered, dim=-1)
    logprob = tempered.gather(-1, targets[:, None]).squeeze(-1) - log_normalizer
    probs = tempered.sub(log_normalizer[:, None]).exp_()
    return logprob, log_normalizer - _rowwise_dot(probs, tempered), log_normalizer


def logprob_entropy_backward_(logits: Tensor, targets: Tensor, log_normalizer: Tensor, entropy: Tensor,
                              grad_logprob: Tensor, grad_entropy: Tensor | None, temperature: float) -> Tensor:
    log_probs = logits.div_(temperature) if temperature != 1.0 else logits
    log_probs.sub_(log_normalizer[:, None])
    scale = grad_logprob / temperature  # ∂/∂(z/T) → ∂/∂z
    if grad_entropy is not None:  # ∂H/∂z = −p ⊙ (log p + H) / T
        probs = log_probs.exp()
        grad = log_probs.add_(entropy[:, None]).mul_(probs).mul_((-grad_entropy / temperature)[:, None])
        grad.addcmul_(probs, scale[:, None], value=-1.0)
    else:
        grad = log_probs.exp_().mul_(-scale[:, None])
    grad[torch.arange(len(targets), device=targets.device), targets] += scale
    return grad
