"""Evaluation metrics over sampled answers."""

from __future__ import annotations

from math import comb

import torch
from torch import Tensor


def pass_at_k(num_samples: int, num_correct: Tensor, k: int) -> Tensor:
    """Unbiased pass@k per problem from ``num_correct`` of ``num_samples`` samples (Chen et al. 2021)."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 ≤ k ≤ n, got k={k}, n={num_samples}")
    values = [1.0 - comb(num_samples - int(c), k) / comb(num_samples, k) for c in num_correct.tolist()]
    return torch.tensor(values, dtype=torch.float32)
