"""RLFR velocity deviation as fused ops: prologue (x_t for every layer percentile × timestep) and epilogue (eq. 7).

Stacking all ``(p, t)`` variants lets the velocity field run once over ``P·T·N`` rows. The noise ε of
percentile p, timestep t, token n is :func:`flowkit.kernels.flow_noise` with ``seed`` at counters
``((token_offset + n)·P·T + p·T + t)·d + j`` (token-major over the *global* token index); fused implementations
regenerate it in both ops instead of storing it. Because the counters follow the global token, a chunk of tokens
(``x1[:, a:b]`` with ``token_offset = a``) sees exactly the noise of the whole batch, which is what
:func:`velocity_deviation_in_chunks` relies on to bound memory without changing a single score.
"""

from __future__ import annotations

from collections.abc import Callable

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


def interpolate_latents(x1: torch.Tensor, timesteps: torch.Tensor, seed: int, token_offset: int = 0) -> torch.Tensor:
    """Prologue: rows ``(p, t, n)`` (p slowest) of x_t = t·x1[p, n] + (1 − t)·ε[p, t, n].

    Args:
        x1: ``(P, N, d)`` detached latents (data end of the path).
        timesteps: ``(T,)`` flow times.
        seed: noise seed (see module docstring).
        token_offset: global index of token 0 of ``x1`` (non-zero for a chunk of a larger batch).

    Returns:
        ``(P·T·N, d)`` in ``x1.dtype``; no gradient flows to ``x1``.
    """
    if x1.dim() != 3:
        raise ValueError(f"x1 must be (P, N, d), got {tuple(x1.shape)}")
    timesteps = _vector(timesteps, x1.device, "timesteps")
    x1 = x1.detach()
    backend = select_backend(x1.device)
    if backend == "reference":
        return reference.interpolate_latents(x1, timesteps, seed, token_offset)
    x1 = x1.contiguous()
    if backend == "native":
        return torch.ops.flowkit.interpolate_latents(x1, timesteps, int(seed), int(token_offset))
    from .triton import velocity_deviation as triton_impl

    return triton_impl.interpolate_latents(x1, timesteps, int(seed), int(token_offset))


def velocity_deviation(
    v: torch.Tensor,
    x1: torch.Tensor,
    timesteps: torch.Tensor,
    weights: torch.Tensor,
    seed: int,
    mask: torch.Tensor,
    token_offset: int = 0,
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
        token_offset: as in :func:`interpolate_latents`.

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
        return reference.velocity_deviation(v, x1, timesteps, weights, seed, mask, token_offset)
    v, x1 = v.contiguous(), x1.contiguous()
    if backend == "native":
        return torch.ops.flowkit.velocity_deviation(v, x1, timesteps, weights, int(seed), int(token_offset), mask)
    from .triton import velocity_deviation as triton_impl

    return triton_impl.velocity_deviation(v, x1, timesteps, weights, int(seed), int(token_offset), mask)


def velocity_deviation_in_chunks(
    velocity: Callable[[torch.Tensor, slice], torch.Tensor],
    x1: torch.Tensor,
    timesteps: torch.Tensor,
    weights: torch.Tensor,
    seed: int,
    mask: torch.Tensor,
    max_rows: int | None = None,
    token_offset: int = 0,
) -> torch.Tensor:
    """Prologue → ``velocity`` → epilogue over chunks of tokens, at most ``max_rows`` stacked rows per call.

    Each chunk holds ``n`` tokens with all their ``P·T`` variants (``P·T·n ≤ max_rows``, at least one token),
    so the stacked x_t and v, and the velocity network's activations, scale with ``max_rows`` instead of
    ``P·T·N``. The scores equal the unchunked ones (same noise, see the module docstring); under autograd the
    chunks' graphs are all kept, so chunking bounds memory for scoring, not for a backward pass.

    Args:
        velocity: ``velocity(x_t, tokens)`` → v for the chunk's stacked rows ``(p, t, n)`` (p slowest) of
            tokens ``tokens`` (a slice of range(N)).
        x1, timesteps, weights, seed, mask: as in :func:`velocity_deviation`.
        max_rows: row budget per call; None runs all ``P·T·N`` rows at once.
        token_offset: global index of token 0 of ``x1`` (non-zero when ``x1`` is a micro-batch of a larger batch).

    Returns:
        ``(N,)`` scores, as :func:`velocity_deviation`.
    """
    num_layers, num_tokens, _ = x1.shape

    def score_chunk(tokens: slice) -> torch.Tensor:
        # a function, so the chunk's x_t and v are freed before the next chunk allocates its own
        x1_chunk = x1[:, tokens].contiguous()
        offset = token_offset + tokens.start
        v = velocity(interpolate_latents(x1_chunk, timesteps, seed, token_offset=offset), tokens)
        return velocity_deviation(v, x1_chunk, timesteps, weights, seed, mask[tokens], token_offset=offset)

    scores = [score_chunk(tokens) for tokens in token_chunks(num_tokens, num_layers * timesteps.numel(), max_rows)]
    return torch.cat(scores) if scores else x1.new_zeros(0, dtype=torch.float32)


def token_chunks(num_tokens: int, rows_per_token: int, max_rows: int | None) -> list[slice]:
    """Consecutive slices of ``range(num_tokens)``, each of at most ``max_rows // rows_per_token`` tokens (at least one
    token, so a chunk may exceed a budget smaller than one token's rows); None: one slice of all tokens."""
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be a positive row budget or None, got {max_rows}")
    size = max(1, num_tokens if max_rows is None else max_rows // rows_per_token)
    return [slice(start, min(start + size, num_tokens)) for start in range(0, num_tokens, size)]
