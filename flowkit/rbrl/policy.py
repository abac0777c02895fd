"""The attention policy over rules (seed 002 §5.2, Fig. 2, App. Alg. 2); also the shape of the Q networks.

    q_i = P_q(e_i)               rule embeddings → queries          (R×h)
    k   = P_k(s)                 numeric state → key and value      (1×h)
    h¹  = q + Attention(q, k, k)
    h^{j+1} = h^j + SelfAttention(h^j) among the rules, then a feed-forward block, j = 1..K−1
    out_i = Linear(h^K_i)        one logit (or one Q value) per rule

Departure from the paper's formula, on purpose: with a single state key the cross-attention softmax
is 1, so Attention(q, k, k) = k for every rule and would erase which rule is which; the residual
``q +`` keeps the rule identity (standard transformer practice). No positional encodings anywhere, so
the network is permutation-equivariant over rules; ``mask`` (True = real rule) handles padded,
variable-size rule sets.

Projections ``P`` (``projection``): ``"layernorm_silu"`` (default, as the official ``CrossAttentionNetwork``
with ``proj_type="linear"``: LayerNorm of the raw input, then Linear → SiLU → LayerNorm) or ``"linear"``
(one Linear, flowkit's earlier choice). ``dropout`` (official 0.05) applies inside every attention layer;
call ``.eval()`` to act without it. The official defaults are 4 heads and hidden size 16.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RuleAttentionNetwork(nn.Module):
    PROJECTIONS = ("layernorm_silu", "linear")

    def __init__(
        self, state_dim: int, embed_dim: int, hidden: int = 16, num_layers: int = 2, heads: int = 4,
        dropout: float = 0.05, projection: str = "layernorm_silu",
    ):
        super().__init__()
        if num_layers < 1:
            raise ValueError("num_layers (K) counts the cross-attention layer, so K ≥ 1")
        if projection not in self.PROJECTIONS:
            raise ValueError(f"projection must be one of {self.PROJECTIONS}, got {projection!r}")
        self.rule_proj = self._projection(embed_dim, hidden, projection)
        self.state_proj = self._projection(state_dim, hidden, projection)
        self.cross = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.self_attn = nn.ModuleList(
            nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True) for _ in range(num_layers - 1)
        )
        self.feed_forward = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, hidden))
            for _ in range(num_layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(num_layers - 1))
        self.head = nn.Linear(hidden, 1)

    @staticmethod
    def _projection(in_dim: int, hidden: int, kind: str) -> nn.Module:
        if kind == "linear":
            return nn.Linear(in_dim, hidden)
        return nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, hidden), nn.SiLU(), nn.LayerNorm(hidden))

    def forward(self, state: Tensor, rules: Tensor, mask: Tensor) -> Tensor:
        """state B×S, rules B×R×E, mask B×R bool → B×R outputs (padded positions hold 0)."""
        query = self.rule_proj(rules)
        key = self.state_proj(state).unsqueeze(1)
        h = query + self.cross(query, key, key, need_weights=False)[0]
        h = h + self.feed_forward[0](h)
        for attn, norm, ff in zip(self.self_attn, self.norms, self.feed_forward[1:]):
            x = norm(h)
            h = h + attn(x, x, x, key_padding_mask=~mask, need_weights=False)[0]
            h = h + ff(h)
        return self.head(h).squeeze(-1).masked_fill(~mask, 0.0)


def masked_log_softmax(logits: Tensor, mask: Tensor) -> Tensor:
    """log π over the real rules; padded positions get −inf (probability exactly 0)."""
    return torch.log_softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
