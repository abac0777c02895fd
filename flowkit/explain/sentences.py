"""Split an explanation into sentences s^1..s^K (seed 000 Eq. 5 rewards one value per sentence).

A sentence ends at ``.``, ``!``, ``?`` or ``…`` (optionally followed by closing quotes/brackets) when
whitespace or the end of the text follows, and at every line break. A period does not end a sentence
inside a number (``3.5``: no whitespace follows) or after a known abbreviation (``e.g.``, ``Dr.``,
``etc.``). Single capital letters do end sentences ("the answer is B."), so initials split. Text after
the last terminator is a final sentence of its own.
"""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset({
    "e.g", "i.e", "etc", "vs", "cf", "al", "approx", "dr", "mr", "mrs", "ms", "prof", "sr", "jr", "st",
    "no", "fig", "eq", "sec", "vol", "inc", "ltd", "co", "jan", "feb", "mar", "apr", "jun", "jul", "aug",
    "sep", "sept", "oct", "nov", "dec", "u.s", "a.m", "p.m",
})

_TERMINATOR = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s|$)|\n")
_WORD_BEFORE = re.compile(r"([A-Za-z][A-Za-z.]*)\.$")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of the sentences of ``text``, whitespace trimmed, in order."""
    spans, start = [], 0
    for match in _TERMINATOR.finditer(text):
        if match.group() != "\n" and _is_abbreviation(text[start:match.start() + 1]):
            continue
        end = match.start() if match.group() == "\n" else match.end()
        spans.append((start, end))
        start = match.end()
    spans.append((start, len(text)))
    return [trimmed for span in spans if (trimmed := _trim(text, span)) is not None]


def split_sentences(text: str) -> list[str]:
    return [text[a:b] for a, b in sentence_spans(text)]


def _is_abbreviation(head: str) -> bool:
    """Whether the ``.`` closing ``head`` belongs to a known abbreviation, not a sentence end."""
    if not head.endswith("."):
        return False
    match = _WORD_BEFORE.search(head)
    if match is None:
        return False
    return match.group(1).lower() in ABBREVIATIONS


def _trim(text: str, span: tuple[int, int]) -> tuple[int, int] | None:
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if end > start else None
