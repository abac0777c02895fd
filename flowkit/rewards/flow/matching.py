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

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from flowkit import kernels
from flowkit.distributed import agreed_call_count
from flowkit.rewards.flow.field import VelocityField

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


def _gather_tokens(latents: Tensor, scored: Tensor | tuple[Tensor, Tensor],
                   condition: Condition) -> tuple[Tensor, Tensor | None]:
    """x1 (P×N×d) at the scored positions (a B×S mask, or its (rows, cols) indices) and their condition latents
    (P×N×d) or None."""
    rows, cols = scored.nonzero(as_tuple=True) if isinstance(scored, Tensor) else scored
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
    num_tokens = x1.shape[1]
    x1 = x1.float()
    layers = torch.tensor(layer_positions, device=x1.device, dtype=torch.float32)

    def velocity(x_t: Tensor, tokens: slice) -> Tensor:
        condition = None if cond is None else cond[:, tokens]
        return field(x_t, timesteps.float(), layers, condition, stacked=True).float()

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
    Under ZeRO-3 every rank calls the field equally often (:func:`~flowkit.distributed.agreed_call_count`).
    """
    scored = scored_token_mask(response_mask, condition)
    scores = torch.zeros(scored.shape, device=latents.device, dtype=torch.float32)
    rows, cols = scored.nonzero(as_tuple=True)
    t = torch.tensor(list(timesteps), device=latents.device, dtype=torch.float32)
    weights = kernels.debias_weights(t) if debias else torch.ones_like(t)
    chunks = kernels.token_chunks(len(rows), latents.shape[0] * len(t), max_rows)
    calls = num_draws * len(chunks)
    padding = agreed_call_count(calls, field) - calls  # agreed before the first call
    if calls:
        # Each chunk gathers its own tokens' latents (not all P×N×d up front) for its one field call per draw.
        total = torch.cat([_chunk_deviation(field, latents, (rows[chunk], cols[chunk]), condition, layer_positions, t,
                                            weights, seed, num_draws, token_offset + chunk.start) for chunk in chunks])
        scores[rows, cols] = total / num_draws
    for _ in range(padding):
        padding_velocity(field)
    return scores


def _chunk_deviation(field: VelocityField, latents: Tensor, tokens: tuple[Tensor, Tensor], condition: Condition,
                     layer_positions: Sequence[float], timesteps: Tensor, weights: Tensor, seed: int, num_draws: int,
                     token_offset: int) -> Tensor:
    """Σ over ``num_draws`` noise draws of the deviation of one chunk of scored tokens (one field call per draw)."""
    x1, cond = _gather_tokens(latents, tokens, condition)
    return sum(stacked_deviation(field, x1, cond, layer_positions, timesteps, weights, seed + draw,
                                 token_offset=token_offset) for draw in range(num_draws))


def padding_velocity(field: VelocityField) -> Tensor:
    """The field on one all-zero row: a call that keeps this rank's ZeRO-3 collectives in step with a rank that
    has more rows (:func:`~flowkit.distributed.agreed_call_count`); a loss adds it × 0."""
    param = next(field.parameters())
    zeros = torch.zeros(1, field.hidden_size, device=param.device)
    ones = torch.ones(1, device=param.device)
    return field(zeros, ones / 2, ones, zeros if field.conditioned else None)


LossPiece = Callable[[], Tensor]


def flow_matching_loss_pieces(
    field: VelocityField,
    latents: Tensor,
    response_mask: Tensor,
    layer_positions: Sequence[float],
    timesteps: Tensor,
    seed: int,
    condition: Condition = "next",
    max_rows: int | None = None,
    token_weights: Tensor | None = None,
) -> list[LossPiece]:
    """Eq. 4 as pieces whose sum is the loss: mean over scored tokens, layers, timesteps and the hidden dim of
    (v − (x1 − ε))², every token paired with every timestep in ``timesteps`` (the online update's rewarding
    timesteps; offline pretraining draws one t per row instead, :func:`pretraining_loss_pieces`). With
    ``token_weights`` (B×S, w_j) the scored tokens' terms are summed with those weights instead of averaged (a masked
    mean whose weights the caller normalised, as the official online update computes it).

    Each piece is a function that makes one field call over at most ``max_rows`` stacked rows (token × layer ×
    timestep; at least one token) and returns its share Σ_piece / total, so a caller that backpropagates one piece
    at a time holds one piece's activations, however many tokens the latents hold. The latents may stay on the
    CPU: a piece moves only its tokens to the field's device. The noise follows the global token index, so the
    pieces sum to the loss of one call whatever ``max_rows`` is.
    """
    scored = scored_token_mask(response_mask, condition)
    rows, cols = scored.nonzero(as_tuple=True)
    total = len(rows)
    weights = None if token_weights is None else token_weights[rows, cols]
    device = next(field.parameters()).device
    timesteps = timesteps.to(device, torch.float32)
    unit = torch.ones_like(timesteps)

    def piece(tokens: slice) -> LossPiece:
        def loss() -> Tensor:
            x1, cond = _gather_tokens(latents, (rows[tokens], cols[tokens]), condition)
            x1, cond = x1.to(device), None if cond is None else cond.to(device)
            deviation = stacked_deviation(field, x1, cond, layer_positions, timesteps, unit, seed,
                                          token_offset=tokens.start)
            return deviation.sum() / total if weights is None else (deviation * weights[tokens].to(device)).sum()
        return loss

    return [piece(tokens) for tokens in kernels.token_chunks(total, latents.shape[0] * len(timesteps), max_rows)]


def pretraining_loss_pieces(
    field: VelocityField,
    latents: Tensor,
    response_mask: Tensor,
    layer_positions: Sequence[float],
    copies: int,
    generator: torch.Generator,
    condition: Condition = "next",
    logit_mean: float = 0.0,
    max_rows: int | None = None,
) -> list[LossPiece]:
    """Eq. 4 as the official offline pretraining estimates it, as pieces whose sum is the loss: every scored token
    at every layer enters ``copies`` times (its ``flow_batch_mul``: 4 for 1.5B, 2 for 7B), each copy with its own
    t ~ logit-normal (location ``logit_mean``, official 0) and its own noise; mean over copies, layers, tokens and
    the hidden dim of (v − (x1 − ε))².

    One t per row (not per batch) decorrelates the timesteps within a batch. ``generator`` draws the timesteps
    and the noise seed (here, once for all pieces), so a pretraining run never touches the global RNG. Rows are
    (layer, copy, token), layer slowest; a piece is one field call over at most ``max_rows`` of them and regenerates
    only its own noise, so pieces backpropagated one at a time bound the memory by ``max_rows``.
    """
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    scored = scored_token_mask(response_mask, condition)
    rows, cols = scored.nonzero(as_tuple=True)
    num_layers, num_tokens, dim = latents.shape[0], len(rows), latents.shape[-1]
    total = num_layers * copies * num_tokens
    if total == 0:
        return []
    device = next(field.parameters()).device
    t = sample_logit_normal(total, generator, device, logit_mean)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    layers = torch.tensor(list(layer_positions), device=device, dtype=torch.float32)
    offset = 1 if condition == "next" else -1

    def piece(chunk: slice) -> LossPiece:
        def loss() -> Tensor:
            index = torch.arange(chunk.start, chunk.stop)
            layer, token = index // (copies * num_tokens), index % num_tokens
            x1 = latents[layer, rows[token], cols[token]].to(device, torch.float32)
            cond = None if condition == "none" else latents[layer, rows[token], cols[token] + offset].to(device)
            noise = kernels.flow_noise((len(index), dim), seed, offset=chunk.start * dim, device=device)
            t_rows = t[chunk, None]
            v = field(t_rows * x1 + (1 - t_rows) * noise, t[chunk], layers, cond, layer_index=layer.to(device)).float()
            return ((v - (x1 - noise)) ** 2).sum() / (total * dim)
        return loss

    return [piece(chunk) for chunk in kernels.token_chunks(total, 1, max_rows)]
