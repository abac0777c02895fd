"""`flowkit` command line: LightningCLI (:mod:`flowkit.lightning_cli`) with flowkit's own subcommands and users'.

Every run lives in its run directory, ``trainer.default_root_dir`` (:func:`~flowkit.lightning_cli.place_run`).
Users add a subcommand with :func:`subcommand` (from :mod:`flowkit.registry`, re-exported here): a function
``fn(trainer, model, datamodule, **options)`` whose extra keyword arguments (typed, with defaults) become the
subcommand's options::

    from flowkit.cli import subcommand

    @subcommand("my-report")
    def my_report(trainer, model, datamodule, out: str = "report.txt"):
        \"\"\"Write a report.\"\"\"
        ...

and make it a plugin: an installed package names it in the entry-point group ``flowkit.subcommands`` (see
:func:`load_plugins`), and ``flowkit my-report --config ...`` runs it with the same config machinery as ``fit``.

This module imports neither torch nor Lightning at its top (they take seconds): ``flowkit --help`` is built without
them (:func:`print_overview` reads the built-in commands' docstrings from their source), ``flowkit COMMAND --help``
is answered from a cache (:func:`cached_help`), and :mod:`flowkit.lightning_cli` is imported only when a command runs.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path

from flowkit.errors import ConfigError, RunError
from flowkit.registry import STANDALONE, SUBCOMMANDS, subcommand

__all__ = ["FlowkitCLI", "FlowkitTrainer", "main", "subcommand"]

PLUGIN_GROUP = "flowkit.subcommands"
# Lightning's commands as flowkit runs them (their Trainer docstrings speak of epochs and dataloaders)
LIGHTNING_COMMANDS = {
    "fit": "Train the model: RL steps (after any flow pretraining) until trainer.max_steps, then export.",
    "validate": "Evaluate a checkpoint (--ckpt_path) on the validation sets.",
    "test": "Evaluate a checkpoint (--ckpt_path) on the test sets.",
    "predict": "Run the model's predict_step over the data module's predict set.",
}
COMMANDS_DIR = Path(__file__).resolve().parent / "commands"
PLUGIN_WARNINGS: list[str] = []  # the last load_plugins() warnings
LAZY_ATTRIBUTES = ("FlowkitCLI", "FlowkitTrainer", "place_run")


def __getattr__(name: str):
    """``flowkit.cli.FlowkitCLI`` (and the other names of :mod:`flowkit.lightning_cli`), imported on first use."""
    if name in LAZY_ATTRIBUTES:
        from flowkit import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_builtin_subcommands() -> None:
    import flowkit.commands  # noqa: F401  (registers flowkit's own subcommands)
    import flowkit.strategies  # noqa: F401  (registers the deepspeed_cpu* strategy names)


def load_plugins() -> list[str]:
    """Load the subcommands installed packages declare in the entry-point group ``flowkit.subcommands``.

    An entry point names a module (``count-params = my_project.commands``: importing it runs its
    :func:`subcommand` / :func:`~flowkit.registry.standalone` decorators) or a function (``count-params =
    my_project.commands:count_params``: registered as ``flowkit count-params`` unless a decorator already registered
    it). A plugin that fails to load is left out with a one-line warning naming it; flowkit itself still runs.
    Returns the warnings (printed to stderr, and kept in :data:`PLUGIN_WARNINGS` for the help cache).
    """
    warnings_printed = PLUGIN_WARNINGS
    warnings_printed.clear()
    taken = {*LIGHTNING_COMMANDS, *builtin_commands(), *SUBCOMMANDS, *STANDALONE}  # flowkit's and a launcher's
    for entry in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            if entry.name in taken:
                raise ValueError(f"'{entry.name}' is a command of flowkit itself; choose another name")
            loaded = entry.load()
            already = any(loaded is fn for fn in (*SUBCOMMANDS.values(), *STANDALONE.values()))
            if callable(loaded) and not inspect.ismodule(loaded) and not already:
                subcommand(entry.name)(loaded)
        except Exception as err:  # noqa: BLE001  (whatever a plugin raises, flowkit runs without it)
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            line = (f"warning: flowkit plugin {entry.name!r} ({entry.value}) failed to load and is left out: "
                    f"{reason}")
            print(line, file=sys.stderr)
            warnings_printed.append(line)
    return warnings_printed


def _put_working_directory_on_path() -> None:
    """Class paths and reward functions of the user's project import from the working directory, as under
    ``python -m`` (a console script's ``sys.path`` starts with the script's own directory instead)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(args: list[str] | None = None) -> None:
    """Run the CLI; bad input (see :func:`_input_error`) prints ``error: <one line>`` and exits with code 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _put_working_directory_on_path()
    argv = sys.argv[1:] if args is None else list(args)
    if len(argv) == 1 and argv[0] in HELP_FLAGS:
        print_overview()
        return
    if args is None and _is_help_request(argv):  # a console `--help` (callers passing `args` get argparse's exit)
        cached_help(argv, lambda: _run(args, argv))
        return
    _run(args, argv)


def _run(args: list[str] | None, argv: list[str]) -> None:
    """Register every subcommand (flowkit's, then the plugins'), then run the command ``argv``."""
    _load_builtin_subcommands()
    load_plugins()
    if argv and argv[0] in STANDALONE:  # e.g. `flowkit plot RUN_DIR`: no config, model or trainer
        STANDALONE[argv[0]](argv[1:])
        return
    try:
        _check_config_files(argv)
        from flowkit.lightning_cli import run

        run(args, _checkpoint_argument(argv))
    except Exception as err:
        message = _input_error(err, argv)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


# --------------------------------------------------------------------------------------------- help
HELP_FLAGS = ("-h", "--help")


def builtin_commands() -> dict[str, tuple[str, str]]:
    """flowkit's own commands, ``{name: (kind, first docstring line)}`` with kind ``subcommand`` or ``standalone``,
    read from the ``@subcommand("name")`` / ``@standalone("name")`` decorators in ``flowkit/commands/*.py`` without
    importing them (they import torch and Lightning)."""
    found = {}
    for path in sorted(COMMANDS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name)
                        and decorator.func.id in ("subcommand", "standalone") and decorator.args
                        and isinstance(decorator.args[0], ast.Constant)):
                    found[decorator.args[0].value] = (decorator.func.id, _first_line(ast.get_docstring(node)))
    return found


def print_overview() -> None:
    """``flowkit --help``: every command with its first docstring line (plugins' included), no torch import."""
    load_plugins()  # a plugin's own imports are its own
    builtin = builtin_commands()
    with_config = dict(LIGHTNING_COMMANDS)
    with_config.update({name: doc for name, (kind, doc) in builtin.items() if kind == "subcommand"})
    with_config.update({name: _first_line(fn.__doc__) for name, fn in SUBCOMMANDS.items()})
    other = {name: doc for name, (kind, doc) in builtin.items() if kind == "standalone"}
    other.update({name: _first_line(fn.__doc__) for name, fn in STANDALONE.items()})
    width = max(map(len, [*with_config, *other])) + 2
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
        "",
        "Start with: flowkit fit --config configs/rlfr_tiny.yaml",
    ]))


def _first_line(doc: str | None) -> str:
    return " ".join(((doc or "").strip().split("\n\n") or [""])[0].split())


def _is_help_request(argv: list[str]) -> bool:
    """``flowkit COMMAND --help``: text that depends only on the installed code."""
    return len(argv) == 2 and argv[1] in HELP_FLAGS and not argv[0].startswith("-")


def cached_help(argv: list[str], build) -> None:
    """Print the help text of ``argv`` from the cache, or build it (``build()`` prints it) and cache it.

    Building needs Lightning's parser, whose import alone takes seconds; the text changes only with the code, so
    it is cached under a key of everything it is made from: ``argv``, the terminal width, flowkit's source files,
    the versions of Lightning, jsonargparse and torch, the subcommands registered before :func:`main` ran (a
    launcher's) and the installed plugins (their entry points and source files). The plugins' load warnings are kept with the text and printed again. The cache lives in
    ``$FLOWKIT_CACHE_DIR`` (default ``~/.cache/flowkit``); a cache that cannot be written is skipped.
    """
    path = _help_cache_file(argv)
    if path is not None and path.is_file():
        try:
            cached = json.loads(path.read_text(encoding="utf-8"))
            for line in cached["warnings"]:
                print(line, file=sys.stderr)
            sys.stdout.write(cached["text"])
            return
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry is rebuilt
    captured = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
        try:
            build()
        except SystemExit as exit:  # argparse ends a help request with exit 0
            if exit.code not in (0, None):
                raise
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            temporary.write_text(json.dumps({"text": captured.getvalue(), "warnings": PLUGIN_WARNINGS}))
            temporary.replace(path)


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _help_cache_file(argv: list[str]) -> Path | None:
    root = os.environ.get("FLOWKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flowkit")
    key = hashlib.sha256()
    key.update(json.dumps([argv, shutil.get_terminal_size().columns, sys.version]).encode())
    for name in ("lightning", "jsonargparse", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            key.update(f"{name}=={importlib.metadata.version(name)}".encode())
    _hash_sources(key, Path(__file__).resolve().parent)
    for name, fn in sorted({**SUBCOMMANDS, **STANDALONE}.items()):  # registered before main(), e.g. by a launcher
        key.update(name.encode())
        with contextlib.suppress(TypeError, OSError):
            _hash_file(key, Path(inspect.getsourcefile(fn)))
    for entry in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        key.update(f"{entry.name}={entry.value}".encode())
        top = entry.value.split(":")[0].split(".")[0]
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(".py"):
            source = Path(origin)
            _hash_sources(key, source.parent) if source.name == "__init__.py" else _hash_file(key, source)
    return Path(root) / "help" / f"{key.hexdigest()[:32]}.json"


def _hash_sources(key, directory: Path) -> None:
    for path in sorted(directory.rglob("*.py")):
        _hash_file(key, path)


def _hash_file(key, path: Path) -> None:
    with contextlib.suppress(OSError):
        stat = path.stat()
        key.update(f"{path}:{stat.st_mtime_ns}:{stat.st_size}".encode())


def _check_config_files(argv: list[str]) -> None:
    """Each ``--config`` file must be YAML; the parser would say only ``in "<unicode string>", line 2`` (not the file,
    nor that a tab indents it)."""
    import yaml

    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name not in ("--config", "-c") or (not sep and i + 1 == len(argv)):
            continue
        path = Path(value if sep else argv[i + 1])
        if not path.is_file():  # the parser also takes the config itself as a string
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the config file ({err})") from None
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            problem = " ".join((getattr(err, "problem", None) or str(err)).split())
            if mark is None:
                raise ConfigError(f"{path}: not YAML ({problem})") from None
            line = (text.splitlines() or [""])[min(mark.line, len(text.splitlines()) - 1)]
            tab = "; YAML indents with spaces, never tabs" if "\t" in line[:mark.column + 1] else ""
            raise ConfigError(f"{path}:{mark.line + 1}:{mark.column + 1}: {problem}{tab}") from None


def _checkpoint_argument(argv: list[str]) -> str:
    """The checkpoint named on the command line (``--ckpt_path`` / ``--checkpoint``), for error messages."""
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name in ("--ckpt_path", "--checkpoint"):
            return value or (argv[i + 1] if i + 1 < len(argv) else "")
    return "a checkpoint"


def _input_error(err: BaseException, argv: list[str]) -> str | None:
    """The one-line message of the bad-input error behind ``err``, or ``None`` if ``err`` is a bug.

    Bad input is a :class:`~flowkit.errors.ConfigError` (any module's option check), a
    :class:`~flowkit.data.records.RecordError`, a :class:`~flowkit.llm.backbone.BackboneError`, a value
    Lightning rejects (``MisconfigurationException``) or a command line / config the parser rejects; a
    :class:`~flowkit.errors.RunError` (a full disk, a run directory in use) is printed the same way.
    jsonargparse and Lightning wrap exceptions raised while building or fitting the module; the user
    should see the message that names the option, not that chain. A key of a ``--config`` file in ``argv`` is
    reported with the file's name.
    """
    from argparse import ArgumentError

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from flowkit.data.records import RecordError
    from flowkit.llm.backbone import BackboneError

    seen: set[int] = set()
    chain = []
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    for link in chain:
        if isinstance(link, (ConfigError, RunError, RecordError, BackboneError, MisconfigurationException)):
            return " ".join(str(link).split())
    if isinstance(chain[0], ArgumentError):
        return _parser_error_line(str(chain[0]), argv)
    return None


_PARSER_REPORT_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
                        "Given value type:", "Given value:", "- Expected a <class 'NoneType'>")


def _parser_error_line(report: str, argv: list[str]) -> str:
    """jsonargparse's nested report (one block per Union alternative) → ``key.path: innermost message``.

    The innermost message is the most indented line that is not part of the report's scaffolding; the key
    path is the chain of ``Parser key`` lines above it (``init_args`` where it descends into a class). A class that
    does not import is reported under ``class_path``, and an option the class does not take with the nearest one.
    """
    path: list[tuple[int, str, str | None]] = []  # (indent, key, class path) of the enclosing key / class lines
    best: tuple[int, str, list[tuple[str, str | None]]] | None = None
    for line in report.splitlines():
        text, indent = line.strip(), len(line) - len(line.lstrip())
        if not text or text.startswith(_PARSER_REPORT_NOISE):
            continue
        while path and path[-1][0] >= indent:
            path.pop()
        key = re.fullmatch(r'Parser key "(.+)":', text)
        class_path = re.fullmatch(r"- Problem with given class_path '(.+)':", text)
        if key or class_path:
            path.append((indent, key.group(1) if key else "init_args", class_path.group(1) if class_path else None))
        elif best is None or indent > best[0]:
            best = (indent, text.removeprefix("- "), [(k, c) for _, k, c in path])
    if best is None:
        return " ".join(report.split())
    _, message, keys = best
    owner = keys[-1][1] if keys else None
    names = [k for k, _ in keys]
    if owner is not None:
        message, key = _class_problem(owner, message)
        if message.startswith("cannot import"):
            names[-1] = "class_path"
        source = config_file_with_key(argv, ".".join([*names, key]), leaf=True) if key else None
        if source is not None:
            return f"{source}: {'.'.join(names)}: {message}"
    return f"{'.'.join(names)}: {message}" if names else message


def _class_problem(class_path: str, message: str) -> tuple[str, str | None]:
    """A problem jsonargparse reports for ``class_path``, with the name the user probably meant, and the key (below
    the class's ``init_args``) it is about, if one. An option of the old flat form that a class's ``MOVED_OPTIONS``
    maps to a key of an option group is named with that key (``temperature`` is now ``sampling.temperature``)."""
    if re.match(r"(module '.+' has no attribute|No module named|Import path .+ does not)", message):
        module = class_path.rpartition(".")[0]
        try:
            choices = [f"{module}.{n}" for n in dir(importlib.import_module(module)) if not n.startswith("_")]
        except Exception:  # noqa: BLE001  (the module itself does not import: nothing to suggest)
            choices = []
        return f"cannot import {class_path!r} ({message}){did_you_mean(class_path, choices)}", None
    try:
        module, _, name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001
        cls = None
    moved = getattr(cls, "MOVED_OPTIONS", {})
    option = re.fullmatch(r"Option '(.+)' is not accepted", message)
    group_option = re.fullmatch(r"Group '(.+)' does not accept option '(.+)'", message)
    argument = re.fullmatch(r"unrecognized arguments: --([^\s=]+).*", message)
    scalar_for_group = re.fullmatch(r'Parser key "(\w+)": Unable to load config .*', message)
    key = (option or argument or scalar_for_group).group(1) if (option or argument or scalar_for_group) else (
        f"{group_option.group(1)}.{group_option.group(2)}" if group_option else None)
    if key is None:
        return message, None
    if key in moved and moved[key] != key:
        return f"{key!r} is now {moved[key]!r} (the options of {class_path} are in groups)", key
    if scalar_for_group:
        return message, key
    suggestion = did_you_mean(key, _option_keys(cls))
    near_old = difflib.get_close_matches(key, list(moved), n=1, cutoff=0.6)
    if not suggestion and near_old:  # a misspelt option of the old flat form: the key it moved to
        suggestion = f"; did you mean {moved[near_old[0]]!r}?"
    return f"{class_path} has no option {key!r}{suggestion}", key


def _option_keys(cls: type | None) -> list[str]:
    """The keys of ``cls``'s constructor, each option group's as ``group.field``."""
    import dataclasses
    import typing

    if cls is None:
        return []
    try:
        hints = typing.get_type_hints(cls.__init__)
        parameters = inspect.signature(cls).parameters
    except Exception:  # noqa: BLE001  (an unresolvable annotation: the names alone)
        return list(getattr(inspect.signature(cls), "parameters", {}))
    keys = []
    for name in parameters:
        keys.append(name)
        if dataclasses.is_dataclass(hints.get(name)):
            keys += [f"{name}.{f.name}" for f in dataclasses.fields(hints[name]) if f.init]
    return keys


def config_file_with_key(argv: list[str], dotted: str, leaf: bool = False) -> str | None:
    """The last ``--config`` file of ``argv`` that sets the key ``dotted`` (``trainer.max_step``), if any; ``leaf``:
    to a value that is not a mapping (an old flat option, not the option group of the same name)."""
    import yaml

    found = None
    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name not in ("--config", "-c") or (not sep and i + 1 == len(argv)):
            continue
        path = value if sep else argv[i + 1]
        try:
            node = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node and not (leaf and isinstance(node[last], dict)):
            found = path
    return found


def did_you_mean(word: str, choices) -> str:
    """``"; did you mean 'X'?"`` for the choice nearest to ``word``, or ``""`` when none is near."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
