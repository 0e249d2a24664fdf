"""CLI subcommands. Each module defines ``register(subparsers)``; its handler returns a
JSON-able dict (printed as the last stdout line with ``--json``). Handlers are thin:
parse -> validate -> one public function a user could call from Python."""
