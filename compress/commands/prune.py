"""``layercut prune MODEL -o OUT --drop N [--select METHOD | --layers LIST] [--what block|attention|mlp]
[--replace none|lstsq|cosine] [--fuse [--fuse-calibrate]] [--calib SRC] [--samples 64] [--seq-len 512] [--json]``.
"""

from __future__ import annotations

import argparse

from compress.depth.prune import REPLACES, WHATS, prune


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prune", help="remove blocks or sublayers (drop, linear replace, fuse) and save a checkpoint")
    p.add_argument("model", help="HF model directory, .gguf file, or bundled:NAME")
    p.add_argument("-o", "--output", required=True, help="output checkpoint directory (must not exist)")
    p.add_argument("--drop", type=int, help="how many blocks / sublayers to remove")
    p.add_argument("--select", metavar="METHOD",
                   help="block: angular | angular-all | block-influence; attention: attn-cosine | gate-norm; "
                        "mlp: mlp-cosine")
    p.add_argument("--layers", metavar="LIST", help="explicit layer indices, e.g. 3,4,5 or 12-17,25,26")
    p.add_argument("--what", default="block", help=f"what to remove: {' | '.join(WHATS)} (default: %(default)s)")
    p.add_argument("--replace", default="none",
                   help=f"repair each removed span with a linear map: {' | '.join(REPLACES)} (default: %(default)s)")
    p.add_argument("--stream", default="sequential",
                   help="activations the maps are fitted on: original | sequential (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=1e-4, help="lstsq ridge, relative to mean diag(MᵀM)")
    p.add_argument("--fuse", action="store_true", help="fold removed blocks into their neighbour (LaCo)")
    p.add_argument("--fuse-calibrate", action="store_true", help="fit one LaCo coefficient per matrix on data")
    p.add_argument("--calib", default="bundled:brown-calib", help="calibration text source (default: %(default)s)")
    p.add_argument("--samples", type=int, default=64, help="calibration sequences (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512, help="calibration sequence length (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict:
    return prune(
        args.model,
        args.output,
        drop=args.drop,
        select=args.select,
        layers=args.layers,
        what=args.what,
        replace=args.replace,
        fuse=args.fuse,
        fuse_calibrate=args.fuse_calibrate,
        calib=args.calib,
        samples=args.samples,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        stream=args.stream,
        alpha=args.alpha,
        overwrite=args.overwrite,
        progress=not args.json,
    )
