"""What the per-group scale search adds to a GPTQ solve, in CPU seconds, at SmolLM2-135M's shapes.

Run (one intra-op thread, CPU time of this process, min over ``--reps``; the solve is all the
search touches, so the block forwards and Hessians, the larger part of a quantize run, are not
timed)::

    .venv/bin/python benchmarks/scale_search_cost.py

One decoder block's four fused solves (qkv [960, 576], o [576, 576], gate_up [3072, 576],
down [576, 1536]; random weights and a Hessian from 2,048 random tokens: the work does not
depend on the values) with act-order, static groups of 64, float32 solve, 4 bits, for each
``scale_search`` at the default grid (1, 0.95, ..., 0.75). Writes
``benchmarks/results/scale_search_cost.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
KINDS = ("none", "mse", "hessian", "obs")


def main() -> None:
    from layercut.compress.quant.solve.gptq import gptq_quantize

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks/results/scale_search_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    seconds: dict[str, dict[str, float]] = {k: {} for k in KINDS}
    for name, (out_f, in_f) in SHAPES.items():
        W = torch.randn(out_f, in_f) * 0.05
        X = torch.randn(2048, in_f)
        H = (X.T @ X).double() * (2 / 2048)
        for _ in range(args.reps):
            for kind in KINDS:  # interleaved, so a busy spell on the machine hits every kind alike
                t0 = time.process_time()
                gptq_quantize(W, H, args.bits, 64, act_order=True, static_groups=True, solve_dtype=torch.float32,
                              scale_search=kind)
                dt = time.process_time() - t0
                seconds[kind][name] = min(seconds[kind].get(name, dt), dt)
    block = {k: sum(v.values()) for k, v in seconds.items()}
    print("| scale_search | " + " | ".join(SHAPES) + " | block | vs none |")
    print("|---" * (len(SHAPES) + 3) + "|")
    for kind in KINDS:
        print(f"| {kind} | " + " | ".join(f"{seconds[kind][n]:.3f}" for n in SHAPES)
              + f" | {block[kind]:.3f} | {block[kind] / block['none']:.2f}x |")
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    write_merged(args.json_out, {"setup": {"bits": args.bits, "group_size": 64, "act_order": True,
                                           "static_groups": True, "solve_dtype": "float32", "threads": 1,
                                           "reps": args.reps, "shapes": SHAPES},
                                 "cpu_seconds": seconds, "block_cpu_seconds": block,
                                 "ratio_vs_none": {k: block[k] / block["none"] for k in KINDS}})


if __name__ == "__main__":
    main()
