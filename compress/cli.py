"""The ``layercut`` command line: a thin layer over the public functions.

Usage::

    layercut eval bundled:smollm2-135m --json
    layercut --help

Every subcommand lives in ``compress/commands/<name>.py`` and calls one public function.
A :class:`~compress.errors.LayercutError` becomes one ``error: ...`` line on stderr and
a non-zero exit code; ``--json`` prints one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from compress.errors import LayercutError

# Subcommand modules, in the order `layercut --help` lists them.
COMMANDS = [
    "compress.commands.run",
    "compress.commands.score",
    "compress.commands.prune",
    "compress.commands.heal",
    "compress.commands.quantize",
    "compress.commands.eval",
    "compress.commands.export",
    "compress.commands.push",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layercut",
        description="Post-training compression for causal language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str))
    else:
        width = max((len(k) for k in result), default=0)
        for key, value in result.items():
            if isinstance(value, float):
                value = f"{value:.6g}"
            print(f"{key:<{width}}  {value}")


# Third-party loggers that print noise unrelated to the user's command (torchao, pulled in
# by gptqmodel, warns about CUDA-only .so files it cannot load on a CPU machine).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.handler(args)
    except LayercutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if getattr(exc, "payload", None) is not None and getattr(args, "json", False):
            print(json.dumps(exc.payload, default=str))
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    if result is not None:
        emit(result, getattr(args, "json", False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
