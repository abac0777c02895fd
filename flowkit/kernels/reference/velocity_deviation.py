"""Plain PyTorch reference for the RLFR prologue (x_t) and epilogue (debiased velocity deviation).

It materialises the noise ε over the logical ``(P, T, N, d)`` tensor; the fused implementations regenerate it
from the seed instead (see :mod:`flowkit.kernels.rng`). These functions are the tests' ground truth.
"""

from __future__ import annotations

import torch

from ..rng import flow_noise


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stacked_noise(x1: torch.Tensor, num_timesteps: int, seed: int, token_offset: int = 0) -> torch.Tensor:
    """ε for every (percentile p, timestep t, token n), shape ``(P, T, N, d)``, float32.

    Counters run token-major over the global token ``token_offset + n`` (then p, t, j), so the noise of a
    token chunk is a slice of the whole batch's noise.
    """
    num_layers, num_tokens, dim = x1.shape
    offset = token_offset * num_layers * num_timesteps * dim
    noise = flow_noise((num_tokens, num_layers, num_timesteps, dim), seed, offset=offset, device=x1.device)
    return noise.permute(1, 2, 0, 3)


def interpolate_latents(x1: torch.Tensor, timesteps: torch.Tensor, seed: int, token_offset: int = 0) -> torch.Tensor:
    """x_t = t·x1 + (1 − t)·ε for all (p, t, n), rows ordered p-major, shape ``(P·T·N, d)`` (RLFR §3, t = 1 is data)."""
    dim = x1.shape[-1]
    compute = opmath_dtype(x1.dtype)
    noise = stacked_noise(x1, timesteps.numel(), seed, token_offset).to(compute)
    t = timesteps.to(device=x1.device, dtype=torch.float32).to(compute).view(1, -1, 1, 1)
    x_t = t * x1.to(compute).unsqueeze(1) + (1 - t) * noise
    return x_t.reshape(-1, dim).to(x1.dtype)


def velocity_deviation(
    v: torch.Tensor,
    x1: torch.Tensor,
    timesteps: torch.Tensor,
    weights: torch.Tensor,
    seed: int,
    mask: torch.Tensor,
    token_offset: int = 0,
) -> torch.Tensor:
    """score[n] = mask[n] · mean_{p,t} [ w_t · mean_d (v − (x1 − ε))² ] (RLFR eqs. 4, 5, 7).

    Computed and returned in float32 (float64 for float64 inputs); differentiable w.r.t. ``v``.
    """
    num_layers, num_tokens, dim = x1.shape
    num_timesteps = timesteps.numel()
    compute = opmath_dtype(v.dtype)
    noise = stacked_noise(x1, num_timesteps, seed, token_offset).to(compute)
    target = x1.detach().to(compute).unsqueeze(1) - noise
    deviation = (v.to(compute).view(num_layers, num_timesteps, num_tokens, dim) - target).pow(2).mean(-1)
    weighted = deviation * weights.to(device=v.device, dtype=torch.float32).to(compute).view(1, -1, 1)
    return weighted.mean(dim=(0, 1)) * mask.to(device=v.device, dtype=torch.float32).to(compute)
