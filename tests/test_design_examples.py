"""docs/design.md's four extension examples are the code that runs: each Python block under a line
``<!-- example: FILE NAME... -->`` is, in full, the top-level definitions NAME... of FILE (decorators included), in
that order, two blank lines apart, as in a file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
EXAMPLE = re.compile(r"<!-- example: (\S+) ([\w ]+) -->\n```python\n(.*?)```\n", re.S)
# an estimator, a loss with its own hyper-parameter, a reward model, a rollout engine
EXAMPLE_FILES = {"flowkit/rl/advantages.py", "tests/step/test_extending_algorithms.py",
                 "examples/correctness_probe_reward.py", "tests/llm/test_engines.py"}


def definitions(path: Path, names: list[str]) -> str:
    """The source text of the top-level functions / classes ``names`` of ``path``, from their first decorator."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    nodes = {node.name: node for node in ast.parse(text).body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    pieces = []
    for name in names:
        node = nodes[name]
        start = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
        pieces.append("".join(lines[start - 1:node.end_lineno]))
    return "\n\n".join(pieces)


def test_each_extension_example_is_its_source_in_full():
    examples = EXAMPLE.findall(DESIGN.read_text(encoding="utf-8"))
    assert {file for file, _, _ in examples} == EXAMPLE_FILES
    for file, names, block in examples:
        assert block == definitions(ROOT / file, names.split()), f"docs/design.md's example of {file} ({names})"
