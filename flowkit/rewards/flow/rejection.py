"""Online rejection sampling of rollouts for the flow update (RLFR Alg. 1), and the official code's token-level
selection (``trajectory_entropy``)."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

Metric = Literal["correct", "entropy", "both", "token_entropy", "correct+token_entropy"]
METRICS: tuple[str, ...] = get_args(Metric)
# Metrics that weigh tokens within a row by their entropy (official ``trajectory_entropy``); their row-level part is
# every row (``token_entropy``) or the correct rows (``correct+token_entropy``, official ``batch_correct+…``).
TOKEN_METRICS = ("token_entropy", "correct+token_entropy")


# Entropies closer than this (relative) to the batch median count as ties, not "above": identical responses (common in
# a GRPO group) get entropies that differ by float noise that depends on how the batch was split into micro-batches.
ENTROPY_TIE_TOLERANCE = 1e-5


def accept_rollouts(metric: Metric, correct: Tensor, entropy: Tensor) -> Tensor:
    """B bool: correct answers; mean entropy above the batch median (ties with it are not above); or both. The token
    metrics accept at the row level every row (``token_entropy``) or the correct ones (``correct+token_entropy``)."""
    if metric in ("correct", "correct+token_entropy"):
        return correct.bool()
    if metric == "token_entropy":
        return torch.ones_like(correct, dtype=torch.bool)
    median = entropy.median()
    high_entropy = entropy - median > ENTROPY_TIE_TOLERANCE * median.abs().clamp(min=1.0)
    if metric == "entropy":
        return high_entropy
    if metric == "both":
        return correct.bool() & high_entropy
    raise ValueError(f"rejection metric must be one of {', '.join(METRICS)}, got {metric!r}")


def entropy_quantile_weights(entropy: Tensor, scored: Tensor, quantile: float, soft_weight: float) -> Tensor:
    """One row's token weights (S float, 0 off ``scored``): 1 where the token's entropy is ≥ the q-quantile of the
    row's scored tokens' entropies (``torch.quantile``, linear interpolation), ``soft_weight`` elsewhere — the
    official ``trajectory_entropy`` (``ppo_trainer.py`` L498-502), whose quantile also counts the padded positions."""
    if not scored.any():
        return torch.zeros(scored.shape)
    threshold = torch.quantile(entropy[scored].float(), quantile)
    return torch.where(entropy >= threshold, 1.0, soft_weight) * scored.float()


def next_token_entropy(entropy: Tensor, response_mask: Tensor) -> Tensor:
    """B×S: each response token's entropy replaced by the next response token's. The official
    ``trajectory_entropy`` reads ``entropy_from_logits(logits[:, -num_actions:])`` (``ppo_trainer.py``): at a sampled
    token's position, the distribution of the token after it, one position later than the distribution the token
    was sampled from (``entropy``). The step does not compute the distribution after a row's last response token;
    that token keeps its own."""
    following = torch.cat([entropy[:, 1:], entropy[:, -1:]], dim=-1)
    has_next = torch.zeros_like(response_mask, dtype=torch.bool)
    has_next[:, :-1] = response_mask[:, 1:].bool()
    return torch.where(has_next & response_mask.bool(), following, entropy)


class RolloutLatentBuffer:
    """Accepted rollouts' latents (P×S_i×d) and response masks, kept on CPU until κ are available."""

    def __init__(self):
        self.latents: list[Tensor] = []
        self.masks: list[Tensor] = []

    def __len__(self) -> int:
        return len(self.latents)

    def add(self, latents: Tensor, response_mask: Tensor) -> None:
        """latents: P×B×S×d, response_mask: B×S for the accepted rows only."""
        for row in range(response_mask.shape[0]):
            length = int(response_mask[row].nonzero().max()) + 1 if response_mask[row].any() else 0
            if length:
                self.add_one(latents[:, row, :length], response_mask[row, :length])

    def add_one(self, latents: Tensor, response_mask: Tensor) -> None:
        """One rollout: latents P×S_i×d up to its last response token, response_mask S_i."""
        self.latents.append(latents.cpu())
        self.masks.append(response_mask.cpu())

    def pop(self, count: int) -> tuple[Tensor, Tensor]:
        """The oldest ``count`` rollouts as P×count×S×d latents and count×S masks (right-padded)."""
        latents, self.latents = self.latents[:count], self.latents[count:]
        masks, self.masks = self.masks[:count], self.masks[count:]
        length = max(m.shape[0] for m in masks)
        padded = torch.zeros(latents[0].shape[0], len(latents), length, latents[0].shape[-1], dtype=latents[0].dtype)
        mask = torch.zeros(len(masks), length, dtype=masks[0].dtype)
        for i, (lat, m) in enumerate(zip(latents, masks)):
            padded[:, i, : lat.shape[1]] = lat
            mask[i, : m.shape[0]] = m
        return padded, mask

    def state_dict(self) -> dict:
        return {"latents": self.latents, "masks": self.masks}

    def load_state_dict(self, state: dict) -> None:
        self.latents, self.masks = list(state["latents"]), list(state["masks"])
