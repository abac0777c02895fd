"""How a shipped config is run: a delta's first line names the config it is layered over (``# A delta over
configs/rlfr_qwen.yaml``), and the user passes both, the base first (docs/guides/configs.md)."""

import re
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def base_of(config: Path) -> Path | None:
    delta = re.match(r"# A delta over configs/(\S+\.yaml)", config.read_text())
    return CONFIGS / delta[1] if delta else None


def layers(config: Path) -> list[Path]:
    """The files ``config`` runs with, the bottom one first."""
    base = base_of(config)
    return [*layers(base), config] if base else [config]


def config_args(config: Path) -> list[str]:
    """``--config BASE --config DELTA`` (or ``--config CONFIG``): the command line that runs ``config`` as shipped."""
    return [arg for layer in layers(config) for arg in ("--config", str(layer))]
