"""Imports point down only, layer by layer (docs/design.md "Layers"): a part of flowkit imports from the layers below
its own and from nothing beside or above it, so each layer is testable without the ones above."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flowkit"
# Bottom to top; each entry a layer of subpackages / top-level modules that do not import one another.
LAYERS = [
    ("kernels",),                                            # fused ops; `_C` is their own native extension
    ("errors", "batch", "distributed", "seeding", "registry"),  # what every layer shares
    ("options",),                                            # option groups, declared once each
    ("rl", "flow", "data", "llm"),                           # pure math and models
    ("explain", "rbrl"),                                     # the explanation and rule-bottleneck methods' parts
    ("rewards",),                                            # reward models
    ("step",),                                               # one RL step in plain PyTorch
    ("checkpointing",),                                      # fault tolerance (the first Lightning layer)
    ("strategies",),
    ("modules",),                                            # LightningModules, DataModules, callbacks
    ("commands",),
    ("cli", "command_help", "lightning_cli", "__main__", "__init__"),  # the console: its modules call one another
]
CONSOLE = LAYERS[-1]
LAYER = {unit: index for index, units in enumerate(LAYERS) for unit in units}
LIGHTNING_FREE = [unit for units in LAYERS[:LAYER["checkpointing"]] for unit in units]


def unit_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "flowkit":
            names.update(f"flowkit.{alias.name}" for alias in node.names)  # `from flowkit import kernels`
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def flowkit_units(path: Path) -> set[str]:
    return {name.split(".")[1] for name in imported_modules(path) if name.startswith("flowkit.")}


def test_every_part_of_flowkit_has_a_layer():
    units = {unit_of(path) for path in PACKAGE.rglob("*.py")}
    assert units <= set(LAYER), f"add {sorted(units - set(LAYER))} to LAYERS"


@pytest.mark.parametrize("unit", sorted(LAYER))
def test_imports_point_down_only(unit):
    for path in PACKAGE.rglob("*.py"):
        if unit_of(path) != unit:
            continue
        for imported in flowkit_units(path) - {unit, "_C"}:
            allowed = LAYER.get(imported, len(LAYERS)) < LAYER[unit] or (unit in CONSOLE and imported in CONSOLE)
            assert allowed, f"{path.relative_to(PACKAGE.parent)} imports flowkit.{imported}, which is not below {unit}"


@pytest.mark.parametrize("unit", LIGHTNING_FREE)
def test_the_layers_below_checkpointing_import_no_lightning(unit):
    for path in PACKAGE.rglob("*.py"):
        if unit_of(path) == unit:
            for name in imported_modules(path):
                assert not name.startswith(("lightning", "pytorch_lightning")), f"{path} imports {name}"


def test_kernels_import_nothing_else_of_flowkit():
    for path in (PACKAGE / "kernels").rglob("*.py"):
        assert flowkit_units(path) <= {"kernels", "_C"}, f"{path} imports {flowkit_units(path)}"


def test_the_checker_sees_a_violation(tmp_path):
    """The walk reads both import forms, so an upward import cannot slip through as ``from flowkit import ...``."""
    module = tmp_path / "bad.py"
    module.write_text("from flowkit import modules\nimport flowkit.engine.step\nfrom flowkit.rl.losses import x\n")
    assert flowkit_units(module) == {"modules", "engine", "rl"}
