"""Option groups: the dataclasses a config's nested keys fill (``model.init_args.sampling.temperature``).

Each option is declared once, as a field of its group: its name, its type (a ``Literal`` lists the allowed values), its
default, its help (the string literal under the field, which ``flowkit fit --model.help`` and the option reference's
tables print) and its range (:func:`bounded`) or registry (:func:`registered`). :meth:`OptionGroup.check` checks every
field against them, then the group's own rules between fields (:meth:`OptionGroup.check_rules`). Every number an option
holds must also survive the dtype it is used in (:func:`check_representable`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, Literal, TypeVar

from flowkit.errors import ConfigError, check_range, did_you_mean

Entry = TypeVar("Entry")

FLOAT_LIMIT = 1e15
"""The largest magnitude of a float option: options become float32 tensors (at most 3.4e38), and a value, its square
and their sums over a batch must stay finite there (``overlong_penalty 1e300`` is −inf in float32)."""
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32: a nonzero option below it in magnitude would be 0 (or lose its precision) there."""
INT_LIMIT = 2**31 - 1
"""The largest magnitude of an int option: counts and sizes reach int32 arguments (vLLM's, CUDA kernels')."""


def bounded(default: Any, low: float | None = None, high: float | None = None, *, open_low: bool = False,
            open_high: bool = False) -> Any:
    """A field with ``default`` whose value must lie in ``[low, high]`` (open on an ``open_`` side; None: unbounded;
    a None value is "off" and passes): :func:`~flowkit.errors.check_range`."""
    return field(default=default, metadata={"range": (low, high, open_low, open_high)})


def check_representable(key: str, value: Any) -> None:
    """A one-line ConfigError for a number ``value`` of option ``key`` that its dtype cannot hold: a float beyond
    :data:`FLOAT_LIMIT` or nonzero below :data:`FLOAT32_TINY` in magnitude, an int beyond :data:`INT_LIMIT`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
        return
    if isinstance(value, int) and abs(value) > INT_LIMIT:
        raise ConfigError(f"{key} {value} overflows int32, where it is used: at most {INT_LIMIT} in magnitude")
    if isinstance(value, float) and math.isfinite(value) and abs(value) > FLOAT_LIMIT:
        raise ConfigError(f"{key} {value!r} overflows float32, where it is used (its square and a batch's sum must "
                          f"stay finite): at most {FLOAT_LIMIT:g} in magnitude")
    if isinstance(value, float) and abs(value) < FLOAT32_TINY:
        raise ConfigError(f"{key} {value!r} is subnormal or 0 in float32, where it is used: 0 or at least "
                          f"{FLOAT32_TINY:.2g} in magnitude")


def registered(default: str, registry: dict[str, Any]) -> Any:
    """A field (typed ``str``) naming an entry of ``registry`` (a loss, an estimator, an engine): its allowed values
    are the registry's names when the option is checked, so an entry a user registers counts; ``module.name`` names
    the entry ``name`` that importing ``module`` registers (:func:`registry_entry`)."""
    return field(default=default, metadata={"registry": registry})


def registry_entry(registry: dict[str, Entry], name: str) -> Entry:
    """``registry[name]``; for ``module.entry`` not registered under that name, the entry ``entry`` after importing
    ``module`` (a file of the user's project: the flowkit CLI puts the working directory on ``sys.path``), whose
    decorators register it. KeyError or ImportError when there is none."""
    if name not in registry and "." in name:
        module, _, name = name.rpartition(".")
        importlib.import_module(module)
    return registry[name]


def literal_values(annotation: Any) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` (or ``Literal[...] | None``) annotation allows, None included; () for others."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        arms = typing.get_args(annotation)
        if any(typing.get_origin(arm) is Literal for arm in arms):
            return tuple(value for arm in arms for value in (literal_values(arm) or (None,)))
    return ()


@dataclass(frozen=True)
class OptionGroup:
    """Base of the option groups (frozen dataclasses; a dataclass itself, so that jsonargparse takes a group as nested
    keys, not as a ``class_path``): :meth:`check` validates a group built in Python or by the CLI."""

    def check(self, owner: str) -> None:
        """One-line :class:`~flowkit.errors.ConfigError` naming ``owner.field`` for a value outside its Literal or its
        range; then the nested groups (``owner.field.…``) and :meth:`check_rules`."""
        hints = typing.get_type_hints(type(self))
        for option in fields(self):  # type: ignore[arg-type]
            if not option.init:
                continue
            value = getattr(self, option.name)
            if "registry" in option.metadata and not (value is None and option.default is None):  # null: off
                self._check_registered(f"{owner}.{option.name}", value, option.metadata["registry"])
            allowed = literal_values(hints[option.name])
            if allowed and value not in allowed:
                shown = ", ".join("null" if v is None else str(v) for v in allowed)
                raise ConfigError(f"{owner}.{option.name} must be one of {shown}, got {value!r}")
            if "range" in option.metadata:
                low, high, open_low, open_high = option.metadata["range"]
                check_range(owner, option.name, value, low, high, open_low=open_low, open_high=open_high)
            check_representable(f"{owner}.{option.name}", value)
            if isinstance(value, OptionGroup):
                value.check(f"{owner}.{option.name}")
        self.check_rules(owner)

    def check_rules(self, owner: str) -> None:
        """The group's rules between its fields (none by default)."""

    @staticmethod
    def _check_registered(key: str, value: str, registry: dict[str, Any]) -> None:
        """A one-line ConfigError unless ``value`` names an entry of ``registry`` (:func:`registry_entry`)."""
        module, _, name = value.rpartition(".")
        try:
            registry_entry(registry, value)
        except ImportError as err:
            raise ConfigError(f"{key} {value!r}: cannot import {module!r} ({type(err).__name__}: {err})") from None
        except KeyError:
            why = f": importing {module!r} registered no {name!r}" if module else did_you_mean(value, registry)
            raise ConfigError(f"{key} must be one of {', '.join(registry)}, got {value!r}{why}") from None


def moved_options(groups: dict[str, type]) -> dict[str, str]:
    """Each option of an owner's old flat form (``temperature``) → its key in ``groups`` now
    (``sampling.temperature``): the first group's field of that name. An owner with option groups keeps this as its
    ``MOVED_OPTIONS``, from which the CLI names the new key of an old one in a one-line error."""
    moved: dict[str, str] = {}
    for key, group in groups.items():
        for name, declared in group.__dataclass_fields__.items():
            if declared.init:
                moved.setdefault(name, f"{key}.{name}")
    return moved


def option_help(group: type) -> dict[str, str]:
    """Each field's help: the string literal right under its declaration in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(group)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    helps = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            helps[statement.target.id] = " ".join(following.value.value.split())
    return helps


def markdown(text: str) -> str:
    """A docstring's reST (````x````, ``:func:`~a.b```) as Markdown code spans."""
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")


def _default_text(option: Field) -> str:
    if option.default is not MISSING:
        value = option.default
    elif option.default_factory is not MISSING:
        value = option.default_factory()
    else:
        return "required"
    if is_dataclass(value):  # a nested group: its fields' defaults
        return "{" + ", ".join(f"{f.name}: {_value_text(getattr(value, f.name))}" for f in fields(value)) + "}"
    return _value_text(value)


def _value_text(value: Any) -> str:
    if isinstance(value, tuple):  # as YAML writes it
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _range_text(option: Field) -> str:
    if "range" not in option.metadata:
        return ""
    low, high, open_low, open_high = option.metadata["range"]
    if high is None:
        return f"{'>' if open_low else '≥'} {low}"
    if low is None:
        return f"{'<' if open_high else '≤'} {high}"
    return f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"


def options_table(group: type, prefix: str) -> str:
    """A Markdown table of ``group``'s options (key ``prefix.name``, default, allowed values or range, help), made
    from their declarations, a nested group's below its own row: docs/reference/options.md's tables are this text."""
    return "\n".join(["| key | default | allowed | meaning |", "|---|---|---|---|", *_option_rows(group, prefix)])


def _option_rows(group: type, prefix: str) -> list[str]:
    hints, helps = typing.get_type_hints(group), option_help(group)
    rows = []
    for option in fields(group):
        if not option.init:
            continue
        values = tuple(option.metadata.get("registry", ())) or literal_values(hints[option.name])
        allowed = ", ".join("null" if v is None else f"`{v}`" for v in values)
        meaning = markdown(helps.get(option.name, "")).replace("|", "\\|")
        rows.append(f"| `{prefix}.{option.name}` | `{_default_text(option)}` | {allowed or _range_text(option)} "
                    f"| {meaning} |")
        nested = hints[option.name]
        if isinstance(nested, type) and issubclass(nested, OptionGroup):
            rows.extend(_option_rows(nested, f"{prefix}.{option.name}"))
    return rows
