"""Token log-probabilities and entropies aligned with ``input_ids``."""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """B×S: position s holds log p(input_ids[s] | tokens < s); position 0 is 0."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """B×S entropy of the distribution that produced token s (aligned like :func:`token_logprobs`)."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))
