"""Imports point down only, layer by layer (docs/design.md "Layers"), and no file imports itself back: a part of
flowkit imports from the layers below its own and from nothing beside or above it, so each layer is testable without
the ones above; and at file level the imports form no cycle, so each file reads (and imports) before the ones that
use it.

The walk reads every import of a file, deferred ones (inside a function, under ``TYPE_CHECKING``) included: a cycle
through a deferred import still ties the two files together. ``import a.b`` and ``from a import b`` point at the
file ``a/b.py`` (or the package ``a/b/__init__.py``) when there is one, else at ``a``'s ``__init__``; a package's
parents are not counted, so ``from flowkit.rl.losses import x`` points at ``rl/losses.py`` only. Within a package,
its ``__init__`` may re-export its modules, and its modules import the module that defines a name, never the
``__init__`` of a package they are part of (which would import them back)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flowkit"
NATIVE = {"flowkit._C"}  # the compiled extension: a file without Python imports
# Bottom to top; each entry a layer of subpackages / top-level modules that do not import one another.
LAYERS = [
    ("kernels",),                                            # fused ops; `_C` is their own native extension
    ("errors", "batch", "distributed", "seeding", "registry"),  # what every layer shares
    ("options",),                                            # option groups, declared once each
    ("rl", "data", "llm"),                                   # pure math and models
    ("explain", "rbrl", "agents"),                           # the explanation and rule-bottleneck methods' parts;
                                                             # agentic episodes (environments, tools, runner)
    ("rewards",),                                            # reward models
    ("step",),                                               # one RL step in plain PyTorch
    ("checkpointing",),                                      # fault tolerance (the first Lightning layer)
    ("strategies",),
    ("modules",),                                            # LightningModules, DataModules, callbacks
    ("commands",),
    ("cli", "command_help", "parser_errors", "lightning_cli", "__main__", "__init__"),  # the console
]
CONSOLE = LAYERS[-1]
LAYER = {unit: index for index, units in enumerate(LAYERS) for unit in units}
LIGHTNING_FREE = [unit for units in LAYERS[:LAYER["checkpointing"]] for unit in units]


def module_name(path: Path, root: Path) -> str:
    """``flowkit/llm/engines.py`` → ``flowkit.llm.engines``; a package's ``__init__.py`` → the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def unit_of(module: str) -> str:
    """The layer entry a module belongs to: its top-level subpackage or module (``__init__`` for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name the file imports, relative imports resolved; ``from a import b`` gives ``a.b``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def resolve(name: str, modules: set[str]) -> str | None:
    """The file a dotted name is in: its longest prefix that is a module; None outside the walked package."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def import_graph(root: Path, native: set[str] = frozenset()) -> dict[str, set[str]]:
    """Module → the modules of ``root``'s package it imports (file level)."""
    files = modules_of(root)
    known = set(files) | set(native)
    graph = {}
    for module, path in files.items():
        targets = {resolve(name, known) for name in imported_names(path, module)}
        graph[module] = targets - {None, module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted: the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def own_packages_imported(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, package) where a module imports the ``__init__`` of a package it belongs to, the top one aside (whose
    ``__init__`` imports nothing eagerly, so that ``flowkit --help`` starts without torch)."""
    return [(module, target) for module, targets in sorted(graph.items()) for target in sorted(targets)
            if "." in target and module.startswith(target + ".")]


GRAPH = import_graph(PACKAGE, NATIVE)


def test_every_part_of_flowkit_has_a_layer():
    units = {unit_of(module) for module in GRAPH}
    assert units <= set(LAYER), f"add {sorted(units - set(LAYER))} to LAYERS"


@pytest.mark.parametrize("unit", sorted(LAYER))
def test_imports_point_down_only(unit):
    for module, targets in GRAPH.items():
        if unit_of(module) != unit:
            continue
        for imported in {unit_of(target) for target in targets - NATIVE} - {unit}:
            allowed = LAYER.get(imported, len(LAYERS)) < LAYER[unit] or (unit in CONSOLE and imported in CONSOLE)
            assert allowed, f"{module} imports flowkit.{imported}, which is not below {unit}"


def test_no_import_cycles_between_files():
    found = cycles(GRAPH)
    assert not found, "import cycles: " + "; ".join(" ↔ ".join(cycle) for cycle in found)


def test_no_module_imports_a_package_it_belongs_to():
    found = own_packages_imported(GRAPH)
    assert not found, "import the defining module instead: " + "; ".join(f"{m} imports {p}" for m, p in found)


@pytest.mark.parametrize("unit", LIGHTNING_FREE)
def test_the_layers_below_checkpointing_import_no_lightning(unit):
    for module, path in modules_of(PACKAGE).items():
        if unit_of(module) == unit:
            for name in imported_names(path, module):
                assert not name.startswith(("lightning", "pytorch_lightning")), f"{path} imports {name}"


def test_kernels_import_nothing_else_of_flowkit():
    for module, targets in GRAPH.items():
        if unit_of(module) == "kernels":
            assert {unit_of(target) for target in targets} <= {"kernels", "_C"}, f"{module} imports {targets}"


def test_the_checker_sees_cycles_and_upward_imports(tmp_path):
    """Both import forms, relative imports and deferred ones are read, so neither a cycle nor an upward import can
    slip through as ``from flowkit import ...``, ``from . import ...`` or an import inside a function."""
    root = tmp_path / "flowkit"
    files = {
        "__init__.py": "",
        "cli.py": "def main():\n    from flowkit import lightning_cli\n",
        "lightning_cli.py": "from flowkit.cli import main\nfrom flowkit.rl.losses import x\n",
        "rl/__init__.py": "from .losses import x\n",
        "rl/losses.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import advantages\nx = 1\n",
        "rl/advantages.py": "import flowkit.rl.losses\nfrom flowkit import modules\n",
        "rewards/__init__.py": "from flowkit.rewards.flow_step import y\n",
        "rewards/flow_step.py": "from flowkit.rewards import z\ny = 1\n",
        "modules.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = import_graph(root)
    assert graph["flowkit.rl.advantages"] == {"flowkit.rl.losses", "flowkit.modules"}  # `modules` is above `rl`
    assert graph["flowkit.lightning_cli"] == {"flowkit.cli", "flowkit.rl.losses"}  # not the package `flowkit.rl`
    assert cycles(graph) == [["flowkit.cli", "flowkit.lightning_cli"], ["flowkit.rewards", "flowkit.rewards.flow_step"],
                             ["flowkit.rl.advantages", "flowkit.rl.losses"]]
    assert own_packages_imported(graph) == [("flowkit.rewards.flow_step", "flowkit.rewards")]
