"""TRL-style reward functions: ``f(prompts, completions, **columns) -> list[float]``, summed with weights.

A reward function receives one entry per rollout (a prompt is repeated for each of its ``n`` samples):
``prompts`` (the policy's input texts), ``completions`` (the generated texts) and, as keyword columns,
``answer`` (the reference answers) and the data's other fields (e.g. ``solution``), as TRL passes every dataset
column. It returns one float per rollout, or ``None`` where it does not apply
(TRL's convention: such an entry adds nothing). A function written for TRL's ``GRPOTrainer`` with
``**kwargs`` in its signature works unchanged.

In a config, ``PolicyModule.reward_functions`` lists them with weights::

    reward_functions:
      - {function: flowkit.rewards.functions.boxed_format_reward, weight: 0.1}
      - {class_path: my_project.rewards.LengthPenalty, init_args: {max_chars: 200}, weight: 0.5}

The rollout's outcome reward is the math grader's reward (``outcome_reward``; ``none`` turns it off) plus
Σ_i weight_i · f_i.

``function`` and ``class_path`` are dotted paths (``my_project.rewards.short_answer``: installed, or a module under
the directory ``flowkit`` runs in, which the CLI puts on ``sys.path`` as ``python -m`` does) or a file and a name
(``path/to/rewards.py:short_answer``, relative to that directory).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from flowkit.data.grader import extract_boxed, grade, outcome_reward
from flowkit.errors import ConfigError

class RewardFunctionError(ConfigError):
    """A configured reward function returned something that is not one number per completion (one line)."""


RewardFunction = Callable[..., Sequence[float | None]]
SPEC_KEYS = {"function", "class_path", "init_args", "weight", "name"}


@dataclass(frozen=True)
class WeightedReward:
    """One reward function, its weight and the name its mean is logged under (``train/reward/<name>``)."""

    name: str
    function: RewardFunction
    weight: float = 1.0


def boxed_format_reward(completions: Sequence[str], **columns: Any) -> list[float]:
    """1 for a completion with a complete ``\\boxed{...}``, else 0 — a format reward, as TRL's recipes use."""
    return [float(extract_boxed(c) is not None) for c in completions]


def build_reward_functions(specs: Sequence[dict[str, Any]] | None) -> list[WeightedReward]:
    """``[{function: dotted.path | class_path: dotted.Class, init_args: {...}, weight: w, name: n}]`` → callables.

    ``function`` names a callable (a function, or any object with ``__call__``); ``class_path`` names a class that
    is instantiated with ``init_args`` (for reward functions with settings or state). ``weight`` defaults to 1,
    ``name`` to the function's or class's name.
    """
    built, names = [], set()
    for i, spec in enumerate(specs or []):
        where = f"PolicyModule.reward_functions[{i}]"
        if not isinstance(spec, dict) or ("function" in spec) == ("class_path" in spec):
            raise ConfigError(f"{where} must be a mapping with exactly one of 'function' or 'class_path', got {spec!r}")
        unknown = set(spec) - SPEC_KEYS
        if unknown:
            raise ConfigError(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(SPEC_KEYS)}")
        if "function" in spec:
            if "init_args" in spec:
                raise ConfigError(f"{where}: init_args need a class_path, not a function")
            function = _import(spec["function"], where)
            default_name = getattr(function, "__name__", str(spec["function"]).rpartition(".")[2])
        else:
            cls = _import(spec["class_path"], where)
            try:
                function = cls(**(spec.get("init_args") or {}))
            except TypeError as err:
                raise ConfigError(f"{where}: cannot build {spec['class_path']} ({err})") from None
            default_name = cls.__name__
        if not callable(function):
            raise ConfigError(f"{where}: {spec.get('function') or spec.get('class_path')} is not callable")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{where}.weight must be a finite number, got {weight!r}")
        name = str(spec.get("name") or default_name)
        if name in names:
            raise ConfigError(f"{where}: two reward functions are named {name!r}; give one a 'name'")
        names.add(name)
        built.append(WeightedReward(name, function, float(weight)))
    return built


def weighted_rewards(functions: Sequence[WeightedReward], prompts: Sequence[str], completions: Sequence[str],
                     **columns: Sequence[Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ_i weight_i · f_i(prompts, completions, **columns) per rollout, and each f_i's values (NaN where it
    returned ``None``) for logging. Returns float32 tensors of length ``len(completions)``."""
    rows = len(completions)
    total = torch.zeros(rows, dtype=torch.float32)
    values: dict[str, Tensor] = {}
    for reward in functions:
        row = _checked_values(reward.function(prompts=list(prompts), completions=list(completions), **columns),
                              rows, reward.name)
        values[reward.name] = row
        # None adds nothing; an inf stays, for the module's nonfinite check.
        total += reward.weight * torch.where(row.isnan(), 0.0, row)
    return total, values


def _checked_values(out: Any, rows: int, name: str) -> Tensor:
    """A reward function's return as float32 (NaN for ``None``): a list / tuple of numbers or ``None``, or a 1-D tensor
    or array of numbers, ``rows`` long. Anything else (a dict, whose keys ``list()`` would read as rewards; a string;
    a scalar; text values) is a :class:`RewardFunctionError` naming the function."""
    expected = f"a list or 1-D tensor of {rows} numbers (None where it does not apply), one per completion"
    if isinstance(out, Tensor) or type(out).__module__ == "numpy":
        shape = tuple(out.shape)
        numeric = not out.is_complex() if isinstance(out, Tensor) else out.dtype.kind in "biuf"
        if shape != (rows,) or not numeric:
            raise RewardFunctionError(f"reward function {name!r} must return {expected}; it returned a "
                                      f"{type(out).__name__} of shape {shape} and dtype {out.dtype}")
        return torch.as_tensor(out).detach().to("cpu", torch.float32)
    if not isinstance(out, (list, tuple)):
        raise RewardFunctionError(f"reward function {name!r} must return {expected}; it returned a "
                                  f"{type(out).__name__}")
    if len(out) != rows:
        raise RewardFunctionError(f"reward function {name!r} returned {len(out)} values for {rows} completions; "
                                  f"it must return {expected}")
    bad = next((v for v in out if v is not None and not _is_number(v)), None)
    if bad is not None:
        raise RewardFunctionError(f"reward function {name!r} must return {expected}; one value is "
                                  f"{type(bad).__name__} {repr(bad)[:40]}")
    return torch.tensor([math.nan if v is None else float(v) for v in out], dtype=torch.float32)


def _is_number(value: Any) -> bool:
    """A real number: Python's or NumPy's, or a 0-d tensor of one (``torch.tensor(1.0)`` in a list)."""
    if isinstance(value, Tensor):
        return value.ndim == 0 and not value.is_complex()
    return isinstance(value, numbers.Real)


def _import(dotted: Any, where: str) -> Any:
    """``package.module.name`` (importable: installed, or under the working directory, which the flowkit CLI puts on
    ``sys.path`` after flowkit's own dependencies) or ``path/to/file.py:name`` (a file, relative to the working
    directory)."""
    text = str(dotted)
    if ":" in text:
        return _import_from_file(text, where)
    module, _, attr = text.rpartition(".")
    try:
        loaded = sys.modules.get(module)
        if loaded is None:
            spec = importlib.util.find_spec(module)  # imports the parent packages
            if spec is None:
                raise ModuleNotFoundError(f"No module named {module!r}")
            loaded = _executed(module, spec, where, spec.origin or module)
        return getattr(loaded, attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{where}: cannot import {dotted!r} ({err}); a module of your project imports from the "
                          "directory flowkit runs in, or name a file: path/to/file.py:function") from None


def _import_from_file(spec: str, where: str) -> Any:
    """``path/to/file.py:name`` → that file's ``name``; the file is loaded once, as module ``flowkit_user.<stem>``."""
    file, _, attr = spec.rpartition(":")
    path = Path(file).expanduser().resolve()
    if not file.endswith(".py") or not attr or not path.is_file():
        raise ConfigError(f"{where}: {spec!r} is not path/to/file.py:name of an existing .py file")
    name = f"flowkit_user.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module = sys.modules.get(name)
    if module is None:
        try:
            module = _executed(name, importlib.util.spec_from_file_location(name, path), where, str(path))
        except Exception as err:
            raise ConfigError(f"{where}: {path} fails to load ({type(err).__name__}: {err})") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{where}: {path} has no {attr!r}")
    return getattr(module, attr)


def _executed(name: str, spec: Any, where: str, shown: str) -> Any:
    """The module ``spec`` run as ``name``. ``SystemExit`` or ``KeyboardInterrupt`` from its top level does not end
    flowkit: a one-line warning naming the file, and the module keeps what it defined before it."""
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: pickling and dataclasses look the module up by name
    try:
        spec.loader.exec_module(module)
    except (SystemExit, KeyboardInterrupt) as stop:
        print(f"warning: {where}: {shown} raised {type(stop).__name__}({stop}) when imported; flowkit goes on with "
              "what it defined before", file=sys.stderr)
    except BaseException:
        del sys.modules[name]
        raise
    return module


OutcomeReward = Literal["official", "binary", "none"]  # PolicyModule.outcome_reward


def outcome_rewards(responses: Sequence[str], answers: Sequence[str], prompts: Sequence[str], scheme: OutcomeReward,
                    functions: Sequence[WeightedReward], timeout_s: float,
                    columns: dict[str, list] | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The outcome reward r_o of each row: the math grader's reward (``scheme``: ``official`` 1 correct / 0.5 wrong but
    boxed / 0, ``binary``, or ``none``: 0) plus Σ weight_i · f_i over the reward functions, which also receive the
    data's ``columns`` (TRL passes every dataset column). Returns (r_o, the grader's verdict ``correct``, each
    function's values)."""
    pairs = list(zip(responses, answers))
    if scheme == "none":
        rewards = torch.zeros(len(pairs))
        correct = torch.tensor([grade(r, a, timeout_s) for r, a in pairs], dtype=torch.bool)
    else:
        rewards = torch.tensor([outcome_reward(r, a, scheme, timeout_s) for r, a in pairs], dtype=torch.float32)
        correct = rewards == 1.0  # both schemes give 1 exactly for a correct answer
    values: dict[str, Tensor] = {}
    if functions:
        total, values = weighted_rewards(functions, prompts, responses, answer=list(answers), **(columns or {}))
        rewards = rewards + total
    return rewards, correct, values
