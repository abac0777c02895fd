"""Imports point down only: cli/commands → modules → engine → rl, flow, rewards, llm, data, explain, rbrl → kernels."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flowkit"
PLAIN = ["engine", "rl", "flow", "rewards", "llm", "data", "explain", "rbrl"]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("subpackage", PLAIN)
def test_plain_layers_import_neither_lightning_nor_upper_layers(subpackage):
    for path in (PACKAGE / subpackage).rglob("*.py"):
        for name in imported_modules(path):
            assert not name.startswith(("lightning", "pytorch_lightning")), f"{path} imports {name}"
            assert not name.startswith(("flowkit.modules", "flowkit.cli", "flowkit.commands")), f"{path} imports {name}"
            if subpackage != "engine":
                assert not name.startswith("flowkit.engine"), f"{path} imports {name}"


def test_kernels_import_nothing_else_of_flowkit():
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for name in imported_modules(path):  # flowkit._C is the kernels' own native extension
            assert not name.startswith("flowkit.") or name.startswith(("flowkit.kernels", "flowkit._C")), f"{path} imports {name}"


def test_modules_do_not_import_the_cli():
    for path in (PACKAGE / "modules").rglob("*.py"):
        for name in imported_modules(path):
            assert not name.startswith(("flowkit.cli", "flowkit.commands")), f"{path} imports {name}"
