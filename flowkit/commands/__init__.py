"""flowkit's own subcommands; importing this package registers them in :mod:`flowkit.registry`."""
from flowkit.commands import score  # noqa: F401
from flowkit.commands import explain_rules  # noqa: F401
from flowkit.commands import export  # noqa: F401
from flowkit.commands import convert_flow  # noqa: F401
from flowkit.commands import plot  # noqa: F401
from flowkit.commands import rollout_server  # noqa: F401
