"""Registry of the language-wrapped environments, by the name used in configs."""

from __future__ import annotations

from flowkit.rbrl.binpacking import BinPackingLanguage
from flowkit.rbrl.language import LanguageEnv
from flowkit.rbrl.wearables import WearablesLanguage

ENVIRONMENTS: dict[str, type[LanguageEnv]] = {"binpacking": BinPackingLanguage, "wearables": WearablesLanguage}


def make_env(name: str, **kwargs) -> LanguageEnv:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose from {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)
