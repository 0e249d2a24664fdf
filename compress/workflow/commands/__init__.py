"""CLI subcommands. ``stage`` generates one command per stage from its config class; ``run``
and ``push`` are written by hand. Each ``register(subparsers)`` sets a handler returning a
JSON-able dict (printed as the last stdout line with ``--json``)."""
