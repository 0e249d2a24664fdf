"""QLoRA vs LoRA at equal steps: SmolLM2-135M with 8 of 30 blocks removed, log-ppl gap recovered, seeds.

Run (CPU, one torch thread per process; two processes can share the JSON)::

    HF_HUB_OFFLINE=1 python benchmarks/qlora.py                       # lora and qlora, seeds 0,1,2
    HF_HUB_OFFLINE=1 python benchmarks/qlora.py --methods qlora --seeds 1   # one run; merges into the JSON
    python benchmarks/qlora.py --from-json                            # the stored table

The student is the angular span of ``--drop`` blocks removed by plain drop (``layercut prune``); each
run is ``layercut heal STUDENT --method M --teacher MODEL`` (the heal stage's ``run``) with the same
steps, batch, sequence length, learning rate, rank, data and seed for both methods: ``lora`` trains over
the dense student, ``qlora`` over its 4-bit RTN copy (group size 64) and merges into the dense weights.
Perplexity on ``--text`` (default ``bundled:brown-test``, ctx 512, first ``--max-tokens`` tokens) of the
original, the student and each healed output. Gap recovered (log-perplexity):
(log ppl_student − log ppl) / (log ppl_student − log ppl_original). The QLoRA/LoRA ratio is of the mean
recovered gaps. Wall time is the heal stage's (teacher pass, quantized copy and merge included) on a
machine other jobs may share. Results merge into ``--json-out`` by (method, seed), under a file lock.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = HERE / "results"


def _ppl(path: str | Path, text: str, max_tokens: int, ctx: int) -> float:
    from layercut.compress.eval.evaluate import evaluate
    from layercut.compress.io.models import load_model

    model, tok = load_model(path)
    return float(evaluate(model, tok, text=text, ctx=ctx, max_tokens=max_tokens, progress=False).ppl)


def _student(args, work: Path) -> Path:
    from layercut.compress.workflow.stages.prune import prune

    cut = work / f"cut{args.drop}-{args.select}"
    if not (cut / "config.json").is_file():
        prune(args.model, cut, drop=args.drop, select=args.select, replace="none", progress=False)
    return cut


def _merge(out: Path, update: dict) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(out.read_text()) if out.is_file() else {"runs": {}}
        data.update({k: v for k, v in update.items() if k != "runs"})
        data["runs"].update(update.get("runs", {}))
        data["summary"] = summary(data)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, out)
    return data


def summary(data: dict) -> dict:
    ref, cut = data.get("ppl_original"), data.get("ppl_student")
    out: dict = {}
    for method in ("lora", "qlora"):
        runs = [r for r in data["runs"].values() if r["method"] == method]
        if not runs or ref is None:
            continue
        rec = [(math.log(cut) - math.log(r["ppl"])) / (math.log(cut) - math.log(ref)) for r in runs]
        out[method] = {"seeds": sorted(r["seed"] for r in runs), "recovered_mean": statistics.fmean(rec),
                       "recovered_min": min(rec), "recovered_max": max(rec),
                       "ppl_mean": statistics.fmean(r["ppl"] for r in runs),
                       "wall_s_mean": statistics.fmean(r["wall_s"] for r in runs)}
    if "lora" in out and "qlora" in out:
        out["qlora_over_lora"] = out["qlora"]["recovered_mean"] / out["lora"]["recovered_mean"]
    return out


def table(data: dict) -> str:
    lines = [f"original ppl {data.get('ppl_original', float('nan')):.2f}, student ({data.get('student', '?')}) "
             f"ppl {data.get('ppl_student', float('nan')):.2f}; {data.get('settings', '')}",
             "| method | seeds | ppl (mean) | log-ppl gap recovered: mean (min–max) | heal wall s (mean) |",
             "|---|---|---|---|---|"]
    for method, s in data.get("summary", {}).items():
        if method == "qlora_over_lora":
            continue
        lines.append(f"| {method} | {','.join(map(str, s['seeds']))} | {s['ppl_mean']:.2f} | "
                     f"{100 * s['recovered_mean']:.1f}% ({100 * s['recovered_min']:.1f}–{100 * s['recovered_max']:.1f}%) "
                     f"| {s['wall_s_mean']:.0f} |")
    if "qlora_over_lora" in data.get("summary", {}):
        lines.append(f"QLoRA recovers {100 * data['summary']['qlora_over_lora']:.1f}% of what LoRA recovers.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bundled:smollm2-135m")
    ap.add_argument("--drop", type=int, default=8)
    ap.add_argument("--select", default="angular")
    ap.add_argument("--methods", default="lora,qlora")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--text", default="bundled:brown-test")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where the student goes (default: a cache folder)")
    ap.add_argument("--json-out", default=str(RESULTS / "qlora.json"))
    ap.add_argument("--from-json", action="store_true")
    args = ap.parse_args()
    out = Path(args.json_out)
    if args.from_json:
        print(table(json.loads(out.read_text())))
        return

    import torch

    from layercut.compress.io.models import cache_dir
    from layercut.compress.workflow.stages.base import RunEnv
    from layercut.compress.workflow.stages.heal import run as run_heal
    from layercut.heal.config import HealConfig

    torch.set_num_threads(args.threads)
    work = Path(args.workdir) if args.workdir else cache_dir() / "bench-qlora"
    work.mkdir(parents=True, exist_ok=True)
    cut = _student(args, work)
    settings = (f"{args.steps} steps of {args.batch} x {args.seq_len} tokens, lr {args.lr:g}, rank {args.rank}, "
                f"ppl on {args.text} ({args.max_tokens} tokens, ctx {args.ctx})")
    stored = json.loads(out.read_text()) if out.is_file() else {}
    head = {"student": f"{args.drop} blocks ({args.select}) dropped from {args.model}", "settings": settings}
    if stored.get("settings") != settings or "ppl_student" not in stored:
        head.update(ppl_original=_ppl(args.model, args.text, args.max_tokens, args.ctx),
                    ppl_student=_ppl(cut, args.text, args.max_tokens, args.ctx))
        if stored.get("settings") not in (None, settings):
            stored["runs"] = {}
            out.unlink(missing_ok=True)  # other settings: the stored runs do not compare
    for method in args.methods.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            cfg = HealConfig(method=method, teacher=args.model, steps=args.steps, batch_size=args.batch,
                             seq_len=args.seq_len, lr=args.lr, rank=args.rank, seed=seed)
            with tempfile.TemporaryDirectory(dir=work) as tmp:
                t0 = time.perf_counter()
                run_heal(cfg, str(cut), Path(tmp) / "out", env=RunEnv(progress=False))
                wall = time.perf_counter() - t0
                ppl = _ppl(Path(tmp) / "out", args.text, args.max_tokens, args.ctx)
            run = {"method": method, "seed": seed, "ppl": ppl, "wall_s": wall,
                   "command": f"python benchmarks/qlora.py --methods {method} --seeds {seed}"}
            data = _merge(out, {**head, "runs": {f"{method}-{seed}": run}})
            print(f"{method} seed {seed}: ppl {ppl:.2f}, {wall:.0f} s", flush=True)
    print(table(data))


if __name__ == "__main__":
    main()
