"""flowkit's own subcommands, a module each; :func:`load_all` imports them, which registers them in
:mod:`flowkit.registry` (``flowkit COMMAND --help`` imports only the command's own module)."""

import importlib
import pkgutil


def load_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
