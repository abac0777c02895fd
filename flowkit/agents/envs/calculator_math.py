"""Math problems with a calculator: the model reads the problem (the record's ``prompt``), may call ``calculate`` on
arithmetic expressions as often as its turns allow, and ends with the answer in ``\\boxed{}``; reward 1 when flowkit's
math grader (:func:`flowkit.data.grader.grade`) finds it equal to the record's ``answer``, else 0.

The calculator evaluates what it parses itself (:mod:`ast`): numbers, ``+ - * / // % **``, parentheses and signs, no
names, calls or attributes; an expression too long, or an operation whose result would be too large to compute
quickly (``9**9**9``), is an error the model reads in the tool's reply.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from flowkit.agents.environment import EnvStep, Message, register_environment
from flowkit.data.grader import grade

MAX_EXPRESSION_CHARS = 500
MAX_RESULT_BITS = 4096  # ~1233 decimal digits: any operation on such numbers takes microseconds
BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression to evaluate, such as "(347 + 281) * 3 / 4"
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {error.msg}") from None
    value = _evaluate(tree.body)
    return str(value) if isinstance(value, int) else f"{value:.15g}"


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        # |left| ** right has at least (bits(left) - 1) * right bits: refused before Python spends hours on it
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
            _too_large((left.bit_length() - 1) * right)
        return _bounded(BINARY[type(node.op)](left, right))
    raise ValueError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")


def _bounded(value: int | float | complex) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large for a float")
    _too_large(value.bit_length() if isinstance(value, int) else 0)
    return value


def _too_large(bits: int) -> None:
    if bits > MAX_RESULT_BITS:
        raise ValueError(f"the result is too large (over {MAX_RESULT_BITS} bits)")


@register_environment("calculator_math")
class CalculatorMath:
    """One problem per episode (record fields ``prompt``, ``answer``); a turn without a tool call is the final
    answer."""

    tools = (calculate,)

    def reset(self, record: dict[str, Any]) -> list[Message]:
        self.answer = str(record["answer"])
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, action: str) -> EnvStep:
        return EnvStep([], reward=float(grade(action, self.answer)), done=True)
