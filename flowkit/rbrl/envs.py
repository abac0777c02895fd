"""Registry of the language-wrapped environments, by the name used in configs."""

from __future__ import annotations

from collections.abc import Callable

from flowkit.errors import ConfigError
from flowkit.rbrl.binpacking import BinPackingLanguage
from flowkit.rbrl.boehmer import BoehmerLanguage
from flowkit.rbrl.heatalerts import HeatAlertsLanguage
from flowkit.rbrl.language import LanguageEnv
from flowkit.rbrl.wearables import WearablesLanguage

WEARABLES_SIMULATORS: dict[str, Callable[..., LanguageEnv]] = {"random_walk": WearablesLanguage, "boehmer": BoehmerLanguage}


def make_wearables(simulator: str = "random_walk", **kwargs) -> LanguageEnv:
    """``simulator: random_walk`` (default): flowkit's hand-written simulator (:mod:`flowkit.rbrl.wearables`);
    ``simulator: boehmer``: Boehmer et al.'s dynamics from a parameter file the user supplies
    (``parameters: /path/to/official.npz``; :mod:`flowkit.rbrl.boehmer`). The other kwargs go to the simulator."""
    if simulator not in WEARABLES_SIMULATORS:
        raise ConfigError(f"wearables env_kwargs.simulator must be one of {sorted(WEARABLES_SIMULATORS)}, got {simulator!r}")
    return WEARABLES_SIMULATORS[simulator](**kwargs)


ENVIRONMENTS: dict[str, Callable[..., LanguageEnv]] = {
    "binpacking": BinPackingLanguage, "wearables": make_wearables, "heatalerts": HeatAlertsLanguage,
}


def make_env(name: str, **kwargs) -> LanguageEnv:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose from {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)
