"""Scale tuning (``layercut heal --method scales``) against plain GPTQ at the same bytes.

Run::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/heal_scales.py --text bundled:brown-val \\
        --seeds 0 --configs 60x4@1e-3,60x4@3e-3                    # the choice, on validation
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/heal_scales.py --seeds 0,1,2   # test: the chosen config
    # scale tuning on top of block-wise reconstruction (quantize --block-tune), against it on plain GPTQ
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/heal_scales.py --text bundled:brown-val --seeds 0 --bits 3 \\
        --json-out benchmarks/results/heal_scales-block-tune-brown-val.json [--block-tune]
    # ... with block tuning at another step size (rows gptq-3-blocktuned-lr0.01[-Nx128])
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/heal_scales.py --text bundled:brown-val --seeds 0 --bits 3 \\
        --samples 256 --block-tune --block-tune-lr 0.01 --json-out benchmarks/results/heal_scales-block-tune-brown-val-256x128.json
    .venv/bin/python benchmarks/heal_scales.py --from-json benchmarks/results/heal_scales.json
    # the share of the 3 -> 4-bit gap that block tuning (+ scale tuning) closes, per seed, the gap's ends being
    # the plain 3- and 4-bit rows of the block-tuning benchmark on the same split, seeds and threads
    .venv/bin/python benchmarks/heal_scales.py --from-json benchmarks/results/heal_scales-block-tune-brown-test-smollm2.json \\
        --gap-from benchmarks/results/block_tune-brown-test-smollm2.json

Per calibration seed: ``layercut quantize MODEL --bits B --group-size G`` (``--model``, default the bundled
SmolLM2-135M, G 64; ``--model PATH/gemma-3-270m-q4_k_m.gguf --group-size 128`` writes
``heal_scales-gemma-3-270m.json``; 64 x 128
calibration tokens, the demo's, unless ``--samples N``: N x 128, rows named ``...-Nx128``), then for each config ``STEPSxBATCH@LR`` ``layercut heal Q --method
scales`` (128-token windows of bundled:brown-calib past every calibration draw, the teacher's top-64,
the heal seed = the calibration seed), and ``layercut eval`` of both on ``--text`` (4,096 tokens, ctx
512, KL to the original). Each command is one child process; the JSON is written by this script
(``benchmarks/results/heal_scales[-brown-val].json``) and a table printed. Bytes are the
safetensors files', equal by construction (the tuned checkpoint differs in its scales only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_merged  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bundled:smollm2-135m"
DEFAULT_CONFIGS = "60x4@1e-3"


def _cli(args: list[str]) -> tuple[dict, float]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "layercut.cli", "-q", *args, "--json"], capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"layercut {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), time.perf_counter() - t


def _eval(path: Path, text: str, model: str) -> dict:
    rep, _ = _cli(["eval", str(path), "--reference", model, "--text", text, "--max-tokens", "4096", "--ctx", "512"])
    return {"kl": rep["kl"], "ppl": rep["ppl"], "bytes": rep["bytes"], "reference_ppl": rep["reference_ppl"]}


def parse_config(c: str) -> tuple[int, int, float]:
    steps, rest = c.split("x")
    batch, lr = rest.split("@")
    return int(steps), int(batch), float(lr)


def run(args) -> dict:
    out = Path(args.json_out)
    data = json.loads(out.read_text()) if out.is_file() else {"setup": {}, "runs": {}}
    data["setup"] = {"model": args.model, "text": args.text, "quantize": "per row: gptq-B = --bits B, mixed-X = --avg-bits X (CLI mixed defaults)", "group_size": args.group_size, "calib": f"{args.samples} x 128",
                     "eval": "4096 tokens, ctx 512", "heal_seq_len": 128, "teacher_topk": 64,
                     "threads": os.environ.get("OMP_NUM_THREADS", "CLI default")}
    with tempfile.TemporaryDirectory(prefix="heal-scales-") as tmp:
        work = Path(tmp)
        quant = ["--avg-bits", str(args.avg_bits)] if args.avg_bits else ["--bits", str(args.bits)]
        base = f"mixed-{args.avg_bits:g}" if args.avg_bits else f"gptq-{args.bits}"
        if args.block_tune:
            quant.append("--block-tune")
            base += "-blocktuned"
            if args.block_tune_lr is not None:
                quant += ["--block-tune-lr", str(args.block_tune_lr)]
                base += f"-lr{args.block_tune_lr:g}"
        if args.samples != 64:
            base += f"-{args.samples}x128"
        for seed in [int(s) for s in args.seeds.split(",")]:
            q = work / f"{base}-s{seed}"
            qrep, qs = _cli(["quantize", args.model, "-o", str(q), *quant, "--group-size", str(args.group_size),
                             "--samples", str(args.samples), "--seq-len", "128", "--seed", str(seed)])
            plain = _eval(q, args.text, args.model) | {"seconds": round(qs, 1)}
            data["runs"][f"{base}/seed{seed}"] = plain
            write_merged(out, data, rows="runs")
            print(f"seed {seed}: plain {base} KL {plain['kl']:.4f}, {plain['bytes'] / 1e6:.1f} MB", flush=True)
            for c in args.configs.split(","):
                steps, batch, lr = parse_config(c)
                t = work / f"t-{seed}-{c}"
                hrep, hs = _cli(["heal", str(q), "--method", "scales", "--teacher", args.model, "-o", str(t),
                                 "--steps", str(steps), "--batch-size", str(batch), "--seq-len", "128",
                                 "--lr", str(lr), "--seed", str(seed)])
                row = _eval(t, args.text, args.model) | {"seconds": round(hs, 1), "loss_start": hrep.get("loss_start"),
                                             "loss_end": hrep.get("loss_end")}
                data["runs"][f"{base}+scales-{c}/seed{seed}"] = row
                print(f"  {c}: KL {row['kl']:.4f} ({100 * (row['kl'] / plain['kl'] - 1):+.1f}%), "
                      f"{row['bytes'] / 1e6:.1f} MB, heal {hs:.0f} s", flush=True)
                write_merged(out, data, rows="runs")
    return write_merged(out, data, rows="runs")


def gap_anchors(path: str, model: str) -> dict[int, tuple[float, float]]:
    """Per calibration seed, (plain 3-bit KL, plain 4-bit KL) of ``model`` from a ``benchmarks/block_tune.py``
    JSON (rows ``MODEL/BITS/none/seedS``): the ends of the 3 -> 4-bit gap."""
    try:
        runs = json.loads(Path(path).read_text())["runs"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--gap-from: {path} is not a benchmarks/block_tune.py JSON ({e})") from None
    out = {}
    for key, row in runs.items():
        name, bits, rest = key.split("/", 2)  # a config may itself hold '/' (lr/scale lr/norm lr)
        config, seed = rest.rsplit("/", 1)
        other = runs.get(f"{name}/4/none/{seed}")
        if name == model and bits == "3" and config == "none" and other:
            out[int(seed.removeprefix("seed"))] = (row["kl"], other["kl"])
    if not out:
        raise SystemExit(f"--gap-from: {path} has no plain 3- and 4-bit rows of the same seed for {model!r}")
    return out


def table(data: dict, anchors: dict[int, tuple[float, float]] | None = None) -> str:
    """The rows, mean (min-max) over seeds; with ``anchors`` (:func:`gap_anchors`) the 3-bit rows also get
    the share of each seed's (plain 3-bit -> plain 4-bit) KL gap they close."""
    groups: dict[str, dict[int, dict]] = {}
    for key, row in data["runs"].items():
        name, seed = key.rsplit("/seed", 1)
        groups.setdefault(name, {})[int(seed)] = row
    lines = [f"text {data['setup'].get('text')}; KL to the original, mean (min-max) over seeds", "",
             "| checkpoint | seeds | MB | KL | Δ log-ppl vs plain (paired) | 3→4-bit gap closed | s (quantize; +scales rows: heal) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, rows in groups.items():
        seeds = sorted(rows)
        kls = [rows[s]["kl"] for s in seeds]
        plain = groups.get(name.split("+")[0], {})
        dl = [math.log(rows[s]["ppl"]) - math.log(plain[s]["ppl"]) for s in seeds if s in plain]
        kl = f"{statistics.fmean(kls):.4f} ({min(kls):.4f}–{max(kls):.4f})"
        gaps = [100 * (anchors[s][0] - rows[s]["kl"]) / (anchors[s][0] - anchors[s][1])
                for s in seeds if anchors and s in anchors] if name.startswith("gptq-3") else []
        gap = f"{statistics.fmean(gaps):.1f}% ({min(gaps):.1f}–{max(gaps):.1f})" if gaps else ""
        lines.append(f"| {name} | {','.join(map(str, seeds))} | {rows[seeds[0]]['bytes'] / 1e6:.1f} | {kl} | "
                     f"{statistics.fmean(dl):+.4f} | {gap} | {statistics.fmean(rows[s]['seconds'] for s in seeds):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL, help="the model (bundled:NAME, a checkpoint or a .gguf)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--text", default="bundled:brown-test")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--avg-bits", type=float, help="quantize with --avg-bits X (the CLI's mixed defaults; group "
                                                    "size 64 for its bare widths) instead of --bits")
    ap.add_argument("--block-tune", action="store_true", help="quantize with --block-tune (its defaults): rows "
                                                                   "gptq-B-blocktuned[+scales-...]")
    ap.add_argument("--block-tune-lr", type=float, help="with --block-tune: its --block-tune-lr (rows ...-blocktuned-lrX; "
                                                        "default: the quantize default, no suffix)")
    ap.add_argument("--samples", type=int, default=64, help="calibration sequences of 128 tokens (default 64)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of STEPSxBATCH@LR (default %(default)s)")
    ap.add_argument("--json-out")
    ap.add_argument("--from-json")
    ap.add_argument("--gap-from", metavar="FILE[:MODEL]",
                    help="a benchmarks/block_tune.py JSON (and its model name there, smollm2 or gemma3; default: "
                         "gemma3 for a gemma GGUF, else smollm2): its plain 3- and 4-bit rows give, per seed, "
                         "the 3 -> 4-bit gap that the table's 3-bit rows close")
    args = ap.parse_args()
    if args.block_tune_lr is not None and (not args.block_tune or args.block_tune_lr <= 0):
        ap.error("--block-tune-lr needs --block-tune and a positive value")
    data = json.loads(Path(args.from_json).read_text()) if args.from_json else None
    anchors = None
    if args.gap_from:  # checked before any run starts
        path, _, name = args.gap_from.partition(":")
        model = str(data["setup"].get("model")) if data else args.model
        anchors = gap_anchors(path, name or ("gemma3" if "gemma" in model else "smollm2"))
    if data:
        print(table(data, anchors))
        return
    suffix = "" if args.text == "bundled:brown-test" else "-" + args.text.split(":")[-1]
    if args.model != MODEL:
        suffix = "-" + Path(args.model).name.split("-q4")[0].removesuffix(".gguf") + suffix
    args.json_out = args.json_out or str(ROOT / "benchmarks" / "results" / f"heal_scales{suffix}.json")
    print(table(run(args), anchors))


if __name__ == "__main__":
    main()
