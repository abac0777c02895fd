"""RLFR velocity deviation as fused ops: prologue (x_t for every layer percentile × timestep) and epilogue (eq. 7).

Stacking all ``(p, t)`` variants lets the velocity field run once over ``P·T·N`` rows. The noise ε over the
logical ``(P, T, N, d)`` tensor is :func:`flowkit.kernels.flow_noise` with ``seed`` and offset 0, so row
``r = (p·T + t)·N + n`` of the stacked batch uses counters ``r·d .. r·d + d − 1``; fused implementations
regenerate it in both ops instead of storing it.
"""

from __future__ import annotations

import torch

from .backends import select_backend
from .reference import velocity_deviation as reference


def debias_weights(timesteps: torch.Tensor) -> torch.Tensor:
    """RLFR eq. 7 weights t/(1−t) (t = 1 is data; 4 at the default t = 0.8)."""
    t = timesteps.float()
    return t / (1 - t)


def _vector(values, device: torch.device, name: str, length: int | None = None) -> torch.Tensor:
    """A contiguous float32 vector on ``device`` (the layout every implementation reads)."""
    values = torch.as_tensor(values, device=device).to(torch.float32).reshape(-1).contiguous()
    if length is not None and values.numel() != length:
        raise ValueError(f"{name} has {values.numel()} entries, expected {length}")
    return values


def interpolate_latents(x1: torch.Tensor, timesteps: torch.Tensor, seed: int) -> torch.Tensor:
    """Prologue: rows ``(p, t, n)`` (p slowest) of x_t = t·x1[p, n] + (1 − t)·ε[p, t, n].

    Args:
        x1: ``(P, N, d)`` detached latents (data end of the path).
        timesteps: ``(T,)`` flow times.
        seed: noise seed (see module docstring).

    Returns:
        ``(P·T·N, d)`` in ``x1.dtype``; no gradient flows to ``x1``.
    """
    if x1.dim() != 3:
        raise ValueError(f"x1 must be (P, N, d), got {tuple(x1.shape)}")
    timesteps = _vector(timesteps, x1.device, "timesteps")
    x1 = x1.detach()
    backend = select_backend(x1.device)
    if backend == "reference":
        return reference.interpolate_latents(x1, timesteps, seed)
    x1 = x1.contiguous()
    if backend == "native":
        return torch.ops.flowkit.interpolate_latents(x1, timesteps, int(seed))
    from .triton import velocity_deviation as triton_impl

    return triton_impl.interpolate_latents(x1, timesteps, int(seed))


def velocity_deviation(
    v: torch.Tensor, x1: torch.Tensor, timesteps: torch.Tensor, weights: torch.Tensor, seed: int, mask: torch.Tensor
) -> torch.Tensor:
    """Epilogue: score[n] = mask[n] · mean_{p,t} [ w_t · mean_d (v[p,t,n] − (x1[p,n] − ε[p,t,n]))² ].

    With ``weights = debias_weights(timesteps)`` this is the debiased R_CFM of RLFR eq. 7 (R_FM of eq. 5
    averaged over timesteps and layer percentiles); with unit weights its mean over valid tokens is the flow
    loss of eq. 4. ``seed`` must be the one given to :func:`interpolate_latents`.

    Args:
        v: ``(P·T·N, d)`` velocities on the stacked rows; the only input with a gradient.
        x1: ``(P, N, d)`` detached latents (no gradient).
        timesteps, weights: ``(T,)``.
        mask: ``(N,)`` bool or float; masked tokens score 0.

    Returns:
        ``(N,)`` float32 scores (float64 for float64 inputs).
    """
    if x1.dim() != 3 or v.dim() != 2:
        raise ValueError("expected v (P*T*N, d) and x1 (P, N, d)")
    num_layers, num_tokens, dim = x1.shape
    timesteps = _vector(timesteps, v.device, "timesteps")
    weights = _vector(weights, v.device, "weights", timesteps.numel())
    mask = _vector(mask, v.device, "mask", num_tokens)
    if v.shape != (num_layers * timesteps.numel() * num_tokens, dim):
        raise ValueError(f"v has shape {tuple(v.shape)}, expected {(num_layers * timesteps.numel() * num_tokens, dim)}")
    x1 = x1.detach().to(v.dtype)
    backend = select_backend(v.device)
    if backend == "reference":
        return reference.velocity_deviation(v, x1, timesteps, weights, seed, mask)
    v, x1 = v.contiguous(), x1.contiguous()
    if backend == "native":
        return torch.ops.flowkit.velocity_deviation(v, x1, timesteps, weights, int(seed), mask)
    from .triton import velocity_deviation as triton_impl

    return triton_impl.velocity_deviation(v, x1, timesteps, weights, int(seed), mask)
