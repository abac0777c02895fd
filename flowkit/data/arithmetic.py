"""The bundled verifiable task: two-digit addition solved digit by digit.

An example is ``{"prompt": "47+38=", "solution": "7+8=15,4+3+1=8\\boxed{85}", "answer": "85"}``:
the units step ``a0+b0=s``, a comma, the tens step ``a1+b1[+1]=t`` (``+1`` only when the units
step carried), then the answer in ``\\boxed{}``. A three-digit result keeps the same layout
(``87+38=`` → ``7+8=15,8+3+1=12\\boxed{125}``); without a carry the ``+1`` is absent
(``41+32=`` → ``1+2=3,4+3=7\\boxed{73}``).

Token layout shared by SFT, offline flow pretraining and RL (the bundled ``tiny_adder`` tokenizer has
a post-processor that prepends ``<bos>``, so ``tokenizer(prompt)`` already yields the RL prompt)::

    <bos> p r o m p t | s o l u t i o n <eos>
    \\---- prompt ----/ \\--- response ---/

:func:`flowkit.llm.sft.completion_tensors` (SFT) and :func:`flowkit.llm.packing.encode_pairs` (RL, flow
pretraining) build exactly this sequence; the response (solution + ``<eos>``) is what the loss, the latents
and the rewards cover.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OPERANDS = range(10, 100)
SPLIT_SIZES = {"test": 500, "val": 500}
ALPHABET = "0123456789+=,\\boxed{}"


def make_example(a: int, b: int) -> dict[str, str]:
    """The prompt, digit-by-digit solution and answer for ``a + b`` with two-digit ``a`` and ``b``."""
    if a not in OPERANDS or b not in OPERANDS:
        raise ValueError(f"operands must be two-digit numbers, got {a} and {b}")
    units = a % 10 + b % 10
    carry = units // 10
    tens = a // 10 + b // 10 + carry
    tens_lhs = f"{a // 10}+{b // 10}" + ("+1" if carry else "")
    answer = str(a + b)
    solution = f"{a % 10}+{b % 10}={units},{tens_lhs}={tens}\\boxed{{{answer}}}"
    return {"prompt": f"{a}+{b}=", "solution": solution, "answer": answer}


def generate_splits(seed: int = 0) -> dict[str, list[dict[str, str]]]:
    """All 8100 ordered pairs, shuffled with ``seed``: 500 test, 500 val, the remaining 7100 train.

    The splits are disjoint as (a, b) pairs; ``a+b`` and ``b+a`` may fall into different splits.
    """
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    random.Random(seed).shuffle(pairs)
    examples = [make_example(a, b) for a, b in pairs]
    n_test, n_val = SPLIT_SIZES["test"], SPLIT_SIZES["val"]
    return {
        "test": examples[:n_test],
        "val": examples[n_test:n_test + n_val],
        "train": examples[n_test + n_val:],
    }


def write_splits(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``{train,val,test}.jsonl`` (fields prompt, solution, answer) and return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, examples in generate_splits(seed).items():
        paths[name] = out / f"{name}.jsonl"
        with paths[name].open("w") as f:
            f.writelines(json.dumps(ex) + "\n" for ex in examples)
    return paths
