"""flowkit's own subcommands; importing this package registers them with :mod:`flowkit.cli`."""
from flowkit.commands import score  # noqa: F401
from flowkit.commands import explain_rules  # noqa: F401
from flowkit.commands import export  # noqa: F401
