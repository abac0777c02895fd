"""A stateful guessing game: the environment hides a whole number in ``[low, high]``; after each guess, written as
``\\boxed{n}``, it answers "higher" or "lower"; finding the number within ``max_guesses`` guesses is reward 1, else 0.
Each guess has to depend on the answers so far (binary search needs ⌈log2(high − low + 1)⌉ guesses)."""

from __future__ import annotations

import math
import random
from typing import Any

from flowkit.agents.environment import EnvStep, Message, register_environment
from flowkit.agents.envs.long_addition import boxed_answer


@register_environment("guess_number")
class GuessNumber:
    """Record fields: ``secret``, ``low``, ``high``, ``max_guesses`` (:func:`guess_number_records`). A turn
    without a whole number in a box counts as a guess and is answered with how to guess."""

    tools = ()

    def reset(self, record: dict[str, Any]) -> list[Message]:
        self.secret, self.guesses_left = int(record["secret"]), int(record["max_guesses"])
        return [{"role": "user", "content": f"Guess my number from {record['low']} to {record['high']}, "
                                            f"as \\boxed{{n}}. You have {self.guesses_left} guesses."}]

    def step(self, action: str) -> EnvStep:
        self.guesses_left -= 1
        guess = boxed_answer(action)
        if guess is not None and guess.lstrip("-").isdigit() and int(guess) == self.secret:
            return EnvStep([], reward=1.0, done=True)
        if self.guesses_left == 0:
            return EnvStep([], reward=0.0, done=True)
        if guess is None or not guess.lstrip("-").isdigit():
            hint = "write your guess as a whole number in \\boxed{}"
        else:
            hint = "higher" if self.secret > int(guess) else "lower"
        return EnvStep([{"role": "user", "content": hint}])


def guess_number_records(count: int, seed: int = 0, low: int = 1, high: int = 100) -> list[dict[str, int]]:
    """``count`` games with secrets drawn with ``seed``, each allowing the guesses binary search needs."""
    rng = random.Random(f"guess_number:{seed}")
    max_guesses = math.ceil(math.log2(high - low + 1))
    return [{"secret": rng.randint(low, high), "low": low, "high": high, "max_guesses": max_guesses}
            for _ in range(count)]
