"""Token-wise velocity field v_φ(x_t, t, c, ℓ) of RLFR (§3.2; the official code's adaLN MLP).

No attention across tokens: every row is an independent (latent, timestep, condition, layer) query, which
is what lets the reward path stack all (layer, timestep) variants of all tokens into one batch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_frequencies(dim: int = 256, max_period: float = 10000.0, device=None) -> Tensor:
    """The ``dim/2`` frequencies ``exp(−ln(max_period)·i/(dim/2))`` (the official code stores them as a ``freqs`` buffer)."""
    half = dim // 2
    return torch.exp(-math.log(max_period) * torch.arange(half, device=device, dtype=torch.float32) / half)


def sinusoidal_embedding(values: Tensor, dim: int = 256, max_period: float = 10000.0) -> Tensor:
    """``[cos(v·f), sin(v·f)]`` of scalars v in [0, 1]: t and the layer position ℓ = block/L, fed unscaled as the
    official code does (no DiT-style ×1000), so converted official weights give the official outputs."""
    args = values.float()[:, None] * sinusoidal_frequencies(dim, max_period, values.device)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ScalarEmbedder(nn.Module):
    """Sinusoidal features (256 frequencies) → Linear → SiLU → Linear."""

    def __init__(self, width: int, frequencies: int = 256):
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, values: Tensor) -> Tensor:
        """One embedding per value. Callers pass each distinct value once where rows repeat a few (the stacked
        reward path's T timesteps and P layers; pretraining's layers with an index), so no ``unique`` — a host sync
        on a GPU — is needed here."""
        return self.mlp(sinusoidal_embedding(values, self.frequencies).to(self.mlp[0].weight.dtype))


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def _modulated_norm_no_grad(norm: nn.RMSNorm, x: Tensor, silu_y: Tensor, projection: nn.Linear,
                            width: int) -> Tensor:
    """``modulate(norm(x), shift, scale)`` without autograd, (shift, scale) = the first two width-w slices of
    ``projection(silu_y)``, each made when needed and consumed in place (at most two M×w buffers besides x): RMSNorm's
    mean square from ``vector_norm`` (no x² buffer), then (x·r)·(γ·(1 + scale)) + shift. Equal to the module path up
    to float rounding (≈ 1e-7 relative)."""
    weight, bias = projection.weight, projection.bias
    inverse_rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(norm.eps).rsqrt_()
    factor = nn.functional.linear(silu_y, weight[width:2 * width], bias[width:2 * width]).add_(1).mul_(norm.weight)
    hidden = (x * inverse_rms).mul_(factor)
    del factor
    return hidden.add_(nn.functional.linear(silu_y, weight[:width], bias[:width]))


class AdaLNBlock(nn.Module):
    """RMSNorm → adaLN(shift, scale) → Linear→SiLU→Linear → gated residual."""

    def __init__(self, width: int, norm_eps: float = 1e-6):
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=norm_eps)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.ada_ln = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x: Tensor, silu_y: Tensor) -> Tensor:
        """``silu_y`` = SiLU(y), the first op of ``ada_ln``, which every block applies to the same y (computed once)."""
        if torch.is_grad_enabled():
            shift, scale, gate = self.ada_ln[1](silu_y).chunk(3, dim=-1)
            return x + gate * self.mlp(modulate(self.norm(x), shift, scale))
        return self._forward_in_place(x, silu_y)

    def _forward_in_place(self, x: Tensor, silu_y: Tensor) -> Tensor:
        """The same arithmetic without autograd (scoring), in place on ``x`` and on fresh buffers: at most five
        width-w vectors per row live at once (x, SiLU(y) and three) instead of about ten, ``ada_ln``'s three outputs
        each made when needed, and fewer passes over memory (:func:`_modulated_norm_no_grad`, the residual as one
        ``addcmul``)."""
        width = x.shape[-1]
        up, _, down = self.mlp
        activation = up(_modulated_norm_no_grad(self.norm, x, silu_y, self.ada_ln[1], width))
        hidden = down(nn.functional.silu(activation, inplace=True))
        del activation
        weight, bias = self.ada_ln[1].weight, self.ada_ln[1].bias
        return x.addcmul_(hidden, nn.functional.linear(silu_y, weight[2 * width:], bias[2 * width:]))  # + gate · MLP


class VelocityField(nn.Module):
    """v_φ(x_t, t, c, ℓ) → velocity in R^d (RLFR eq. 4's network).

    Args:
        hidden_size: d, the policy's hidden size (the latents' dimension).
        width: w, the field's width (default d).
        depth: number of residual adaLN blocks (paper: 4 for ≤3B policies, 6 for 7B/8B).
        conditioned: whether a condition latent c (a neighbouring token's latent, §3.3) is given.
        norm_eps: ε of the RMSNorms; the official code uses the backbone's ``rms_norm_eps``
            (:meth:`~flowkit.rewards.FlowReward.bind` passes it).

    Initialisation (official): every Linear xavier-uniform with zero bias, then the adaLN projections and the
    output Linear zeroed (adaLN-Zero), so a fresh field outputs v = 0.
    """

    def __init__(self, hidden_size: int, width: int | None = None, depth: int = 4, conditioned: bool = True,
                 norm_eps: float = 1e-6):
        super().__init__()
        width = width or hidden_size
        self.hidden_size, self.width, self.depth, self.conditioned = hidden_size, width, depth, conditioned
        self.input_proj = nn.Linear(hidden_size, width)
        self.t_embed = ScalarEmbedder(width)
        self.layer_embed = ScalarEmbedder(width)
        self.cond_proj = nn.Linear(hidden_size, width) if conditioned else None
        self.blocks = nn.ModuleList(AdaLNBlock(width, norm_eps) for _ in range(depth))
        self.final_norm = nn.RMSNorm(width, eps=norm_eps)
        self.final_ada_ln = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.output_proj = nn.Linear(width, hidden_size)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for layer in (*(block.ada_ln[1] for block in self.blocks), self.final_ada_ln[1], self.output_proj):
            nn.init.zeros_(layer.weight)

    def forward(self, x_t: Tensor, t: Tensor, layer_position: Tensor, condition: Tensor | None = None,
                stacked: bool = False, layer_index: Tensor | None = None) -> Tensor:
        """x_t: M×d, t: M, layer_position: M (h/L), condition: M×d or None → velocity M×d.

        ``layer_index`` (M long): ``layer_position`` holds the P distinct layer positions and row m is at layer
        ``layer_index[m]`` (each layer embedded once, as offline pretraining calls it).

        ``stacked``: the rows are the reward path's (layer p, timestep t, token n), p slowest, M = P·T·n; then ``t``
        holds the T timesteps, ``layer_position`` the P layer positions and ``condition`` is P×n×d (a token's
        condition at a layer is the same for every t), so each is embedded once instead of once per row."""
        dtype = self.input_proj.weight.dtype
        if self.cond_proj is not None and condition is None:
            raise ValueError("this VelocityField is conditioned; pass the condition latents")
        if stacked:
            num_layers, num_times = layer_position.numel(), t.numel()
            y = self.t_embed(t)[None, :, None] + self.layer_embed(layer_position)[:, None, None]  # P×T×1×w
            shape = (num_layers, num_times, x_t.shape[0] // (num_layers * num_times), self.width)
            if self.cond_proj is not None:
                y = y + self.cond_proj(condition.to(dtype))[:, None]
            y = y.expand(shape).reshape(-1, self.width)
        else:
            # t before ℓ, as the stacked path: under ZeRO-3 every rank must call the submodules in one order (a padding
            # piece runs this path while another rank's real piece runs the stacked one)
            y = self.t_embed(t)
            layers = self.layer_embed(layer_position)
            y = y + (layers if layer_index is None else layers[layer_index])
            if self.cond_proj is not None:
                y = y + self.cond_proj(condition.to(dtype))
        # Every adaLN projection (the blocks' and the final one) starts with SiLU(y) of the same y: apply it once.
        silu_y = nn.functional.silu(y) if torch.is_grad_enabled() else nn.functional.silu(y, inplace=True)
        del y
        x = self.input_proj(x_t.to(dtype))
        for block in self.blocks:
            x = block(x, silu_y)
        if not torch.is_grad_enabled():
            return self.output_proj(_modulated_norm_no_grad(self.final_norm, x, silu_y, self.final_ada_ln[1], self.width))
        shift, scale = self.final_ada_ln[1](silu_y).chunk(2, dim=-1)
        return self.output_proj(modulate(self.final_norm(x), shift, scale))
