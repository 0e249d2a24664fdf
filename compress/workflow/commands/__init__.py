"""CLI subcommands. ``stage`` generates one command per stage from its config class; ``run``,
``plan`` and ``push`` are written by hand. Each module's ``register(subparsers)`` defines a
command's parser and stays torch-free (``layercut --help`` builds them all); what a command does
is in :mod:`.handlers`, which the CLI imports only when a command runs. A handler returns a
JSON-able dict (printed as the last stdout line with ``--json``)."""
