"""jsonargparse's reports as one line each: the console's translation of parser errors, without Lightning.

:func:`parser_error_line` turns a nested report (one block per Union alternative) into ``key.path: message``, naming
the ``--config`` file that set the key (:func:`config_file_with_key`) and, for an option of the old flat form that a
class's ``MOVED_OPTIONS`` maps into an option group, the key it moved to. :mod:`flowkit.cli` and
:mod:`flowkit.lightning_cli` both use it; it imports neither (nor Lightning), so neither imports the other back.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import typing
from pathlib import Path

from flowkit.errors import did_you_mean

PARSER_REPORT_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
                        "Given value type:", "Given value:", "- Expected a <class 'NoneType'>")


def parser_error_line(report: str, argv: list[str]) -> str:
    """jsonargparse's nested report (one block per Union alternative) → ``key.path: innermost message``.

    The innermost message is the most indented line that is not part of the report's scaffolding; the key
    path is the chain of ``Parser key`` lines above it (``init_args`` where it descends into a class). A class that
    does not import is reported under ``class_path``, and an option the class does not take with the nearest one.
    """
    path: list[tuple[int, str, str | None]] = []  # (indent, key, class path) of the enclosing key / class lines
    best: tuple[int, str, list[tuple[str, str | None]]] | None = None
    for line in report.splitlines():
        text, indent = line.strip(), len(line) - len(line.lstrip())
        if not text or text.startswith(PARSER_REPORT_NOISE):
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
