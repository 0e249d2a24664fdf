"""``layercut score|prune|heal|quantize|export|eval``: one command per stage, generated.

Every option flag comes from the stage's config class (:mod:`layercut.compress.workflow.stages`) through
:func:`layercut.compress.workflow.stages.flags.add_config_args`; this module adds only what belongs to one
invocation (the input model, ``-o``, ``--json``, ``--overwrite``, ``--trust-remote-code``,
``--plot``, ``--dry-run``); :func:`layercut.compress.workflow.commands.handlers.stage_command` calls
the stage's ``run(config, source, output, env)``.
"""

from __future__ import annotations

import argparse

from layercut.compress.workflow.stages import config_types
from layercut.compress.workflow.stages.flags import add_config_args

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
                    "data-driven selection still runs its scoring pass",
           "quantize": "print the plan (group size, bits and group size per linear, head, solver) and write nothing"}
_MODEL_HELP = {
    "export": "checkpoint directory, layercut run directory, .gguf file or bundled:NAME",
    "heal": "the compressed model: checkpoint directory, .gguf file or bundled:NAME",
}


def register(sub: argparse._SubParsersAction, name: str, **parser_kw) -> None:
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
