"""``layercut push OUT --repo-id ORG/NAME [--private] [--revision R] [--dry-run] [--json]``.

Examples::

    layercut push runs/demo --repo-id my-org/smollm2-demo --dry-run   # prints every file that would go up
    HF_TOKEN=... layercut push runs/demo --repo-id my-org/smollm2-demo --private

OUT is an exported checkpoint or a layercut run directory (its final model is pushed).
The token is read by huggingface_hub from the standard places and never printed.
"""

from __future__ import annotations

import argparse

EXAMPLES = (
    "layercut push runs/demo --repo-id my-org/smollm2-demo --dry-run",
    "HF_TOKEN=... layercut push release --repo-id my-org/smollm2-demo --private",
)


def register(sub: argparse._SubParsersAction, **parser_kw) -> None:
    p = sub.add_parser("push", help="upload an exported checkpoint to the Hugging Face Hub",
                       description="Upload an exported checkpoint to the Hugging Face Hub.", **parser_kw,
                       epilog="examples:\n  " + "\n  ".join(EXAMPLES))
    p.add_argument("folder", help="exported checkpoint directory, or a layercut run directory")
    p.add_argument("--repo-id", required=True, help="ORG/NAME on the Hub (required)")
    p.add_argument("--private", action="store_true", help="create the repo private (default: off)")
    p.add_argument("--revision", help="branch to push to, created if missing (default: main)")
    p.add_argument("--commit-message", default="Upload compressed model (layercut)",
                   help="commit message (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="list exactly what would be uploaded; upload nothing (default: off)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line (default: off)")
