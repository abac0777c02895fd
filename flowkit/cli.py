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

This module imports neither torch nor Lightning at its top (they take seconds): ``flowkit --help`` and ``flowkit
COMMAND --help`` are built without them (:mod:`flowkit.command_help`), and :mod:`flowkit.lightning_cli` is imported
only when a command runs.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
from pathlib import Path

from flowkit.command_help import (
    HELP_FLAGS, LIGHTNING_COMMANDS, builtin_commands, config_commands, option_names, print_command_help,
    print_overview, standalone_module,
)
from flowkit.errors import ConfigError, RunError, did_you_mean
from flowkit.registry import STANDALONE, SUBCOMMANDS, subcommand

__all__ = ["FlowkitCLI", "FlowkitTrainer", "main", "subcommand"]

PLUGIN_GROUP = "flowkit.subcommands"
LAZY_ATTRIBUTES = ("FlowkitCLI", "FlowkitTrainer", "place_run")


def __getattr__(name: str):
    """``flowkit.cli.FlowkitCLI`` (and the other names of :mod:`flowkit.lightning_cli`), imported on first use."""
    if name in LAZY_ATTRIBUTES:
        from flowkit import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_builtin_subcommands() -> None:
    import flowkit.commands
    import flowkit.strategies  # noqa: F401  (registers the deepspeed_cpu* strategy names)

    flowkit.commands.load_all()


def load_plugins() -> dict[str, str]:
    """Load the subcommands installed packages declare in the entry-point group ``flowkit.subcommands``.

    An entry point names a module (``count-params = my_project.commands``: importing it runs its
    :func:`subcommand` / :func:`~flowkit.registry.standalone` decorators) or a function (``count-params =
    my_project.commands:count_params``: registered as ``flowkit count-params`` unless a decorator already registered
    it). A plugin that fails to load is left out with a one-line warning naming it (printed to stderr); flowkit
    itself still runs. Returns those warnings, ``{entry-point name: warning}``.
    """
    failed = {}
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
            failed[entry.name] = (f"warning: flowkit plugin {entry.name!r} ({entry.value}) failed to load and is left "
                                  f"out: {reason}")
            print(failed[entry.name], file=sys.stderr)
    return failed


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
    failed_plugins = load_plugins()  # once, before any command; a plugin's own imports are its own
    if len(argv) == 1 and argv[0] in HELP_FLAGS:
        print_overview()
        return
    if len(argv) == 2 and argv[1] in HELP_FLAGS and not _unknown_command(argv[0], failed_plugins):
        _print_help(argv[0])
        return
    try:
        _check_before_lightning(argv, failed_plugins)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    _run(args, argv)


def _check_before_lightning(argv: list[str], failed_plugins: dict[str, str]) -> None:
    """The mistakes found without Lightning, whose import takes seconds, in the words its parser would use: a name
    that is no command, a ``--config`` file that is no YAML, and an option ``--trainer.NAME`` the Trainer does not
    take (:func:`_unknown_trainer_option`)."""
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command is not None:
        unknown = _unknown_command(command, failed_plugins)
        if unknown is not None:
            raise ConfigError(unknown)
        if command not in config_commands():
            return  # a standalone command (`flowkit plot RUN_DIR`) parses its own arguments
    _check_config_files(argv)
    if command is not None:
        _unknown_trainer_option(command, argv)


def _unknown_command(command: str, failed_plugins: dict[str, str]) -> str | None:
    """The error for a name that is no command, listing every command (the parser, seconds later, would list only
    those with a config); ``None`` for a command."""
    standalone = [name for name, (kind, _) in builtin_commands().items() if kind == "standalone"]
    commands = list(dict.fromkeys([*config_commands(), *standalone, *STANDALONE]))
    if command in commands:
        return None
    if command in failed_plugins:
        return f"command {command!r} is a plugin that failed to load (the warning above says why)"
    return (f"unknown command {command!r}{did_you_mean(command, commands)} (the commands: {', '.join(commands)}; "
            "`flowkit --help` describes them)")


def _unknown_trainer_option(command: str, argv: list[str]) -> None:
    """``--trainer.NAME`` that is no option of the Trainer, as the parser reports it (:meth:`~flowkit.lightning_cli.
    FlowkitCLI._unknown_key_message`: the nearest of the command's options), from the options
    :mod:`flowkit.command_help` reads from Lightning's sources (``tests/test_command_help.py`` keeps the two equal).
    Not where the command line asks for help: the parser prints that first."""
    if any(arg.partition("=")[0] in HELP_FLAGS or arg.partition("=")[0].endswith(".help") for arg in argv):
        return
    known: set[str] | None = None
    for arg in argv[1:]:
        key = arg.partition("=")[0].removeprefix("--")
        if re.fullmatch(r"trainer\.\w+", key) and arg.startswith("--"):
            known = known if known is not None else option_names(command)
            if key not in known:
                raise ConfigError(f"unknown option --{key}{did_you_mean(key, known)}")


def _print_help(command: str) -> None:
    """``flowkit COMMAND --help`` without Lightning's parser, whose import alone takes seconds: a config command's
    options from their sources (:func:`~flowkit.command_help.print_command_help`), a standalone command's from its
    own module alone."""
    module = standalone_module(command)
    if module is not None:
        importlib.import_module(module)
    if command in STANDALONE:
        STANDALONE[command](["--help"])
    else:
        print_command_help(command)


def _run(args: list[str] | None, argv: list[str]) -> None:
    """Register flowkit's subcommands (the plugins' are already), then run the command ``argv``."""
    _load_builtin_subcommands()
    if argv and argv[0] in STANDALONE:  # e.g. `flowkit plot RUN_DIR`: no config, model or trainer
        STANDALONE[argv[0]](argv[1:])
        return
    try:
        from flowkit.lightning_cli import run

        run(args, _checkpoint_argument(argv))
    except Exception as err:
        message = _input_error(err, argv)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _check_config_files(argv: list[str]) -> None:
    """Each ``--config`` file must be YAML; the parser would say only ``in "<unicode string>", line 2`` (not the file,
    nor that a tab indents it). A delta (first line ``# A delta over configs/BASE.yaml``) comes after its base: alone,
    the parser would name a key the delta sets on a class it does not know yet."""
    import yaml

    given: list[str] = []
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
        delta = re.match(r"# A delta over (\S+\.yaml)", text)
        if delta and Path(delta[1]).name not in given:
            raise ConfigError(f"{path} is a delta over {delta[1]}: give that first, "
                              f"`--config {delta[1]} --config {path}` (docs/guides/configs.md)")
        given.append(path.name)


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
