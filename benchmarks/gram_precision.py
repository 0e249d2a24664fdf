"""Gram products in float32 vs float64: does the lstsq block replacement notice?

Run::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/gram_precision.py   # table + results/gram_precision.json

``layercut.calibrate.stats.GramStats`` sums XᵀX and XᵀY in float64; each micro-batch's product is
computed in ``GramStats.product_dtype``. The linear replacement (ReplaceMe-style lstsq map
solved from those sums) is the stage most sensitive to their conditioning, so it is the
test case: each span is replaced once with float64 products and once with float32 products
(same model, same calibration windows), and the two results are compared by the relative
difference of the fitted maps and by perplexity on the validation text (the choice of the
default is made there; nothing is reported on the test text). SmolLM2's residual stream
carries massive activations from block 11 on (per-token energies in the millions against
~10⁴ elsewhere), the hard case for float32 sums; a second real model is measured with
``--model``. Fit time is the wall time of ``prune_model`` (one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from layercut.calibrate.data import calibration_batch  # noqa: E402
from layercut.calibrate.stats import GramStats  # noqa: E402
from layercut.compress.depth.prune import prune_model  # noqa: E402
from layercut.compress.eval.evaluate import evaluate  # noqa: E402
from layercut.compress.io.models import load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


def run(args: argparse.Namespace) -> dict:
    rows = []
    for span in args.spans.split(";"):
        layers = [int(x) for x in span.split(",")]
        fitted = {}
        for name, dtype in DTYPES.items():
            GramStats.product_dtype = dtype
            model, tok = load_model(args.model)
            calib = calibration_batch(tok, args.calib, samples=args.samples, seq_len=args.seq_len, seed=0)
            t0 = time.perf_counter()
            prune_model(model, layers, replace="lstsq", calib=calib, progress=False)
            fit_s = time.perf_counter() - t0
            ev = evaluate(model, tok, text=args.text, ctx=512, max_tokens=args.max_tokens, progress=False)
            fitted[name] = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
            rows.append({"span": layers, "product": name, "ppl": ev.ppl, "nll": ev.nll, "fit_s": fit_s})
            print(f"span {layers} {name}: ppl {ev.ppl:.4f} fit {fit_s:.1f} s", flush=True)
            del model
        diffs = [float((fitted["fp32"][k] - v).norm() / v.norm().clamp_min(1e-30))
                 for k, v in fitted["fp64"].items() if not torch.equal(fitted["fp32"][k], v)]
        rows[-1]["max_rel_diff_changed_tensors"] = max(diffs, default=0.0)
        rows[-1]["changed_tensors"] = len(diffs)
    GramStats.product_dtype = torch.float32
    return {"model": args.model, "calib": args.calib, "samples": args.samples, "seq_len": args.seq_len,
            "text": args.text, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(), "rows": rows,
            "command": "HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/gram_precision.py " + " ".join(sys.argv[1:])}


def table(r: dict) -> str:
    lines = [f"lstsq replacement on {r['model']}, {r['samples']} × {r['seq_len']} calibration tokens, ppl on "
             f"{r['text']} ({r['max_tokens']} tokens, ctx 512)", "",
             "| blocks replaced | ppl, float64 products | ppl, float32 products | Δ log ppl (fp32 − fp64) | "
             "max rel. diff of fitted weights | fit s fp64 | fit s fp32 |", "|---|---:|---:|---:|---:|---:|---:|"]
    spans = []
    for row in r["rows"]:
        if row["span"] not in spans:
            spans.append(row["span"])
    for span in spans:
        a, b = (next(x for x in r["rows"] if x["span"] == span and x["product"] == p) for p in ("fp64", "fp32"))
        lines.append(f"| {','.join(map(str, span))} | {a['ppl']:.4f} | {b['ppl']:.4f} | {b['nll'] - a['nll']:+.6f} | "
                     f"{b.get('max_rel_diff_changed_tensors', 0):.2e} | {a['fit_s']:.1f} | {b['fit_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:smollm2-135m")
    ap.add_argument("--calib", default="bundled:brown-calib")
    ap.add_argument("--spans", default="1,2;11,12,13,14,15,16,17,18", help="';'-separated block lists")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--text", default="bundled:brown-val")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--json-out", default=str(RESULTS / "gram_precision.json"))
    ap.add_argument("--from-json", help="only print the table of a stored result")
    args = ap.parse_args()
    if args.from_json:
        print(table(json.loads(Path(args.from_json).read_text())))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    r = run(args)
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    write_merged(args.json_out, r)
    print(table(r))


if __name__ == "__main__":
    main()
