"""Language wrappers (seed 002 §4.2): a task description, state → text, and the list of valid actions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np


@dataclass(frozen=True)
class PromptSnapshot:
    """The prompt p_t frozen before the action is applied: Alg. 1 explains (line 7) and judges (line 8)
    after the environment step (line 6), about the state the action was chosen in. It offers the
    ``prompt()`` / ``describe()`` / ``valid_actions()`` a :class:`LanguageEnv` offers."""

    prompt_text: str
    description: str
    actions: dict[int, str]

    def prompt(self) -> str:
        return self.prompt_text

    def describe(self) -> str:
        return self.description

    def valid_actions(self) -> dict[int, str]:
        return dict(self.actions)


class LanguageEnv(gym.Wrapper):
    """A gymnasium env plus what an LLM agent needs to read it: ``task``, ``describe()``, ``valid_actions()``.

    ``state_features()`` is the numeric state given to the selector network (seed 002 §5.2, "state
    representation"); subclasses rescale physical units so a Linear layer sees values of order one.
    """

    task: str = ""
    example_rules: tuple[str, ...] = ()  # shown to the LLM when it writes rules (seed 002 §5.1)

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

    def snapshot(self) -> PromptSnapshot:
        return PromptSnapshot(self.prompt(), self.describe(), self.valid_actions())


def mean_episode_returns(env: LanguageEnv, play_step: Callable[[LanguageEnv], tuple[float, bool]], seeds: list[int],
                         episodes: int) -> np.ndarray:
    """Mean episode return per evaluation seed, with the rule agents' episode seeds ``1000·seed + k``;
    ``play_step(env)`` takes one step and returns (reward, done)."""
    means = []
    for seed in seeds:
        returns = []
        for k in range(episodes):
            env.reset(seed=1000 * seed + k)
            total, done = 0.0, False
            while not done:
                reward, done = play_step(env)
                total += float(reward)
            returns.append(total)
        means.append(float(np.mean(returns)))
    return np.asarray(means)
