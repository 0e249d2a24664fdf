"""``layercut plan MODEL --target-size SIZE -o OUT [--min-speedup X] [--budget-minutes N] [--json]``.

Examples::

    layercut plan bundled:smollm2-135m --target-size 40% -o plans/p40
    layercut plan ./model --target-size 1.2GB --min-speedup 1.25 -o plans/fast

Searches depth cuts × bits for the lowest KL at the size (:mod:`layercut.compress.workflow.planner.search`);
OUT holds the winner (``model/``, carded), ``plan.json``, ``recipe.yaml``, ``plan.png``.
Bad input is one ``error:`` line, exit 2, nothing written.
"""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from layercut.compress.core.errors import LayercutError, format_error
from layercut.compress.workflow.planner.config import SIZE_HELP, PlanConfig

EXAMPLES = (
    "layercut plan bundled:smollm2-135m --target-size 40% -o plans/p40",
    "layercut plan ./model --target-size 1.2GB --min-speedup 1.25 -o plans/fast",
)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2,3,4,8, got {text!r}") from None


def register(sub: argparse._SubParsersAction, **parser_kw) -> None:
    p = sub.add_parser("plan", help="find the best depth cut x bits for a size target, verify it, write it",
                       description="Search depth cuts x (bits, group size) and --avg-bits budgets for the lowest "
                                   "KL at a size target; verify the best predicted for real; write the winner.",
                       epilog="examples:\n  " + "\n  ".join(EXAMPLES), **parser_kw)
    p.add_argument("model", help="checkpoint directory, .gguf file or bundled:NAME")
    p.add_argument("--target-size", required=True, metavar="SIZE", help=SIZE_HELP.replace("%", "%%") + " (required)")
    p.add_argument("-o", "--output", required=True, help="output directory (must not exist) (required)")
    p.add_argument("--min-speedup", type=_float, metavar="X",
                   help="keep at most depth / X blocks, a decode-speed proxy (default: none)")
    p.add_argument("--budget-minutes", type=_float, metavar="N", help="bound the search time (default: none)")
    p.add_argument("--top-k", type=int, metavar="K", help="candidates verified for real (default: 3)")
    p.add_argument("--bits", type=_ints, metavar="LIST", help="uniform bit widths searched (default: 2,3,4,8)")
    p.add_argument("--group-sizes", type=_ints, metavar="LIST",
                   help="group sizes searched, -1 per row (default: 128,64,-1; those not dividing every input "
                        "size are skipped)")
    p.add_argument("--max-drop", metavar="N", help="most blocks a cut may remove, count or percentage "
                                                   "(default: 50%%)")
    p.add_argument("--no-mixed", dest="mixed", action="store_false", default=None,
                   help="search uniform bits only, no --avg-bits allocations (default: mixed searched)")
    p.add_argument("--calib", help="calibration text (default: bundled:brown-calib)")
    p.add_argument("--samples", type=int, metavar="N", help="quantize calibration sequences (default: 64)")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per calibration sequence (default: 128)")
    p.add_argument("--seed", type=int, help="calibration seed (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (default: off)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line (default: off)")


def config_from_args(args: argparse.Namespace) -> PlanConfig:
    values = {"size": args.target_size}
    for key in ("min_speedup", "budget_minutes", "top_k", "bits", "group_sizes", "mixed", "calib", "samples",
                "seq_len", "seed"):
        if getattr(args, key, None) is not None:
            values[key] = getattr(args, key)
    if args.max_drop is not None:
        values["max_drop"] = int(args.max_drop) if args.max_drop.strip().isdigit() else args.max_drop
    try:
        return PlanConfig(**values)
    except ValidationError as exc:
        msg = format_error(exc, flags=PlanConfig.option_names())
        raise LayercutError(msg.replace("--size", "--target-size")) from None
