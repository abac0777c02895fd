"""Online rejection sampling of rollouts for the flow update (RLFR Alg. 1)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Metric = Literal["correct", "entropy", "both"]


# Entropies closer than this (relative) to the batch median count as ties, not "above": identical responses (common in
# a GRPO group) get entropies that differ by float noise that depends on how the batch was split into micro-batches.
ENTROPY_TIE_TOLERANCE = 1e-5


def accept_rollouts(metric: Metric, correct: Tensor, entropy: Tensor) -> Tensor:
    """B bool: correct answers; mean entropy above the batch median (ties with it are not above); or both."""
    median = entropy.median()
    high_entropy = entropy - median > ENTROPY_TIE_TOLERANCE * median.abs().clamp(min=1.0)
    if metric == "correct":
        return correct.bool()
    if metric == "entropy":
        return high_entropy
    if metric == "both":
        return correct.bool() & high_entropy
    raise ValueError(f"rejection metric must be 'correct', 'entropy' or 'both', got {metric!r}")


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
