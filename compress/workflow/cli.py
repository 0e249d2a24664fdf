"""The ``layercut`` command line: a thin layer over the stages' ``run`` functions.

Usage::

    layercut eval bundled:smollm2-135m --json
    layercut --help            # every command; `layercut quantize --help` for one
    layercut -v run recipes/smollm2-demo.yaml -o runs/demo

The stage commands are generated from the stage configs (``compress/workflow/commands/stage.py``);
``run``, ``plan`` and ``push`` are in ``compress/workflow/commands/``; what every command does is
in ``compress/workflow/commands/handlers.py``. A :class:`~layercut.compress.core.errors.LayercutError`
or a bad flag becomes one ``error: ...`` line on stderr and a non-zero exit code (2 for
bad input); ``--json`` prints one JSON object as the last line of stdout. Torch is
imported only when a command runs (the handlers load then), so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys

from layercut.compress.core.errors import LayercutError, closest
from layercut.compress.workflow.commands import plan, push, run, stage

# in the order `layercut --help` lists them
COMMANDS = ("run", "plan", "score", "prune", "heal", "quantize", "eval", "export", "push")
STAGE_COMMANDS = ("score", "prune", "heal", "quantize", "eval", "export")
# Third-party loggers that print noise unrelated to the user's command (torchao, pulled in
# by gptqmodel, warns about CUDA-only .so files it cannot load on a CPU machine).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one ``error:`` line (exit 2), with a suggestion."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if bad:
            choices = re.findall(r"'([^']*)'", bad.group(2)) or [c.strip() for c in bad.group(2).split(",")]
            near = closest(bad.group(1), choices)
            message += f", did you mean '{near}'?" if near else ""
        print(f"error: {self.prog.removeprefix('layercut ')}: {message}" if self.prog != "layercut"
              else f"error: {message}", file=sys.stderr)
        sys.exit(2)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("layercut")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> Parser:
    parser = Parser(prog="layercut", description="Post-training compression for causal language models.",
                    epilog="examples:\n  layercut run recipes/smollm2-demo.yaml -o runs/demo\n"
                           "  layercut quantize bundled:smollm2-135m -o q4 --bits 4\n\n"
                           "`layercut COMMAND --help` lists a command's options with their defaults.",
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"layercut {version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more: -v info, -vv debug (default: warnings only)")
    parser.add_argument("-q", "--quiet", action="store_true", help="errors only, no progress bars (default: off)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    kw = dict(formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in COMMANDS:
        if name in STAGE_COMMANDS:
            stage.register(sub, name, **kw)
        else:
            {"run": run, "plan": plan, "push": push}[name].register(sub, **kw)
    return parser


def parse(parser: Parser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; an unknown flag is one error line naming the closest flag of that command."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        flag = next((x for x in extra if x.startswith("-")), None)
        if flag is None:
            sub.error(f"unexpected argument '{extra[0]}'")
        options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        near = closest(flag.split("=")[0], options)
        sub.error(f"unknown option {flag}" + (f", did you mean {near}?" if near else ""))
    return args


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str))
    else:
        width = max((len(k) for k in result), default=0)
        for key, value in result.items():
            if isinstance(value, float):
                value = f"{value:.6g}"
            print(f"{key:<{width}}  {value}")


def _logging(verbose: int, quiet: bool) -> tuple[logging.Handler, int]:
    """The application (not the library) owns the root handler: warnings, or more with -v.

    Returns the handler and the root level to restore (``main`` undoes both: tests call it in-process).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s"))
    handler.setLevel(logging.ERROR if quiet else logging.DEBUG if verbose > 1 else
                     logging.INFO if verbose else logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    if verbose:
        root.setLevel(min(root.level or logging.WARNING, handler.level))
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if quiet:  # transformers' and the Hub's own progress bars too
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return handler, level


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    try:
        args = parse(parser, argv)
    except SystemExit as exc:  # --help, --version (0) or a bad command line (2)
        return int(exc.code or 0)
    handler, level = _logging(args.verbose, args.quiet)
    try:
        # what the command does, and torch with it, loads only now: never for --help
        from layercut.compress.workflow.commands.handlers import handle

        result = handle(args)
    except LayercutError as exc:
        if not getattr(exc, "quiet", False):  # quiet: a torchrun rank other than 0 (rank 0 prints it)
            print(f"error: {exc}", file=sys.stderr)
        if getattr(exc, "payload", None) is not None and getattr(args, "json", False):
            print(json.dumps(exc.payload, default=str))
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger().setLevel(level)
    if result is not None and not _secondary_rank():
        emit(result, getattr(args, "json", False))
    return 0


def _secondary_rank() -> bool:
    """Under torchrun, ranks other than 0 print no report: rank 0 prints it once."""
    if os.environ.get("WORLD_SIZE", "1") in ("", "0", "1"):
        return False  # outside torchrun (torch stays unimported here)
    from layercut.compress.core.distributed import is_secondary

    return is_secondary()


if __name__ == "__main__":
    sys.exit(main())
