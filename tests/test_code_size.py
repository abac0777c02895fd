"""No class of flowkit over 300 lines and no function over 80: a newcomer reads each piece whole (issue 31)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flowkit"
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
# FlowReward: split in progress (branch split31)
KNOWN_EXCEPTIONS = {"rewards/flow_reward.py:FlowReward"}


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
    offenders = [entry for entry in oversized() if entry.split(" ")[0] not in KNOWN_EXCEPTIONS]
    assert not offenders, "over the size limits:\n" + "\n".join(offenders)


def test_the_known_exception_is_still_needed():
    """Once FlowReward is split, its exception goes: the list never outlives its reason."""
    still = {entry.split(" ")[0] for entry in oversized()}
    assert KNOWN_EXCEPTIONS <= still, f"no longer oversized, drop from KNOWN_EXCEPTIONS: {KNOWN_EXCEPTIONS - still}"
