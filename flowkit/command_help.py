"""The console's help, built without importing torch or Lightning (importing them takes seconds; torch alone ~2 s).

* ``flowkit --help`` (:func:`print_overview`): every command with its first docstring line; flowkit's own read
  from the ``@subcommand`` / ``@standalone`` decorators in ``flowkit/commands/*.py`` with :mod:`ast`.
* ``flowkit COMMAND --help`` for a command with a config (:func:`print_command_help`): the options the parser takes,
  read from their sources instead of from the parser: the Trainer's from ``Trainer.__init__``'s signature and
  "Args:" docstring in Lightning's installed ``trainer.py``, the command's own from ``Trainer.<command>`` there, from
  flowkit's subcommand function in ``flowkit/commands`` or from a plugin's (or a launcher's) registered function,
  set out by argparse's formatter. ``tests/test_command_help.py`` checks the names and defaults against the parser's
  own help. The model's and the data's options are the class's: ``--model.help CLASS`` asks the parser, which
  imports the class anyway.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import inspect
import re
import shutil
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flowkit.registry import STANDALONE, SUBCOMMANDS

HELP_FLAGS = ("-h", "--help")
# Lightning's commands as flowkit runs them (their Trainer docstrings speak of epochs and dataloaders)
LIGHTNING_COMMANDS = {
    "fit": "Train the model: RL steps (after any flow pretraining) until trainer.max_steps, then export.",
    "validate": "Evaluate a checkpoint (--ckpt_path) on the validation sets.",
    "test": "Evaluate a checkpoint (--ckpt_path) on the test sets.",
    "predict": "Run the model's predict_step over the data module's predict set.",
}
# What LightningCLI leaves out of each command's options: the objects the CLI builds itself
LIGHTNING_SKIPPED = {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                     "validate": {"model", "dataloaders", "datamodule"},
                     "test": {"model", "dataloaders", "datamodule"},
                     "predict": {"model", "dataloaders", "datamodule"}}
SUBCOMMAND_SKIPPED = {"trainer", "model", "datamodule"}  # fn(trainer, model, datamodule, **options)
LIST_TYPE = re.compile(r"\b(list|List|Iterable)\[")  # an option of such a type also takes `--NAME+`
PACKAGE = Path(__file__).resolve().parent
COMMANDS_DIR = PACKAGE / "commands"


def first_paragraph(doc: str | None) -> str:
    return " ".join(((doc or "").strip().split("\n\n") or [""])[0].split())


def command_description(command: str, summary: str) -> str:
    """A config command's description: its summary, and where the model's and the data's options are listed."""
    return (f"{summary} The options below are Lightning's and the command's; the model's and the data's are listed by "
            f"`flowkit {command} --model.help flowkit.modules.PolicyModule` and `--data.help "
            "flowkit.modules.RolloutDataModule` (or another class), and set as `--model.init_args.NAME`.")


@functools.lru_cache(maxsize=1)
def _subcommand_functions() -> dict[str, tuple[str, ast.FunctionDef, str]]:
    """flowkit's own commands, ``{name: (kind, function node, module)}`` with kind ``subcommand`` or ``standalone``,
    from the decorators in ``flowkit/commands/*.py`` (importing them would import torch)."""
    found = {}
    for path in sorted(COMMANDS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name)
                        and decorator.func.id in ("subcommand", "standalone") and decorator.args
                        and isinstance(decorator.args[0], ast.Constant)):
                    found[decorator.args[0].value] = (decorator.func.id, node, f"flowkit.commands.{path.stem}")
    return found


def builtin_commands() -> dict[str, tuple[str, str]]:
    """flowkit's own commands, ``{name: (kind, first docstring paragraph)}``."""
    return {name: (kind, first_paragraph(ast.get_docstring(node)))
            for name, (kind, node, _) in _subcommand_functions().items()}


def builtin_function(command: str, kind: str) -> Callable | None:
    """flowkit's own function of the ``kind`` command ``command`` (``subcommand`` or ``standalone``) where its module
    is imported already; None otherwise (importing the module registers it)."""
    found_kind, node, module = _subcommand_functions().get(command, (None, None, None))
    return getattr(sys.modules[module], node.name) if found_kind == kind and module in sys.modules else None


def standalone_module(command: str) -> str | None:
    """The module of flowkit's standalone command ``command`` (``flowkit.commands.plot``), if it is one."""
    kind, _, module = _subcommand_functions().get(command, (None, None, None))
    return module if kind == "standalone" else None


def print_overview(plugins: dict[str, str]) -> None:
    """``flowkit --help``: every command with its first docstring line; ``plugins``, not loaded, with a line each."""
    builtin = builtin_commands()
    with_config = dict(LIGHTNING_COMMANDS)
    with_config.update({name: doc for name, (kind, doc) in builtin.items() if kind == "subcommand"})
    with_config.update({name: first_paragraph(fn.__doc__) for name, fn in SUBCOMMANDS.items()})
    other = {name: doc for name, (kind, doc) in builtin.items() if kind == "standalone"}
    other.update({name: first_paragraph(fn.__doc__) for name, fn in STANDALONE.items()})
    width = max(map(len, [*with_config, *other, *plugins])) + 2
    text_width = max(40, shutil.get_terminal_size().columns - width - 4)

    def rows(commands: dict[str, str]) -> list[str]:
        lines = []
        for name, doc in commands.items():
            wrapped = textwrap.wrap(doc, text_width) or [""]
            lines.append(f"  {name:<{width}}{wrapped[0]}")
            lines += [" " * (width + 2) + more for more in wrapped[1:]]
        return lines

    print("\n".join([
        "usage: flowkit COMMAND [--config CONFIG.yaml] [--section.option VALUE ...]",
        "       flowkit COMMAND --help    (the command's options)",
        "",
        "flowkit: RL for language models with flow-matching rewards, on PyTorch Lightning.",
        "",
        "commands with a config (model, data, trainer; see `flowkit fit --help`):",
        *rows(with_config),
        "",
        "other commands:",
        *rows(other),
        *(["", "plugin commands (installed packages, loaded when run):", *rows(plugins)] if plugins else []),
        "",
        "Start with: flowkit fit --config configs/rlfr_tiny.yaml",
    ]))


# --------------------------------------------------------------------------------------------- a command's options
@dataclass(frozen=True)
class Option:
    """One keyword of a signature: its annotation as written, its default as the parser prints it (``None``:
    required), its docstring entry, and whether it takes a class (the parser then adds ``--NAME.help``)."""

    name: str
    annotation: str
    default: str | None
    doc: str
    takes_class: bool = False


def config_commands() -> list[str]:
    """Every command that takes a config: Lightning's, flowkit's subcommands, plugins' and a launcher's."""
    builtin = [name for name, (kind, _, _) in _subcommand_functions().items() if kind == "subcommand"]
    return [*LIGHTNING_COMMANDS, *builtin, *(name for name in SUBCOMMANDS if name not in builtin)]


def print_command_help(command: str) -> None:
    print(command_parser(command).format_help(), end="")


def option_names(command: str) -> set[str]:
    """The options the CLI's parser takes for ``command``, without ``--`` (``trainer.max_steps``)."""
    return {name[2:] for action in command_parser(command)._actions for name in action.option_strings
            if name.startswith("--")}


def command_parser(command: str) -> argparse.ArgumentParser:
    """An argparse parser laid out as the CLI's ``command`` parser, only to print its help."""
    trainer_class, lightning_classes = _trainer_class()
    if command in LIGHTNING_COMMANDS:
        summary = LIGHTNING_COMMANDS[command]
        options = _options_of(_method(trainer_class, command), LIGHTNING_SKIPPED[command], lightning_classes)
    elif command in SUBCOMMANDS:
        summary = first_paragraph(SUBCOMMANDS[command].__doc__)
        options = _options_of_function(SUBCOMMANDS[command])
    else:
        node = _subcommand_functions()[command][1]
        summary = first_paragraph(ast.get_docstring(node))
        options = _options_of(node, SUBCOMMAND_SKIPPED, set())
    parser = argparse.ArgumentParser(
        prog=f"flowkit {command}", add_help=False, formatter_class=_Formatter,
        usage=f"flowkit {command} [-c CONFIG] [--SECTION.NAME VALUE ...] [--NAME VALUE ...]",
        description=command_description(command, summary))
    general = parser.add_argument_group("options")
    general.add_argument("-h", "--help", action="store_true", help="Show this help message and exit.")
    general.add_argument("-c", "--config", metavar="CONFIG",
                         help="Path to a configuration file in json or yaml format.")
    general.add_argument("--print_config", nargs="?", metavar="=flags",
                         help="Print the configuration after applying all other arguments and exit. The optional flags "
                              "customizes the output and are one or more keywords separated by comma. The supported "
                              "flags are: skip_default, skip_unset.")
    general.add_argument("--seed_everything", metavar="SEED_EVERYTHING",
                         help="Set to an int to run seed_everything with this value before classes instantiation. Set "
                              "to True to use a random seed. (type: Union[bool, int], default: True)")
    trainer = parser.add_argument_group(
        "trainer", "Lightning's Trainer, as `--trainer.NAME VALUE` or a `trainer:` section of the config; flowkit adds "
                   "its checkpointing callbacks and plugin (atomic files, RNG states, a checkpoint on SIGTERM) to "
                   "whatever is set here")
    trainer.add_argument("--trainer", metavar="CONFIG", help="Path to a configuration file.")
    _add(trainer, "trainer.", _options_of(_method(trainer_class, "__init__"), set(), lightning_classes))
    for key, base in (("model", "LightningModule"), ("data", "LightningDataModule")):
        group = parser.add_argument_group(key, f"`{key}: {{class_path: ..., init_args: {{...}}}}` in a config")
        group.add_argument(f"--{key}.help", nargs="?", metavar="CLASS_PATH_OR_NAME",
                           help=f"Show the help for the given subclass of {base} and exit.")
        known = ", ".join(_flowkit_subclasses(base))
        group.add_argument(f"--{key}", metavar="CONFIG | CLASS_PATH_OR_NAME | .INIT_ARG_NAME VALUE",
                           help=f'One or more arguments specifying "class_path" and "init_args" for any subclass of '
                                f"{base}. (type: Optional[{base}], default: null, known subclasses: {known})")
    _add(parser.add_argument_group(command, summary), "", options)
    return parser


class _Formatter(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=24, width=shutil.get_terminal_size().columns - 2)


def _add(group, prefix: str, options: list[Option]) -> None:
    for option in options:
        name = f"--{prefix}{option.name}"
        if option.takes_class:
            group.add_argument(f"{name}.help", nargs="?", metavar="CLASS_PATH_OR_NAME",
                               help="Show the help for the given subclass and exit.")
        if option.annotation in ("bool", "Optional[bool]", "bool | None"):
            metavar = "{true,false,null}" if option.annotation != "bool" else "{true,false}"
        else:
            metavar = option.name.upper()
        facts = [f"type: {option.annotation}"] if option.annotation else []
        facts = ["required", *facts] if option.default is None else [*facts, f"default: {option.default}"]
        doc = f"{option.doc} " if option.doc else ""
        group.add_argument(name, metavar=metavar, help=f"{doc}({', '.join(facts)})".replace("%", "%%"))
        if LIST_TYPE.search(option.annotation):  # jsonargparse's `--NAME+ VALUE` appends to the list (not in help)
            group.add_argument(f"{name}+", help=argparse.SUPPRESS)


def _trainer_class() -> tuple[ast.ClassDef, set[str]]:
    """``Trainer``'s class node in Lightning's installed ``trainer.py`` (found, not imported), and the names in that
    file that stand for Lightning classes (the options taking one get ``--NAME.help``)."""
    spec = importlib.util.find_spec("lightning")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("flowkit needs Lightning: pip install lightning")
    tree = _lightning_source("lightning.pytorch.trainer.trainer")
    names = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
             and (node.module or "").startswith("lightning") for alias in node.names}
    classes = {name for name in names if _names_classes("lightning.pytorch.trainer.trainer", name)}
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    return trainer, classes


@functools.lru_cache(maxsize=None)
def _lightning_source(module: str) -> ast.Module | None:
    root = Path(importlib.util.find_spec("lightning").origin).parent.parent
    path = root.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return ast.parse(candidate.read_text(encoding="utf-8"))
    return None


def _names_classes(module: str, name: str, depth: int = 0) -> bool:
    """Whether ``name`` in Lightning's ``module`` is a class or a type alias (``_PLUGIN_INPUT = Union[...]``) that
    names one; a public imported name is taken as a class, a private one is followed to where it is defined."""
    tree = _lightning_source(module)
    if tree is None or depth > 4:
        return False
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return True
        if (isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
                and name in {t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                             if isinstance(t, ast.Name)}):
            used = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)} - {"Union", "Optional", "Literal"}
            return any(_names_classes(module, other, depth + 1) for other in used)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return not alias.name.startswith("_") or _names_classes(node.module, alias.name, depth + 1)
    return False


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == name)


def _options_of(fn: ast.FunctionDef, skipped: set[str], class_names: set[str]) -> list[Option]:
    """The keywords of ``fn`` but ``self`` and ``skipped``, in order."""
    arguments = fn.args
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    pairs = [*zip(positional, defaults), *zip(arguments.kwonlyargs, arguments.kw_defaults)]
    docs = argument_docs(ast.get_docstring(fn))
    options = []
    for argument, default in pairs:
        if argument.arg == "self" or argument.arg in skipped:
            continue
        annotation = ast.unparse(argument.annotation) if argument.annotation is not None else ""
        names = {node.id for node in ast.walk(argument.annotation or ast.Constant(None)) if isinstance(node, ast.Name)}
        options.append(Option(argument.arg, annotation, None if default is None else _default_text(default),
                              docs.get(argument.arg, ""), bool(names & class_names)))
    return options


def _options_of_function(fn) -> list[Option]:
    """The options of a registered subcommand function ``fn(trainer, model, datamodule, **options)``."""
    docs = argument_docs(inspect.getdoc(fn))
    options = []
    for parameter in list(inspect.signature(fn).parameters.values())[3:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = parameter.annotation
        if annotation is inspect.Parameter.empty:
            annotation = ""
        elif not isinstance(annotation, str):
            annotation = inspect.formatannotation(annotation)
        default = None if parameter.default is inspect.Parameter.empty else _value_text(parameter.default)
        options.append(Option(parameter.name, annotation, default, docs.get(parameter.name, "")))
    return options


def _default_text(node: ast.expr) -> str:
    try:
        return _value_text(ast.literal_eval(node))
    except ValueError:  # a name or a call: as written
        return ast.unparse(node)


def _value_text(value) -> str:
    """A default as the parser prints it: ``null`` for None, strings bare."""
    return "null" if value is None else str(value)


def argument_docs(docstring: str | None) -> dict[str, str]:
    """The entries of a Google-style ``Args:`` section, each joined into one line."""
    docs: dict[str, str] = {}
    lines = (docstring or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:")), None)
    if start is None:
        return docs
    indent = None
    name = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:  # the section ended
            break
        entry = re.match(r"(\*{0,2}\w+)(?: \(.*?\))?:(?:\s|$)(.*)", line.strip())
        if depth == indent and entry:
            name = entry.group(1)
            docs[name] = entry.group(2).strip()
        elif name is not None:
            docs[name] = f"{docs[name]} {line.strip()}".strip()
    return docs


def _flowkit_subclasses(base: str) -> list[str]:
    """flowkit's subclasses of ``base`` (by the names of their bases, transitively), as class paths the parser
    accepts (``flowkit.modules.NAME``)."""
    bases = {}
    for path in sorted((PACKAGE / "modules").glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
    found = {base}
    while True:
        more = {name for name, names in bases.items() if names & found} - found
        if not more:
            break
        found |= more
    return [f"flowkit.modules.{name}" for name in sorted(found - {base})]
