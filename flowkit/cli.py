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

import importlib
import importlib.metadata
import inspect
import os
import re
import sys
from pathlib import Path

from flowkit.command_help import (
    HELP_FLAGS, LIGHTNING_COMMANDS, builtin_commands, builtin_function, config_commands, option_names,
    print_command_help, print_overview, standalone_module,
)
from flowkit.errors import ConfigError, RunError, did_you_mean
from flowkit.parser_errors import parser_error_line
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


def builtin_command_names() -> set[str]:
    """The names no plugin may take: Lightning's commands, flowkit's own and a launcher's (registered before
    :func:`main`)."""
    return {*LIGHTNING_COMMANDS, *builtin_commands(), *SUBCOMMANDS, *STANDALONE}


def plugin_entry_points() -> tuple[list[importlib.metadata.EntryPoint], dict[str, str]]:
    """The plugins installed packages declare in the entry-point group ``flowkit.subcommands`` (read from their
    metadata; nothing is imported), and a one-line warning for each whose name is a command of flowkit itself."""
    taken = builtin_command_names()
    entries, refused = [], {}
    for entry in sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        if entry.name in taken:
            refused[entry.name] = _plugin_warning(entry, f"'{entry.name}' is a command of flowkit itself; choose "
                                                         "another name")
        else:
            entries.append(entry)
    return entries, refused


def load_plugins() -> dict[str, str]:
    """Load the subcommands installed packages declare in the entry-point group ``flowkit.subcommands``.

    An entry point names a module (``count-params = my_project.commands``: importing it runs its
    :func:`subcommand` / :func:`~flowkit.registry.standalone` decorators) or a function (``count-params =
    my_project.commands:count_params``: registered as ``flowkit count-params`` unless a decorator already registered
    it). A plugin that fails to load, or ends its import with ``SystemExit`` / ``KeyboardInterrupt``, is left out
    with a one-line warning naming it (printed to stderr); flowkit itself still runs. A plugin's decorator cannot
    replace a command of flowkit's (or a launcher's): that registration alone is undone, with a warning. Returns the
    warnings, ``{entry-point name: warning}``.
    """
    entries, failed = plugin_entry_points()
    taken = builtin_command_names()
    for entry in entries:
        before = (dict(SUBCOMMANDS), dict(STANDALONE))
        try:
            loaded = entry.load()
            already = any(loaded is fn for fn in (*SUBCOMMANDS.values(), *STANDALONE.values()))
            if callable(loaded) and not inspect.ismodule(loaded) and not already:
                subcommand(entry.name)(loaded)
        # whatever a plugin raises, flowkit runs without it; it cannot end flowkit either
        except (Exception, SystemExit, KeyboardInterrupt) as err:  # noqa: BLE001
            failed[entry.name] = _plugin_warning(entry, " ".join(f"{type(err).__name__}: {err}".split()).rstrip(":"))
        for name in _keep_builtin_commands(before, taken):
            print(f"warning: flowkit plugin {entry.name!r} ({entry.value}) registers {name!r}, a command of flowkit "
                  f"itself; flowkit's own {name!r} runs", file=sys.stderr)
    return failed


def _plugin_warning(entry: importlib.metadata.EntryPoint, reason: str) -> str:
    warning = f"warning: flowkit plugin {entry.name!r} ({entry.value}) failed to load and is left out: {reason}"
    print(warning, file=sys.stderr)
    return warning


def _keep_builtin_commands(before: tuple[dict, dict], taken: set[str]) -> list[str]:
    """Undo what a plugin registered under a name in ``taken``, against the registries ``before`` it loaded (a
    built-in whose module the plugin imported is registered from that module again); the names it tried."""
    replaced = []
    for kind, registry, previous in (("subcommand", SUBCOMMANDS, before[0]), ("standalone", STANDALONE, before[1])):
        for name in [name for name in registry if name in taken and registry[name] is not previous.get(name)]:
            original = previous.get(name) or builtin_function(name, kind)
            if original is None:
                del registry[name]
            else:
                registry[name] = original
            replaced.append(name)
    return replaced


def _put_working_directory_on_path() -> None:
    """Class paths and reward functions of the user's project import from the working directory, after flowkit's own
    dependencies (a ``yaml.py`` there does not replace PyYAML): a console script's ``sys.path`` does not hold the
    working directory, and ``python -m flowkit`` puts it first."""
    cwd = os.getcwd()
    sys.path[:] = [*(path for path in sys.path if path not in ("", cwd)), cwd]


def main(args: list[str] | None = None) -> None:
    """Run the CLI; bad input (see :func:`_input_error`) prints ``error: <one line>`` and exits with code 2.

    Plugins load only for a command that is not flowkit's own (``flowkit --help`` lists them by name unloaded).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _put_working_directory_on_path()
    argv = sys.argv[1:] if args is None else list(args)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    failed_plugins = load_plugins() if command is not None and command not in builtin_command_names() else {}
    if len(argv) == 1 and argv[0] in HELP_FLAGS:
        entries, _ = plugin_entry_points()
        print_overview({entry.name: f"a plugin ({entry.value}); `flowkit {entry.name} --help` loads it"
                        for entry in entries})
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
    """Register flowkit's subcommands (the plugins' are already; a standalone command's own module alone), then run
    the command ``argv``."""
    module = standalone_module(argv[0]) if argv else None
    if module is not None:
        importlib.import_module(module)
    else:
        _load_builtin_subcommands()
    if argv and argv[0] in STANDALONE:  # e.g. `flowkit plot RUN_DIR`: no config, model or trainer
        try:
            STANDALONE[argv[0]](argv[1:])
        except ConfigError as err:  # its arguments, checked before it starts work
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
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
        return parser_error_line(str(chain[0]), argv)
    return None
