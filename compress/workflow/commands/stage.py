"""``layercut score|prune|heal|quantize|export|eval``: one command per stage, generated.

Every option flag comes from the stage's config class (:mod:`layercut.compress.workflow.stages`) through
:func:`layercut.compress.workflow.stages.flags.add_config_args`; this module adds only what belongs to one
invocation (the input model, ``-o``, ``--json``, ``--overwrite``, ``--trust-remote-code``,
``--plot``, ``--dry-run``) and calls the stage's ``run(config, source, output, env)``.
"""

from __future__ import annotations

import argparse

from layercut.compress.workflow.stages import config_types, stage_module
from layercut.compress.workflow.stages.base import RunEnv

# stage -> (what -o is, whether it is required, whether the stage writes a checkpoint, --plot help)
_IO = {
    "score": ("write the scores and the drop plan as JSON to this file", False, False,
              "write a PNG of the per-layer scores"),
    "prune": ("output checkpoint directory (must not exist)", True, True,
              "write a PNG of the scores the layers were chosen by"),
    "heal": ("output checkpoint directory (must not exist)", True, True, None),
    "quantize": ("output checkpoint directory (must not exist)", True, True, None),
    "export": ("output checkpoint directory (must not exist)", True, True, None),
    "eval": ("also write the report as JSON to this file", False, False, None),
}
# stages with a plan to print: --dry-run
DRY_RUN = {"prune": "print the plan (which layers go, how they were chosen, parameters after) and write nothing; "
                    "data-driven selection still runs its scoring pass"}
_MODEL_HELP = {
    "export": "checkpoint directory, layercut run directory, .gguf file or bundled:NAME",
    "heal": "the compressed model: checkpoint directory, .gguf file or bundled:NAME",
}


def register(sub: argparse._SubParsersAction, name: str, **parser_kw) -> None:
    from layercut.compress.workflow.stages.flags import add_config_args

    cls = config_types()[name]
    out_help, required, writes, plot_help = _IO[name]
    p = sub.add_parser(name, help=cls.help, description=cls.help[0].upper() + cls.help[1:] + ".",
                       epilog="examples:\n  " + "\n  ".join(cls.examples), **parser_kw)
    p.add_argument("model", help=_MODEL_HELP.get(name, "checkpoint directory, .gguf file or bundled:NAME"))
    p.add_argument("-o", "--output", required=required and name not in DRY_RUN, default=None,
                   help=out_help + (" (required)" if required else " (default: none)"))
    add_config_args(p, cls)
    if plot_help:
        p.add_argument("--plot", metavar="FILE.png", help=plot_help + " (default: none)")
    if writes:
        p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (default: off)")
    if name in DRY_RUN:
        p.add_argument("--dry-run", action="store_true", help=DRY_RUN[name] + "; -o is optional (default: off)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own Python code to run (default: off)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line (default: off)")
    p.set_defaults(handler=lambda args: handle(name, args))


def handle(name: str, args: argparse.Namespace) -> dict:
    from layercut.compress.core.errors import LayercutError
    from layercut.compress.workflow.stages.flags import config_from_args

    config = config_from_args(config_types()[name], args)
    dry_run = getattr(args, "dry_run", False)
    if name in DRY_RUN and args.output is None and not dry_run:
        raise LayercutError("the following arguments are required: -o/--output")
    env = RunEnv(progress=not args.json and not getattr(args, "quiet", False),
                 trust_remote_code=args.trust_remote_code, overwrite=getattr(args, "overwrite", False),
                 dry_run=dry_run)
    extra = {"plot": args.plot} if getattr(args, "plot", None) else {}
    report = stage_module(name).run(config, args.model, args.output, env, **extra)
    return present_eval(report) if name == "eval" else report


def present_eval(report: dict) -> dict:
    """eval's report as the CLI prints it: the model's figures at the top level; exit 3 on a failed gate."""
    from layercut.compress.core.errors import GateFailed
    from layercut.compress.eval.gates import Gate

    flat = {**report["model"]}
    if report.get("baseline") is not None:
        flat["baseline"] = report["baseline"]
    if report.get("tasks") is not None:
        flat.update(tasks=report["tasks"], lm_eval_version=report["lm_eval_version"])
    if report["gates"]:
        flat.update(gates=report["gates"], gates_passed=report["gates_passed"], failed_gates=report["failed_gates"])
    failed = [Gate(**g) for g in report["gates"] if not g["passed"]]
    if failed:
        exc = GateFailed("quality gate failed: " + "; ".join(g.describe() for g in failed))
        exc.payload = flat
        raise exc
    return flat
