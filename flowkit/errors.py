"""Errors the ``flowkit`` CLI prints as one line (exit code 2): the input is wrong, or the run cannot go on.

Raise :class:`ConfigError` for a bad option value as early as possible (in ``__init__``), naming the option
and the allowed range: ``ConfigError("PolicyModule.sampling.num_samples must be >= 1, got 0")``. Raise :class:`RunError`
for what the user must fix outside the configuration (a full disk, a run directory in use), naming the file.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sized


class ConfigError(ValueError):
    """A bad option value or combination of options, found before any work starts."""


class RunError(RuntimeError):
    """The run cannot go on for a reason outside its options: a full disk, another run in its run directory, a
    checkpoint that cannot be read. The message is one line naming the file and what to do."""


def check_range(owner: str, name: str, value: float | None, low: float | None = None, high: float | None = None,
                *, open_low: bool = False, open_high: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``low ≤ value ≤ high`` (``<`` on an ``open_`` side; ``None``: unbounded).

    ``value is None`` passes: it is the "off" value of the options that accept it. NaN and ±inf never pass, also
    on an unbounded side (``lr: .inf`` would turn every weight non-finite at the first step; ``None`` is "off").
    ``check_range("CompletionLogs", "rows", 0, 1)`` → ``CompletionLogs.rows must be >= 1, got 0``.
    """
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{owner}.{name} must be a finite number, got {value!r}")
    above = low is None or (value > low if open_low else value >= low)
    below = high is None or (value < high if open_high else value <= high)
    if above and below:
        return
    if high is None:
        allowed = f"{'>' if open_low else '>='} {low}"
    elif low is None:
        allowed = f"{'<' if open_high else '<='} {high}"
    else:
        allowed = f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    raise ConfigError(f"{owner}.{name} must be {allowed}, got {value!r}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the choice nearest to ``word``, or ``""`` when none is near."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_nonempty(owner: str, name: str, values: Sized) -> None:
    """Raise :class:`ConfigError` if the list option ``values`` is empty."""
    if len(values) == 0:
        raise ConfigError(f"{owner}.{name} must not be empty")


class NonFiniteTraining(RunError, FloatingPointError):
    """Training cannot go on from non-finite state (NaN or inf weights, or every step skipped); nothing was saved
    from it. The message names the last good checkpoint, which ``--ckpt_path last`` resumes."""


def require(condition: bool, message: str) -> None:
    """A one-line :class:`ConfigError` saying ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)
