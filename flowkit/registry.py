"""The registry of ``flowkit`` subcommands.

``flowkit/cli.py`` reads it and ``flowkit/commands/*`` (and users' packages) write to it; it imports
neither side, so the commands and the CLI never import each other. :func:`subcommand` registers a
LightningCLI subcommand (built from ``--config``); :func:`standalone` a command with its own arguments. Users spell it
``from flowkit.cli import subcommand`` (re-exported there) or ``from flowkit.registry import subcommand``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

SUBCOMMANDS: dict[str, Callable] = {}
STANDALONE: dict[str, Callable[[list[str]], None]] = {}


def subcommand(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn(trainer, model, datamodule, **options)`` as ``flowkit NAME``.

    The keyword arguments after the first three (typed, with defaults) become the subcommand's options.
    """

    def register(fn: Callable) -> Callable:
        first = [p.name for p in list(inspect.signature(fn).parameters.values())[:3]]
        if first != ["trainer", "model", "datamodule"]:
            raise TypeError(f"subcommand {name!r}: the first parameters must be (trainer, model, datamodule)")
        SUBCOMMANDS[name] = fn
        return fn

    return register


def standalone(name: str) -> Callable[[Callable[[list[str]], None]], Callable[[list[str]], None]]:
    """Register ``fn(argv)`` as ``flowkit NAME ...``: a command that needs no config, model or data (such as
    ``flowkit plot RUN_DIR``) and parses its own arguments."""

    def register(fn: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
        STANDALONE[name] = fn
        return fn

    return register
