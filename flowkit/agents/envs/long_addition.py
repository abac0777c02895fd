"""The long-addition task (:mod:`flowkit.data.long_addition`) as a tool-use episode: the model reads the sum to
compute (``347+281+905=``), calls the ``add`` tool for each column's digits and carry, from the units up, and ends
with the answer in ``\\boxed{}``; reward 1 when it is the sum, else 0."""

from __future__ import annotations

import re
from typing import Any

from flowkit.agents.environment import EnvStep, Message, register_environment
from flowkit.data.long_addition import DEFAULT_OPERANDS
from flowkit.data.records import load_records
from flowkit.llm.backbone import ASSETS

# The answers are whole numbers: the last box's content, as written.
BOXED_ANSWER = re.compile(r"\\boxed\{([^{}]*)\}")


def add(numbers: list[int]) -> int:
    """Add whole numbers, such as one column's digits and the carry from the column below.

    Args:
        numbers: the numbers to add
    """
    if not isinstance(numbers, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise TypeError(f"numbers must be a list of whole numbers, got {numbers!r}"[:200])
    return sum(numbers)


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, stripped, or None."""
    answers = BOXED_ANSWER.findall(text)
    return answers[-1].strip() if answers else None


@register_environment("long_addition")
class LongAddition:
    """One sum per episode (record fields ``prompt``, ``answer``); a turn without a tool call is the final answer."""

    tools = (add,)

    def reset(self, record: dict[str, Any]) -> list[Message]:
        self.answer = str(record["answer"])
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, action: str) -> EnvStep:
        return EnvStep([], reward=float(boxed_answer(action) == self.answer), done=True)


def long_addition_records(split: str = "train", operands: int = DEFAULT_OPERANDS) -> list[dict[str, Any]]:
    """The bundled records of ``split`` (train, val, test) at difficulty ``operands``."""
    return list(load_records(ASSETS / "long_addition" / f"k{operands}" / f"{split}.jsonl", ("prompt", "answer")))
