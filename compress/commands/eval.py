"""``layercut eval MODEL [--text SRC] [--ctx 512] [--max-tokens N] [--reference MODEL] [--json]``."""

from __future__ import annotations

import argparse

from compress.evaluate import evaluate_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="held-out perplexity, KL to a reference, size and speed")
    p.add_argument("model", help="HF model directory, .gguf file, or bundled:NAME")
    p.add_argument("--text", default="bundled:brown-heldout", help="text source (default: %(default)s)")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens taken from the text's start")
    p.add_argument("--reference", help="reference model for KL(reference || model)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code (off by default)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict:
    result = evaluate_path(
        args.model,
        text=args.text,
        ctx=args.ctx,
        max_tokens=args.max_tokens,
        reference=args.reference,
        batch_size=args.batch_size,
        progress=not args.json,
        trust_remote_code=args.trust_remote_code,
    )
    return result.to_dict()
