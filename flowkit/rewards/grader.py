"""Outcome verifier: ``\\boxed{}`` extraction and answer equivalence (RLFR outcome reward r_o, DESIGN.md §2)."""

from __future__ import annotations

BOXED = "\\boxed"


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces matched), or None.

    An unclosed last box gives None rather than an earlier box: the final answer is the last one
    written. ``\\{`` and ``\\}`` are escaped braces and do not count. Work is linear in ``len(text)``.
    """
    start = text.rfind(BOXED)
    if start < 0:
        return None
    i = start + len(BOXED)
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
        j += 1
    return None
