"""`flowkit docs` serves the site with mkdocs, or says in one line which extra to install."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from flowkit.commands import docs


def test_without_mkdocs_it_is_one_line_naming_the_extra(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "mkdocs" else real_find_spec(name))
    with pytest.raises(SystemExit) as exit_info:
        docs.docs_command([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: flowkit docs needs mkdocs: install the docs extra, pip install -e \".[docs]\""]


def test_it_serves_the_checkouts_site_on_the_address_given(monkeypatch):
    pytest.importorskip("mkdocs")
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda command, check: calls.append(command) or
                        subprocess.CompletedProcess(command, 0))
    with pytest.raises(SystemExit) as exit_info:
        docs.docs_command(["--addr", "127.0.0.1:8123"])
    assert exit_info.value.code == 0
    [command] = calls
    assert command[1:4] == ["-m", "mkdocs", "serve"]
    assert command[command.index("--config-file") + 1] == str(docs.CONFIG) and docs.CONFIG.is_file()
    assert command[command.index("--dev-addr") + 1] == "127.0.0.1:8123"
