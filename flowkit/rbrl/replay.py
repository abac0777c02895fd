"""Replay buffer of augmented transitions (s̃_t, a^rule_t, r̃_t, s̃_{t+1}) (seed 002 Alg. 1 line 10).

The augmented state s̃ = (numeric state, rule embeddings, rule mask). Rule sets are padded to
``max_rules``. Environment and rule rewards are stored apart so the rule-reward weight stays a
training choice.
"""

from __future__ import annotations

import torch
from torch import Tensor

FIELDS = ("state", "rules", "mask", "action", "env_reward", "rule_reward", "done", "next_state", "next_rules", "next_mask")


def pad_rules(embeddings: Tensor, max_rules: int) -> tuple[Tensor, Tensor]:
    """R×E → (max_rules×E zero-padded, max_rules bool mask)."""
    count = embeddings.shape[0]
    if count > max_rules:
        raise ValueError(f"{count} rules, more than max_rules={max_rules}")
    padded = embeddings.new_zeros(max_rules, embeddings.shape[1])
    padded[:count] = embeddings
    mask = torch.zeros(max_rules, dtype=torch.bool)
    mask[:count] = True
    return padded, mask


class ReplayBuffer:
    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self.storage: dict[str, Tensor] = {}
        self.size = 0
        self.cursor = 0

    def __len__(self) -> int:
        return self.size

    def add(self, transition: dict[str, Tensor]) -> None:
        if not self.storage:
            self.storage = {
                k: torch.zeros((self.capacity, *torch.as_tensor(transition[k]).shape), dtype=torch.as_tensor(transition[k]).dtype)
                for k in FIELDS
            }
        for k in FIELDS:
            self.storage[k][self.cursor] = torch.as_tensor(transition[k])
        self.cursor = (self.cursor + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        if self.size == 0:
            raise RuntimeError("sampling from an empty replay buffer")
        index = torch.randint(self.size, (batch_size,), generator=generator)
        return {k: v[index] for k, v in self.storage.items()}
