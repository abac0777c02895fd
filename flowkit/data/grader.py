"""Outcome verifier: ``\\boxed{}`` extraction and answer equivalence (the outcome reward r_o of eq. 9;
the official RLFR code gives 1 correct, 0.5 wrong but boxed, 0 otherwise).

Equivalence is decided in stages, cheapest first, so that the common cases never reach sympy:

1. normalised string equality (whitespace, ``\\dfrac``/``\\tfrac``, ``\\left``/``\\right``, thin spaces);
2. rejection of absurd predictions (too long, numeric exponent towers, huge literal exponents or
   factorials) that would make sympy build astronomically large numbers;
3. exact comparison when both sides are plain integers (the bundled arithmetic task);
4. math-verify ``parse`` + ``verify`` in a persistent child process with a hard time limit.

math-verify's own timeout uses ``signal.alarm``: whole seconds only, main thread only, and it cannot
interrupt C code such as a big-integer power. The child process works from any thread (a rollout
worker, a DataLoader worker, pytest) and is killed and replaced when a comparison overruns.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Literal

BOXED = "\\boxed"
MAX_ANSWER_CHARS = 500
MAX_EXPONENT_DIGITS = 4
MAX_FACTORIAL_DIGITS = 3
WORKER_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take many seconds

_SPACING = re.compile(r"\\\\|\s+|\\[,;:! ]|\\(?:left|right)(?![A-Za-z])")  # ``\\`` (row break) is kept
_EXPONENT_TOKEN = re.compile(r"\d+|\\[A-Za-z]+|.")
_INTEGER = re.compile(r"-?\d+")
_FACTORIAL = re.compile(r"(\d+)\s*!")


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
    end = _closing_brace(text, i)
    return None if end is None else text[i + 1:end].strip()


def _closing_brace(text: str, open_at: int) -> int | None:
    """Index of the brace closing ``text[open_at] == "{"``, skipping escaped characters; None if unclosed."""
    depth, j = 0, open_at
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
                return j
        j += 1
    return None


def normalize_answer(answer: str) -> str:
    """A canonical spelling for the string fast path: no spacing commands, ``\\frac`` for all fractions."""
    text = answer.strip().strip("$").strip().removesuffix(".")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return _SPACING.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else "", text)


def is_absurd(answer: str) -> bool:
    """True for predictions whose evaluation could explode: over-long text, numeric exponent towers
    (``10^{10^{10}}``, ``10^10^10``), literal exponents over 4 digits, factorials of numbers over 3 digits.

    Symbolic exponents (``e^{-x^2}``) are left to the time-limited verifier.
    """
    if len(answer) > MAX_ANSWER_CHARS:
        return True
    if any(len(m.group(1)) > MAX_FACTORIAL_DIGITS for m in _FACTORIAL.finditer(answer)):
        return True
    pos = answer.find("^")
    while pos >= 0:
        operand, after = _exponent_operand(answer, pos + 1)
        numeric = not re.search(r"[A-Za-z]", operand)
        digits = max((len(d) for d in re.findall(r"\d+", operand)), default=0)
        chained = answer[after:].lstrip().startswith("^")
        if numeric and ("^" in operand or chained or digits > MAX_EXPONENT_DIGITS):
            return True
        pos = answer.find("^", pos + 1)
    return False


def _exponent_operand(text: str, start: int) -> tuple[str, int]:
    """The exponent after a ``^`` at ``start - 1`` (a brace group, a digit run, or one character) and the index after it."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i < len(text) and text[i] == "{":
        end = _closing_brace(text, i)
        end = len(text) - 1 if end is None else end
        return text[i + 1:end], end + 1
    match = _EXPONENT_TOKEN.match(text, i)
    return (match.group(0), match.end()) if match else ("", i)


class _VerifyWorker:
    """One math-verify child process per parent process, replaced after a kill; a forked process starts its own."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Drop the worker without touching it: after a fork it (and the lock's state) belong to the parent."""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _ensure_started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.close()
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("math_verify_worker.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )
        if self._read_line(WORKER_STARTUP_TIMEOUT_S) != "ready":
            self.close()
            raise RuntimeError("the math-verify worker process did not start (is math-verify installed?)")
        return self._proc

    def _read_line(self, timeout_s: float) -> str | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return self._proc.stdout.readline().strip() if ready else None

    def equivalent(self, pred: str, ref: str, timeout_s: float) -> bool:
        with self._lock:
            proc = self._ensure_started()
            try:
                proc.stdin.write(json.dumps({"pred": pred, "ref": ref}) + "\n")
                proc.stdin.flush()
                answer = self._read_line(timeout_s)
            except OSError:  # the worker died (e.g. hit its memory limit); the next call starts a new one
                answer = None
            if answer is None:
                self.close()
            return answer == "1"

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


_WORKER = _VerifyWorker()
atexit.register(_WORKER.close)
os.register_at_fork(after_in_child=_WORKER.forget)


def is_equivalent(pred: str, ref: str, timeout_s: float = 1.0) -> bool:
    """Whether the answer ``pred`` equals the reference ``ref`` (both without ``\\boxed``).

    Stops after ``timeout_s`` of math-verify work and then answers False.
    """
    pred_norm, ref_norm = normalize_answer(pred), normalize_answer(ref)
    if pred_norm == ref_norm:
        return bool(pred_norm)
    if not pred_norm or is_absurd(pred):
        return False
    if _INTEGER.fullmatch(pred_norm) and _INTEGER.fullmatch(ref_norm):
        return int(pred_norm) == int(ref_norm)
    return _WORKER.equivalent(pred, ref, timeout_s)


def grade(response: str, reference: str, timeout_s: float = 1.0) -> bool:
    """Whether the last ``\\boxed{}`` of ``response`` is equivalent to ``reference``."""
    boxed = extract_boxed(response)
    return boxed is not None and is_equivalent(boxed, reference, timeout_s)


def outcome_reward(response: str, reference: str, scheme: Literal["official", "binary"] = "official",
                   timeout_s: float = 1.0) -> float:
    """Outcome reward r_o (eq. 9). ``official``: 1 correct, 0.5 wrong with a complete ``\\boxed{}``,
    0 without one (the official RLFR verifier); ``binary``: 1 correct, else 0."""
    if scheme not in ("official", "binary"):
        raise ValueError(f"unknown outcome reward scheme {scheme!r}; choose 'official' or 'binary'")
    if grade(response, reference, timeout_s):
        return 1.0
    if scheme == "official" and extract_boxed(response) is not None:
        return 0.5
    return 0.0
