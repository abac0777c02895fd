"""Language wrappers (seed 002 §4.2): a task description, state → text, and the list of valid actions."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class LanguageEnv(gym.Wrapper):
    """A gymnasium env plus what an LLM agent needs to read it: ``task``, ``describe()``, ``valid_actions()``.

    ``state_features()`` is the numeric state given to the selector network (seed 002 §5.2, "state
    representation"); subclasses rescale physical units so a Linear layer sees values of order one.
    """

    task: str = ""

    def describe(self) -> str:
        """The current state in natural language (``lang(s_t)`` of seed 002 §4.2)."""
        raise NotImplementedError

    def valid_actions(self) -> dict[int, str]:
        """Action id → text, for the actions allowed in the current state."""
        raise NotImplementedError

    def state_features(self) -> np.ndarray:
        raise NotImplementedError

    @property
    def state_dim(self) -> int:
        return int(self.state_features().shape[0])

    def prompt(self) -> str:
        """``p_t = f(task, lang(s_t))`` with the valid actions listed."""
        actions = "\n".join(f"{a}: {text}" for a, text in self.valid_actions().items())
        return f"Task: {self.task}\n\nCurrent state: {self.describe()}\n\nValid actions:\n{actions}"
