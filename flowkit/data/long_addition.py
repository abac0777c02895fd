"""The sparse-outcome task family: multi-operand addition of three-digit numbers, solved column by column.

Where the bundled two-digit adder (:mod:`flowkit.data.arithmetic`) is easy enough that most groups of 8 samples
hold a correct one, this family is long enough that a briefly fine-tuned policy is right in only a few samples:
most groups are all wrong, the outcome advantage is zero there, and any learning signal inside them has to come
from a dense reward (RLFR's claim, issue 25). The difficulty knob is the number of operands ``k`` (2, 3, 4;
default :data:`DEFAULT_OPERANDS`): every extra operand lengthens each column step and raises its carry.

An example (``k = 3``)::

    {"prompt": "347+281+905=", "solution": "7+1+5=13,4+8+0+1=13,3+2+9+1=15\\boxed{1533}", "answer": "1533"}

Each column step, from the units up, is the column's digits in operand order, ``+c`` when the column below
carried ``c`` (1–3), and the column total; then the answer in ``\\boxed{}``. With two two-digit operands this is
exactly the adder's layout (``47+38=`` → ``7+8=15,4+3+1=8\\boxed{85}``), over the same alphabet, so the policy's
character tokenizer and the token layout of SFT, flow pretraining and RL are the adder's (see that module).

Bundled data: ``flowkit/assets/long_addition/k{2,3,4}/{train,val,test}.jsonl``, written by
``scripts/make_long_adder.py`` through :func:`write_splits`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from flowkit.data.arithmetic import ALPHABET

__all__ = ["ALPHABET", "DEFAULT_OPERANDS", "DIGITS", "OPERAND_COUNTS", "SPLIT_SIZES", "generate_splits",
           "make_example", "max_new_tokens", "max_solution_length", "write_splits"]

DIGITS = 3
OPERAND_COUNTS = (2, 3, 4)
DEFAULT_OPERANDS = 3
SPLIT_SIZES = {"test": 500, "val": 500, "train": 4000}
SLACK_TOKENS = 6  # generation room past the longest solution and its <eos>: a wrong response can still close its box


def make_example(operands: list[int] | tuple[int, ...]) -> dict[str, str]:
    """The prompt, column-by-column solution and answer for the sum of ``operands`` (two or more, all of one
    length in digits, no leading zeros)."""
    texts = [str(n) for n in operands]
    if len(texts) < 2 or any(n < 0 for n in operands) or len({len(t) for t in texts}) != 1 or any(
            t[0] == "0" and len(t) > 1 for t in texts):
        raise ValueError(f"need two or more non-negative operands of one length in digits, got {list(operands)}")
    steps, carry = [], 0
    for column in range(len(texts[0]) - 1, -1, -1):
        terms = [t[column] for t in texts] + ([str(carry)] if carry else [])
        total = sum(int(d) for d in terms)
        steps.append(f"{'+'.join(terms)}={total}")
        carry = total // 10
    answer = str(sum(operands))
    return {"prompt": "+".join(texts) + "=", "solution": ",".join(steps) + f"\\boxed{{{answer}}}", "answer": answer}


def generate_splits(operands: int = DEFAULT_OPERANDS, seed: int = 0, digits: int = DIGITS,
                    sizes: dict[str, int] | None = None) -> dict[str, list[dict[str, str]]]:
    """``sizes`` (default :data:`SPLIT_SIZES`) distinct ordered tuples of ``operands`` ``digits``-digit numbers,
    drawn with ``seed`` and disjoint across splits (a permutation of a tuple may fall into another split)."""
    sizes = dict(SPLIT_SIZES if sizes is None else sizes)
    low, high = 10 ** (digits - 1), 10**digits - 1
    if operands < 2 or sum(sizes.values()) > (high - low + 1) ** operands:
        raise ValueError(f"cannot draw {sum(sizes.values())} distinct sums of {operands} {digits}-digit operands")
    rng = random.Random(f"long_addition:{operands}:{digits}:{seed}")  # each k draws its own stream
    seen: set[tuple[int, ...]] = set()
    splits = {}
    for name, size in sizes.items():
        rows = []
        while len(rows) < size:
            draw = tuple(rng.randint(low, high) for _ in range(operands))
            if draw not in seen:
                seen.add(draw)
                rows.append(make_example(draw))
        splits[name] = rows
    return splits


def max_solution_length(operands: int, digits: int = DIGITS) -> int:
    """Characters of the longest solution (all nines: every column at its largest total and carry)."""
    return len(make_example([10**digits - 1] * operands)["solution"])


def max_new_tokens(operands: int, digits: int = DIGITS) -> int:
    """The generation budget of difficulty ``operands``: the longest solution, its ``<eos>`` and some slack."""
    return max_solution_length(operands, digits) + 1 + SLACK_TOKENS


def write_splits(out_dir: str | Path, seed: int = 0, operand_counts: tuple[int, ...] = OPERAND_COUNTS
                 ) -> dict[int, dict[str, Path]]:
    """Write ``out_dir/k{k}/{train,val,test}.jsonl`` (fields prompt, solution, answer) for every ``k``."""
    paths: dict[int, dict[str, Path]] = {}
    for k in operand_counts:
        out = Path(out_dir) / f"k{k}"
        out.mkdir(parents=True, exist_ok=True)
        paths[k] = {}
        for name, examples in generate_splits(k, seed).items():
            paths[k][name] = out / f"{name}.jsonl"
            with paths[k][name].open("w") as f:
                f.writelines(json.dumps(ex) + "\n" for ex in examples)
    return paths
