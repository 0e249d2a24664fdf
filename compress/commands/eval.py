"""``layercut eval MODEL [--text SRC] [--ctx 512] [--max-tokens N] [--reference MODEL] [--json]``.

CI gates: ``--max-ppl-increase 5% --max-kl 0.1`` (need ``--reference``) exit with code 3
(:class:`~compress.errors.GateFailed`) when a gate fails; the JSON names the failed gates.
"""

from __future__ import annotations

import argparse

from calibrate import DEFAULT_EVAL_TEXT
from compress.errors import LayercutError
from compress.evaluate import evaluate_path
from compress.gates import check_gates, enforce_gates, parse_limit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="held-out perplexity, KL to a reference, size and speed")
    p.add_argument("model", help="HF model directory, .gguf file, or bundled:NAME")
    p.add_argument("--text", default=DEFAULT_EVAL_TEXT, help="text source (default: %(default)s)")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens taken from the text's start")
    p.add_argument("--reference", help="reference model for KL(reference || model)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-ppl-increase", metavar="PCT",
                   help="gate: fail (exit 3) if ppl / reference ppl - 1 exceeds this, e.g. 5%% or 0.05")
    p.add_argument("--max-kl", metavar="X", help="gate: fail (exit 3) if KL to the reference exceeds X")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code (off by default)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict:
    max_ppl = parse_limit(args.max_ppl_increase, "--max-ppl-increase")
    max_kl = parse_limit(args.max_kl, "--max-kl")
    gated = max_ppl is not None or max_kl is not None
    if gated and not args.reference:
        raise LayercutError("--max-ppl-increase/--max-kl compare to a reference model: pass --reference ORIG")
    result = evaluate_path(
        args.model,
        text=args.text,
        ctx=args.ctx,
        max_tokens=args.max_tokens,
        reference=args.reference,
        batch_size=args.batch_size,
        progress=not args.json,
        trust_remote_code=args.trust_remote_code,
    ).to_dict()
    if not gated:
        return result
    return enforce_gates(result, check_gates(result, max_ppl, max_kl))
