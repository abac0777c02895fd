"""RLFR flow-matching math on tapped latents: the loss (eq. 4) and the debiased deviation score (eq. 5, 7).

Latents arrive as P×B×S×d (P tapped layers). Only *scored* tokens take part: response tokens that have their
condition token. ``next`` (the paper's "subsequent token", §3.3; the official offline pretraining's
``token_pre``) conditions token j on h_{j+1} inside the response, so the last response token gets no score;
``previous`` (the official RL scripts' ``token_post``) conditions token j on h_{j−1}, so the first response token
is scored against the last prompt token and every response token gets a score.
All (layer, timestep) variants of the scored tokens are stacked into one batch per velocity-field call (one call
for everything, or chunks of at most ``max_rows`` rows); the fused kernels (``flowkit.kernels``) regenerate the
noise from a seed instead of storing it, so chunking never changes a score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from flowkit import kernels
from flowkit.flow.velocity_field import VelocityField

Condition = Literal["next", "previous", "none"]

# Rows per velocity-field call when scoring: large enough to saturate a GPU's matrix units at hidden sizes ≥ 1k,
# small enough that the stacked x_t / v and the field's activations stay far below the latents themselves.
DEFAULT_MAX_ROWS = 8192


def sample_logit_normal(count: int, generator: torch.Generator | None = None, device=None, mean: float = 0.0) -> Tensor:
    """t = sigmoid(n), n ~ N(mean, 1): the offline-pretraining timestep distribution (t = 1 is data). The official
    RLFR pretraining uses mean 0; a positive mean draws more high-t (near-data) timesteps, as lognorm(m, s) of
    Esser et al. 2024 (SD3) shifts the density."""
    return torch.sigmoid(torch.randn(count, generator=generator) + mean).to(device)


def scored_token_mask(response_mask: Tensor, condition: Condition = "next") -> Tensor:
    """B×S bool: response tokens that have their condition token.

    ``next``: the next token must be a response token too. ``previous``: any earlier position will do — the
    first response token's condition is the last prompt token (official ``token_post``). ``none``: all.
    """
    response = response_mask.bool()
    if condition == "none":
        return response
    shifted = torch.zeros_like(response)
    if condition == "next":
        shifted[:, :-1] = response[:, 1:]
    elif condition == "previous":
        shifted[:, 1:] = True
    else:
        raise ValueError(f"condition must be 'next', 'previous' or 'none', got {condition!r}")
    return response & shifted


def _gather_tokens(latents: Tensor, scored: Tensor, condition: Condition) -> tuple[Tensor, Tensor | None]:
    """x1 (P×N×d) at the scored positions and their condition latents (P×N×d) or None."""
    rows, cols = scored.nonzero(as_tuple=True)
    x1 = latents[:, rows, cols]
    if condition == "none":
        return x1, None
    offset = 1 if condition == "next" else -1
    return x1, latents[:, rows, cols + offset]


def stacked_deviation(
    field: VelocityField,
    x1: Tensor,
    cond: Tensor | None,
    layer_positions: Sequence[float],
    timesteps: Tensor,
    weights: Tensor,
    seed: int,
    max_rows: int | None = None,
    token_offset: int = 0,
) -> Tensor:
    """Per-token mean_{t,ℓ} w(t)·mean_d (v − (x1 − ε))² for x1: P×N×d → N.

    The field runs over the stacked P·T·n rows of chunks of n tokens, ``P·T·n ≤ max_rows`` (None: all at once).
    ``token_offset``: global index of token 0 (its noise), so a micro-batch of rows scores as in the whole batch.
    """
    num_layers, num_tokens, _ = x1.shape
    num_times = timesteps.numel()
    x1 = x1.float()
    layers = torch.tensor(layer_positions, device=x1.device, dtype=torch.float32)

    def velocity(x_t: Tensor, tokens: slice) -> Tensor:
        count = tokens.stop - tokens.start
        t_rows = timesteps.float().repeat_interleave(count).repeat(num_layers)
        layer_rows = layers.repeat_interleave(num_times * count)
        cond_rows = None
        if cond is not None:
            chunk = cond[:, tokens]
            cond_rows = chunk.unsqueeze(1).expand(num_layers, num_times, count, chunk.shape[-1]).reshape(-1, chunk.shape[-1])
        return field(x_t, t_rows, layer_rows, cond_rows).float()

    mask = torch.ones(num_tokens, device=x1.device, dtype=torch.float32)
    return kernels.velocity_deviation_in_chunks(velocity, x1, timesteps, weights, seed, mask, max_rows, token_offset)


def velocity_deviation_scores(
    field: VelocityField,
    latents: Tensor,
    response_mask: Tensor,
    layer_positions: Sequence[float],
    timesteps: Sequence[float],
    seed: int,
    condition: Condition = "next",
    num_draws: int = 1,
    max_rows: int | None = DEFAULT_MAX_ROWS,
    token_offset: int = 0,
    debias: bool = True,
) -> Tensor:
    """Debiased deviation R_CFM per token (eq. 7), B×S, zero where a token is not scored.

    R_CFM(a_k) = mean_{t∈T, ℓ∈P} [ t/(1−t) · mean_d (v_φ(x_t, t, c, ℓ) − (x1 − ε))² ] (eq. 5 inside eq. 7).
    Each t gets its own weight t/(1−t); the official code weights every t with the *last* timestep's weight (its
    loop variable leaks), which equals eq. 7 only for a single rewarding timestep — flowkit keeps eq. 7.
    ``num_draws`` > 1 averages independent noise draws (seeds ``seed, seed+1, …``) to reduce variance;
    a given ``seed`` always gives the same scores, whatever ``max_rows`` (rows per field call) is.
    ``token_offset``: number of scored tokens in the batch's rows before these (micro-batching; see
    :func:`stacked_deviation`). ``debias=False`` drops the t/(1−t) weights: the mean of eq. 5's R_FM (ablation).
    """
    scored = scored_token_mask(response_mask, condition)
    scores = torch.zeros(scored.shape, device=latents.device, dtype=torch.float32)
    if not scored.any():
        return scores
    x1, cond = _gather_tokens(latents, scored, condition)
    t = torch.tensor(list(timesteps), device=latents.device, dtype=torch.float32)
    weights = kernels.debias_weights(t) if debias else torch.ones_like(t)
    total = sum(stacked_deviation(field, x1, cond, layer_positions, t, weights, seed + draw, max_rows, token_offset)
                for draw in range(num_draws))
    scores[scored] = total / num_draws
    return scores


def flow_matching_loss(
    field: VelocityField,
    latents: Tensor,
    response_mask: Tensor,
    layer_positions: Sequence[float],
    timesteps: Tensor,
    seed: int,
    condition: Condition = "next",
    token_offset: int = 0,
) -> Tensor:
    """Eq. 4: mean over scored tokens, layers, timesteps and the hidden dim of (v − (x1 − ε))².

    Every token is paired with every timestep in ``timesteps`` (the online update's rewarding timesteps; offline
    pretraining draws one t per row instead, :func:`pretraining_flow_loss`). ``token_offset`` as in
    :func:`velocity_deviation_scores`.
    """
    scored = scored_token_mask(response_mask, condition)
    if not scored.any():
        return latents.new_zeros((), dtype=torch.float32)
    x1, cond = _gather_tokens(latents, scored, condition)
    timesteps = timesteps.to(latents.device, torch.float32)
    unit = torch.ones_like(timesteps)
    return stacked_deviation(field, x1, cond, layer_positions, timesteps, unit, seed, token_offset=token_offset).mean()


def pretraining_flow_loss(
    field: VelocityField,
    latents: Tensor,
    response_mask: Tensor,
    layer_positions: Sequence[float],
    copies: int,
    generator: torch.Generator,
    condition: Condition = "next",
    logit_mean: float = 0.0,
) -> Tensor:
    """Eq. 4 as the official offline pretraining estimates it: every scored token at every layer enters
    ``copies`` times (its ``flow_batch_mul``: 4 for 1.5B, 2 for 7B), each copy with its own t ~ logit-normal
    (location ``logit_mean``, official 0) and its own noise; mean over copies, layers, tokens and the hidden dim
    of (v − (x1 − ε))².

    One t per row (not per batch) decorrelates the timesteps within a batch. ``generator`` draws the timesteps
    and the noise seed, so a pretraining run never touches the global RNG.
    """
    scored = scored_token_mask(response_mask, condition)
    if not scored.any():
        return latents.new_zeros((), dtype=torch.float32)
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    x1, cond = _gather_tokens(latents, scored, condition)
    num_layers, num_tokens, dim = x1.shape
    rows = num_layers * copies * num_tokens  # row (p, c, n), p slowest
    x1_rows = x1.float().unsqueeze(1).expand(num_layers, copies, num_tokens, dim).reshape(rows, dim)
    t = sample_logit_normal(rows, generator, latents.device, logit_mean)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    noise = kernels.flow_noise((rows, dim), seed, device=latents.device)
    x_t = t[:, None] * x1_rows + (1 - t[:, None]) * noise
    layers = torch.tensor(list(layer_positions), device=latents.device, dtype=torch.float32)
    layer_rows = layers.repeat_interleave(copies * num_tokens)
    cond_rows = None
    if cond is not None:
        cond_rows = cond.unsqueeze(1).expand(num_layers, copies, num_tokens, dim).reshape(rows, dim)
    v = field(x_t, t, layer_rows, cond_rows).float()
    return ((v - (x1_rows - noise)) ** 2).mean()
