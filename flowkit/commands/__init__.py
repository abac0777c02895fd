"""flowkit's own subcommands; importing this package registers them with :mod:`flowkit.cli`."""
