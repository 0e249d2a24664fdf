"""``layercut quantize MODEL -o OUT (--bits B | --avg-bits X [--candidates 2,3,4,8] [--unit layer|group])
[--group-size 64] [--sym] [--(no-)act-order] [--(no-)static-groups] [--group-aware] [--method gptq|rtn] [--calib SRC] [--samples 128] [--seq-len 512] [--json]``.

Writes a GPTQ v1 checkpoint (see compress/quant/checkpoint.py); with ``--avg-bits`` also
``allocation.json`` and ``allocation.png`` inside it. Calls
:func:`compress.quant.run.quantize_checkpoint`.
"""

from __future__ import annotations

import argparse

import torch

from compress.errors import LayercutError
from compress.quant.run import DEFAULT_SENSITIVITY, quantize_checkpoint
from compress.quant.sensitivity import METHODS as SENS_METHODS
from compress.quant.stage import SEQUENTIAL

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LayercutError(f"--candidates: expected comma-separated integers like 2,3,4,8, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="GPTQ (or RTN) with uniform bits or bits allocated per layer")
    p.add_argument("model", help="HF model directory, .gguf file, or bundled:NAME")
    p.add_argument("-o", "--output", required=True, help="output checkpoint directory (must not exist)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--bits", type=int, help="uniform bits: 2, 3, 4 or 8")
    size.add_argument("--avg-bits", type=float, metavar="X",
                      help="average bits per weight, scales and zeros included: n·(b + (16 + b)/gs)")
    p.add_argument("--candidates", default="2,3,4,8", help="bit widths the allocator picks from (default: %(default)s)")
    p.add_argument("--unit", default="layer", choices=("layer", "group"),
                   help="allocation unit: decoder layer, or {qkv, o, gate_up, down} group (default: %(default)s)")
    p.add_argument("--sensitivity", default=DEFAULT_SENSITIVITY, choices=SENS_METHODS,
                   help="Δ_u(b) measure for the allocator (default: %(default)s; kl is exact and slow)")
    p.add_argument("--sensitivity-samples", type=int, default=16,
                   help="calibration sequences used for the sensitivities (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=64,
                   help="columns per scale/zero group, -1 for one per row; must divide every in_features "
                        "(default: %(default)s)")
    p.add_argument("--sym", action="store_true", help="symmetric quantization (default: asymmetric)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ in descending diag(H) order (default: on)")
    p.add_argument("--static-groups", action=argparse.BooleanOptionalAction, default=True,
                   help="group scales/zeros from the original weight up front; with --act-order this keeps "
                        "g_idx = i // group_size, so loaders need no desc_act (default: on)")
    p.add_argument("--group-aware", action="store_true",
                   help="GAR order: groups by their largest diag(H), columns within a group by diag(H)")
    p.add_argument("--method", default="gptq", choices=("gptq", "rtn"), help="(default: %(default)s)")
    p.add_argument("--damp", type=float, default=0.01, help="relative GPTQ damping (default: %(default)s)")
    p.add_argument("--sequential", default="block", choices=tuple(SEQUENTIAL),
                   help="Hessian passes per block: block (1), sublayer (2), linear (4) (default: %(default)s)")
    p.add_argument("--calib", default="bundled:brown-calib", help="calibration text source (default: %(default)s)")
    p.add_argument("--samples", type=int, default=128, help="calibration sequences (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512, help="calibration sequence length (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", help="where blocks run and are solved, e.g. cuda (default: the model's device)")
    p.add_argument("--dtype", default="float16", choices=tuple(DTYPES),
                   help="dtype of the tensors that stay dense (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> dict:
    return quantize_checkpoint(
        args.model,
        args.output,
        bits=args.bits,
        avg_bits=args.avg_bits,
        candidates=_int_list(args.candidates),
        unit=args.unit,
        group_size=args.group_size,
        sym=args.sym,
        act_order=args.act_order,
        static_groups=args.static_groups,
        group_aware=args.group_aware,
        method=args.method,
        damp=args.damp,
        sequential=args.sequential,
        calib=args.calib,
        samples=args.samples,
        seq_len=args.seq_len,
        seed=args.seed,
        sensitivity=args.sensitivity,
        sensitivity_samples=args.sensitivity_samples,
        batch_size=args.batch_size,
        device=args.device,
        dtype=DTYPES[args.dtype],
        overwrite=args.overwrite,
        progress=not args.json,
    )
