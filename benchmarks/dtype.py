"""Streamed stages read in bf16 vs fp32: how far the outputs' quality moves on SmolLM2.

Run::

    HF_HUB_OFFLINE=1 python benchmarks/dtype.py        # prints a table, writes results/dtype.json

For each read dtype (``--dtype fp32`` and ``--dtype bf16`` of the bundled model's fp32
conversion), through the CLI as a user runs it: the model itself, a block drop (blocks 11
and 12) and GPTQ 4-bit g64 (32 × 256 calibration tokens, seed 0), each evaluated on the first
4,096 tokens of ``bundled:brown-test`` at ctx 512 in fp32. The gap is reported in log
perplexity (mean token NLL), bf16 minus fp32. One seed: the GPTQ gap is within the
calibration-seed spread of ``benchmarks/quant.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bundled:smollm2-135m"
EVAL = ["--max-tokens", "4096", "--ctx", "512", "--json"]


def layercut(*args: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, "-m", "layercut.cli", "-q", *args], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"layercut {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def evaluate(path: str, dtype: str) -> dict:
    return json.loads(layercut("eval", path, "--dtype", dtype, *EVAL))


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("fp32", "bf16"):
            rows.append({"dtype": dtype, "output": "model", **_figures(evaluate(MODEL, dtype))})
            drop = f"{tmp}/drop-{dtype}"
            layercut("prune", MODEL, "-o", drop, "--layers", "11,12", "--dtype", dtype)
            rows.append({"dtype": dtype, "output": "drop 11,12", **_figures(evaluate(drop, "fp32"))})
            quant = f"{tmp}/gptq-{dtype}"
            layercut("quantize", MODEL, "-o", quant, "--bits", "4", "--group-size", "64", "--samples", "32",
                     "--seq-len", "256", "--dtype", dtype)
            rows.append({"dtype": dtype, "output": "gptq 4-bit g64", **_figures(evaluate(quant, "fp32"))})
    lines = ["| output | ppl fp32 read | ppl bf16 read | Δ log ppl (bf16 − fp32) |", "|---|---:|---:|---:|"]
    for name in ("model", "drop 11,12", "gptq 4-bit g64"):
        a, b = (next(r for r in rows if r["output"] == name and r["dtype"] == d) for d in ("fp32", "bf16"))
        lines.append(f"| {name} | {a['ppl']:.3f} | {b['ppl']:.3f} | {b['nll'] - a['nll']:+.5f} |")
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    write_merged(RESULTS / "dtype.json", {"command": "python benchmarks/dtype.py", "rows": rows}, indent=2)


def _figures(r: dict) -> dict:
    return {"ppl": r["ppl"], "nll": r["nll"], "tokens": r["tokens"], "bytes": r["bytes"]}


if __name__ == "__main__":
    main()
