"""``layercut run RECIPE.yaml -o OUT [--resume] [--json]``: every stage of a recipe, resumable.

Examples::

    layercut run recipes/smollm2-demo.yaml -o runs/demo
    layercut run recipes/smollm2-demo.yaml -o runs/demo --resume    # after a crash or Ctrl-C

Exit codes: 0 done, 2 bad input (one ``error:`` line, nothing written), 3 an eval stage's
quality gate failed (everything written; ``report.json`` says which gate), 130 stopped by
Ctrl-C or SIGTERM (the unfinished stage's temp folder removed; ``--resume`` continues).
"""

from __future__ import annotations

import argparse

EXAMPLES = (
    "layercut run recipes/smollm2-demo.yaml -o runs/demo",
    "layercut run recipes/smollm2-demo.yaml -o runs/demo --resume    # after a crash or Ctrl-C",
)


def register(sub: argparse._SubParsersAction, **parser_kw) -> None:
    p = sub.add_parser("run", help="run a recipe (score, prune, heal, quantize, export, eval) stage by stage",
                       description="Run every stage of a recipe into a resumable run directory.", **parser_kw,
                       epilog="examples:\n  " + "\n  ".join(EXAMPLES))
    p.add_argument("recipe", help="recipe YAML (see recipes/ and docs/recipes.md)")
    p.add_argument("-o", "--output", required=True, help="run directory, one folder per stage (required)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in OUTPUT from its last finished stage (default: off)")
    p.add_argument("--json", action="store_true",
                   help="print the run report as one JSON line, no progress bars (default: off)")
