"""`flowkit docs`: serve the documentation site (``docs/``, ``mkdocs.yml``) locally with ``mkdocs serve``.

It needs a source checkout (the site's pages are not installed with the package) and the ``docs`` extra::

    pip install -e ".[docs]"
    flowkit docs                      # → http://127.0.0.1:8000, rebuilt as pages change
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

from flowkit.registry import standalone

CONFIG = Path(__file__).resolve().parents[2] / "mkdocs.yml"


@standalone("docs")
def docs_command(argv: list[str]) -> None:
    """serve the documentation site locally (mkdocs serve): flowkit docs [--addr HOST:PORT]"""
    parser = argparse.ArgumentParser(prog="flowkit docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--addr", default="127.0.0.1:8000", help="address to serve on (default: 127.0.0.1:8000)")
    options = parser.parse_args(argv)
    if importlib.util.find_spec("mkdocs") is None:
        _fail("flowkit docs needs mkdocs: install the docs extra, pip install -e \".[docs]\"")
    if not CONFIG.is_file():
        _fail(f"flowkit docs needs a source checkout: no {CONFIG}")
    command = [sys.executable, "-m", "mkdocs", "serve", "--config-file", str(CONFIG), "--dev-addr", options.addr]
    try:
        sys.exit(subprocess.run(command, check=False).returncode)
    except KeyboardInterrupt:  # Ctrl-C ends the server; mkdocs has already said so
        sys.exit(0)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
