"""Online stochastic bin packing (seed 002 §7 "BinPacking", after Balaji et al. 2019 / or-gym).

Items arrive one at a time and must be placed at once into an open bag or a new one. Settings of the
official environment: bag capacity 9, item sizes {2, 3, 6} with probabilities {0.7, 0.2, 0.1}, 32 items.

State: ``counts[l]`` = number of open bags filled to level ``l`` (1 ≤ l < capacity; full bags are
closed and forgotten) and the size of the arriving item.
Actions: 0 = open a new bag; ``l`` = put the item into a bag at level ``l``.
Reward = −(change of total waste), waste = free space summed over open bags, so an episode's return is
minus the waste left at the end: opening a bag costs ``capacity − size``, filling one earns ``size``.
Every reward is multiplied by ``reward_scale`` (official 1/100, its ``TransformReward`` in ``sac_attention.py``).

An invalid placement (no bag at that level, or it would overflow), ``invalid_action``:

- ``"end"`` (default, the official ``envs/bin_packing.py``, after or-rl-benchmarks): the episode ends with
  reward −100 − w, where w is the previous placement's change of waste (the official ``self.waste``:
  ``capacity − size`` after opening a bag, ``−size`` after filling one, 0 before the first placement);
- ``"penalty"`` (flowkit's earlier variant): reward −``invalid_penalty``, the item is discarded and the
  episode continues.
"""

from __future__ import annotations

from typing import ClassVar

import gymnasium as gym
import numpy as np

from flowkit.rbrl.language import LanguageEnv


class BinPackingEnv(gym.Env):
    metadata: ClassVar[dict] = {"render_modes": []}
    INVALID_ACTIONS = ("end", "penalty")
    OFFICIAL_INVALID_REWARD = -100.0

    def __init__(
        self,
        capacity: int = 9,
        item_sizes: tuple[int, ...] = (2, 3, 6),
        item_probs: tuple[float, ...] = (0.7, 0.2, 0.1),
        horizon: int = 32,
        invalid_action: str = "end",
        invalid_penalty: float = 20.0,
        reward_scale: float = 0.01,
    ):
        if len(item_sizes) != len(item_probs) or not np.isclose(sum(item_probs), 1.0):
            raise ValueError("item_sizes and item_probs must have equal length and probs must sum to 1")
        if max(item_sizes) > capacity:
            raise ValueError("an item larger than the bag capacity can never be placed")
        if invalid_action not in self.INVALID_ACTIONS:
            raise ValueError(f"invalid_action must be one of {self.INVALID_ACTIONS}, got {invalid_action!r}")
        self.capacity = capacity
        self.item_sizes = np.asarray(item_sizes, dtype=np.int64)
        self.item_probs = np.asarray(item_probs, dtype=np.float64)
        self.horizon = horizon
        self.invalid_action = invalid_action
        self.invalid_penalty = invalid_penalty
        self.reward_scale = reward_scale
        self.action_space = gym.spaces.Discrete(capacity)
        # counts for levels 1..capacity-1, item size, fraction of the horizon elapsed
        self.observation_space = gym.spaces.Box(0.0, np.inf, shape=(capacity + 1,), dtype=np.float32)
        self.counts = np.zeros(capacity, dtype=np.int64)  # index 0 unused
        self.item = 0
        self.t = 0
        self.last_waste_change = 0

    def _observation(self) -> np.ndarray:
        return np.concatenate([self.counts[1:], [self.item, self.t / self.horizon]]).astype(np.float32)

    def _draw_item(self) -> int:
        return int(self.np_random.choice(self.item_sizes, p=self.item_probs))

    @property
    def waste(self) -> int:
        levels = np.arange(self.capacity)
        return int((self.counts * (self.capacity - levels))[1:].sum())

    def is_valid(self, action: int) -> bool:
        return action == 0 or (self.counts[action] > 0 and action + self.item <= self.capacity)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.counts[:] = 0
        self.t = 0
        self.last_waste_change = 0
        self.item = self._draw_item()
        return self._observation(), {}

    def step(self, action: int):
        action = int(action)
        if not 0 <= action < self.capacity:
            raise ValueError(f"action {action} outside [0, {self.capacity})")
        invalid = not self.is_valid(action)
        if invalid and self.invalid_action == "end":
            reward = self.OFFICIAL_INVALID_REWARD - self.last_waste_change
        elif invalid:
            reward = -self.invalid_penalty
        else:
            before = self.waste
            if action > 0:
                self.counts[action] -= 1
            level = action + self.item
            if level < self.capacity:
                self.counts[level] += 1
            self.last_waste_change = self.waste - before
            reward = float(-self.last_waste_change)
        self.t += 1
        terminated = self.t >= self.horizon or (invalid and self.invalid_action == "end")
        self.item = 0 if terminated else self._draw_item()
        info = {"invalid": invalid, "waste": self.waste}
        return self._observation(), float(reward) * self.reward_scale, terminated, False, info


class BinPackingLanguage(LanguageEnv):
    task = (
        "You pack items arriving one at a time into bags of capacity {capacity}. Each item must be placed "
        "immediately, either into an open bag that still has room for it or into a new bag. The goal is to "
        "minimise wasted space: every new bag adds its free space to the waste, filling a bag reduces it. "
        "Placing an item into a bag without room is heavily penalised."
    )
    example_rules = (
        '{"background": "A new bag adds all its free space to the waste.", "rule": "When the item fits into an open '
        'bag, put it there instead of opening a new bag.", "state_relevance": "Applies whenever a bag has room."}',
        '{"background": "A bag filled exactly wastes nothing and is closed.", "rule": "If some bag has exactly the '
        'item\'s size left, put the item into that bag.", "state_relevance": "Check each open level for an exact fit."}',
    )

    def __init__(self, env: BinPackingEnv | None = None, **env_kwargs):
        super().__init__(env or BinPackingEnv(**env_kwargs))
        self.task = type(self).task.format(capacity=self.env.unwrapped.capacity)

    def describe(self) -> str:
        env = self.env.unwrapped
        bags = [f"{int(env.counts[l])} bag(s) at level {l}" for l in range(1, env.capacity) if env.counts[l]]
        open_bags = ", ".join(bags) if bags else "no open bags"
        return (
            f"Item {env.t + 1} of {env.horizon} has size {env.item}. Open bags: {open_bags}. "
            f"Current waste: {env.waste}."
        )

    def valid_actions(self) -> dict[int, str]:
        env = self.env.unwrapped
        actions = {0: f"put the size-{env.item} item into a new bag"}
        for level in range(1, env.capacity):
            if env.is_valid(level):
                actions[level] = f"put the size-{env.item} item into a bag at level {level}"
        return actions

    def state_features(self) -> np.ndarray:
        env = self.env.unwrapped
        counts = env.counts[1:] / 4.0  # a handful of open bags is typical
        return np.concatenate([counts, [env.item / env.capacity, env.t / env.horizon]]).astype(np.float32)
