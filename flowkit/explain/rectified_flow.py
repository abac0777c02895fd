"""Rectified-flow training loss (seed 000 Eq. 3) and the Euler ODE sampler of §3.2."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

VelocityField = Callable[[Tensor, Tensor], Tensor]  # (t [..., ], z_t [..., |A|]) -> velocity [..., |A|]


def noise(draw: Callable[..., Tensor], shape: tuple[int, ...], generator: torch.Generator | None,
          device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """``draw`` (``torch.randn`` / ``torch.rand``) of ``shape`` on ``device``, drawn on ``generator``'s own
    device: a CPU generator serves a GPU run (torch refuses to draw CUDA tensors from it) with the same draws
    as on CPU."""
    source = generator.device if generator is not None else device
    return draw(shape, generator=generator, device=source, dtype=dtype).to(device)


def rectified_flow_loss(velocity: VelocityField, z1: Tensor, sigma: float = 1.0,
                       generator: torch.Generator | None = None) -> Tensor:
    """E‖(z1 − z0) − φ(t, z_t)‖² with z0 ~ N(0, σ²I), t ~ U[0, 1], z_t = t·z1 + (1 − t)·z0 (Eq. 3).

    ``z1`` [..., |A|] are the targets (softmax of proxy logits, §3.2); one (t, z0) draw per target row.
    """
    z0 = sigma * noise(torch.randn, z1.shape, generator, z1.device, z1.dtype)
    t = noise(torch.rand, z1.shape[:-1], generator, z1.device, z1.dtype)
    z_t = t[..., None] * z1 + (1 - t[..., None]) * z0
    return (z1 - z0 - velocity(t, z_t)).square().sum(-1).mean()


def euler_sample(velocity: VelocityField, z0: Tensor, num_steps: int) -> Tensor:
    """z1 = z0 + ∫₀¹ φ(t, z_t) dt by ``num_steps`` Euler steps (§3.2); straight fields need few steps."""
    z = z0
    dt = 1.0 / num_steps
    for step in range(num_steps):
        t = torch.full(z.shape[:-1], step * dt, device=z.device, dtype=z.dtype)
        z = z + dt * velocity(t, z)
    return z
