"""No class of flowkit over 300 lines and no function over 80: a newcomer reads each piece whole (issue 31)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flowkit"
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def oversized() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.name} ({lines} lines > {limit})")
    return found


def test_no_class_over_300_and_no_function_over_80_lines():
    offenders = oversized()
    assert not offenders, "over the size limits:\n" + "\n".join(offenders)
