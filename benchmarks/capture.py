"""Capture-driver cost on the bundled SmolLM2: wall time and peak RSS vs the model's bytes.

Run::

    python benchmarks/capture.py                      # 128 x 512 calibration tokens
    python benchmarks/capture.py --samples 32 --seq-len 256

Each configuration runs in its own subprocess so its peak RSS (ru_maxrss) is its own:
- ``load``: load the model only (the floor);
- ``stream``: the driver with a per-block cosine accumulator (what scoring needs);
- ``hessians``: the driver with float64 Gram/Hessian accumulators on every linear layer
  of the current block (what GPTQ needs), freed after each block.
Prints a table and writes ``benchmarks/results/capture.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

MODEL = "bundled:smollm2-135m"
RESULTS = Path(__file__).resolve().parent / "results"


def child(mode: str, samples: int, seq_len: int, batch_size: int) -> dict:
    import torch

    from layercut.calibrate.capture import run_blocks
    from layercut.calibrate.data import calibration_batch
    from layercut.calibrate.stats import CosineStats, GramStats
    from layercut.compress.io.models import load_model, resolve_model, weight_bytes

    model, tok = load_model(MODEL)
    out = {"mode": mode, "dense_bytes": weight_bytes(resolve_model(MODEL))}
    calib = calibration_batch(tok, "bundled:brown-calib", samples=samples, seq_len=seq_len, seed=0)
    out["rss_after_load_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if mode == "stream":
        stats = []

        def cos(run):
            s = CosineStats()
            for h, o, m in zip(run.inputs, run.outputs(), run.masks):
                s.update(h, o, m)
            stats.append(s.mean_cosine())

        run_blocks(model, calib, [cos], batch_size=batch_size, progress=False)
    elif mode == "hessians":
        def hess(run):
            grams = {}
            hooks = {}
            for name, module in run.spec.linears(run.block):
                g = GramStats(module.in_features)
                grams[name] = g
                hooks[name] = lambda i, x, y, g=g: g.update(x, mask=run.masks[i])
            run.forward(hooks=hooks)
            del grams

        run_blocks(model, calib, [hess], batch_size=batch_size, progress=False)
    out["seconds"] = time.perf_counter() - start
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    d = model.config.hidden_size
    out["activation_set_mb"] = samples * seq_len * d * 4 / 2**20
    out["all_layers_activations_mb"] = out["activation_set_mb"] * (model.config.num_hidden_layers + 1)
    out["tokens"] = samples * seq_len
    out["threads"] = torch.get_num_threads()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.samples, args.seq_len, args.batch_size)))
        return
    rows = []
    for mode in ("load", "stream", "hessians"):
        cmd = [sys.executable, __file__, "--child", mode, "--samples", str(args.samples),
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            sys.exit(f"{mode} failed:\n{proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    dense_mb = rows[0]["dense_bytes"] / 2**20
    print(f"model {MODEL}: dense fp32 weights {dense_mb:.0f} MiB; calibration {args.samples} x {args.seq_len} "
          f"tokens; one activation set {rows[0]['activation_set_mb']:.0f} MiB; all {31} layer sets would be "
          f"{rows[0]['all_layers_activations_mb']:.0f} MiB")
    print(f"{'mode':<10} {'wall s':>8} {'peak RSS MiB':>13} {'RSS - load MiB':>15} {'peak / dense':>13}")
    for r in rows:
        print(f"{r['mode']:<10} {r.get('seconds', 0):>8.1f} {r['peak_rss_mb']:>13.0f} "
              f"{r['peak_rss_mb'] - rows[0]['peak_rss_mb']:>15.0f} {r['peak_rss_mb'] / dense_mb:>13.2f}")
    RESULTS.mkdir(exist_ok=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "date": time.strftime("%Y-%m-%d"),
            "samples": args.samples, "seq_len": args.seq_len, "batch_size": args.batch_size}
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    write_merged(RESULTS / "capture.json", {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
