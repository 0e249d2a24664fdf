"""`layercut plan` at a few size targets vs the best single-axis baselines at no more bytes.

Run (one target per invocation is fine: rows merge into the stored JSON)::

    HF_HUB_OFFLINE=1 nice -n 5 .venv/bin/python benchmarks/plan.py --targets 40%      # -> benchmarks/results/plan.json
    .venv/bin/python benchmarks/plan.py --from-json benchmarks/results/plan.json      # the table only

For each target (a percentage of the source's bf16 bytes, 2 bytes per parameter):

- **plan**: ``layercut plan bundled:smollm2-135m --target-size T`` with its defaults (calibration
  64 × 128 tokens for GPTQ, 32 × 128 for the depth cuts, KL judged on 16 × 128 held-apart
  calibration tokens, top-2 verified); its wall time;
- **uniform**: plain ``layercut quantize`` (GPTQ, the same calibration) at the costliest
  (bits, group size) of the plan's search set (group sizes 128/64/per row; 4-bit g32 is left
  out: it is the bundled model's own Q4_1 grid) whose bytes fit; its wall time is the "one
  uniform GPTQ run" the plan's time is compared with (the 4g64 run where it fits);
- **depth-only**: the prune stage (block influence + lstsq) removing the fewest blocks whose
  bf16 export fits, not healed (the issue's baseline heals it: not done here, for time);

each evaluated on ``bundled:brown-test`` (4,096 tokens at ctx 512, KL to the source), per
calibration seed (``--seeds 0,1,2``: the plan's and the uniform run's seed; the depth cuts'
calibration does not take one). Everything runs in this process at ``LAYERCUT_BENCH_THREADS``
(default 1) intra-op threads.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks._results import write_merged  # noqa: E402

MODEL = "bundled:smollm2-135m"
TEST = "bundled:brown-test"
OUT = ROOT / "benchmarks" / "results" / "plan.json"
THREADS = int(os.environ.get("LAYERCUT_BENCH_THREADS", "1"))


def _eval(path: Path, source: Path) -> dict:
    from layercut.compress.workflow.stages import eval as eval_stage
    from layercut.compress.workflow.stages.base import RunEnv
    from layercut.compress.workflow.stages.eval import EvalConfig

    rep = eval_stage.run(EvalConfig(text=TEST, max_tokens=4096, ctx=512, reference=str(source)), path, None,
                         RunEnv(progress=False))
    return {"kl": rep["model"]["kl"], "ppl": rep["model"]["ppl"], "bytes": rep["model"]["bytes"],
            "reference_ppl": rep["baseline"]["ppl"]}


def measure(target: str, work: Path, seed: int = 0) -> dict:
    from layercut.compress.io.models import resolve_model, weight_bytes
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.planner.config import PlanConfig
    from layercut.compress.workflow.planner.search import plan
    from layercut.compress.workflow.planner.space import Layout, pair_label, uniform_configs
    from layercut.compress.workflow.stages import export, prune, quantize
    from layercut.compress.workflow.stages.base import RunEnv
    from layercut.compress.workflow.stages.export import ExportConfig
    from layercut.compress.workflow.stages.prune import PruneConfig

    src = resolve_model(MODEL)
    cfg = PlanConfig(size=target, seed=seed)
    layout = Layout.of(src)
    n, tbytes = layout.num_blocks, cfg.target_bytes(layout.bf16_bytes)
    row: dict = {"target": target, "seed": seed, "target_bytes": tbytes, "bf16_bytes": layout.bf16_bytes}

    t0 = time.perf_counter()
    rep = plan(cfg, MODEL, work / "plan", progress=True)
    row["plan_s"] = round(time.perf_counter() - t0, 1)
    w = rep["winner"]
    row["plan"] = {"winner": w["label"], "kept_blocks": w["kept_blocks"], "bytes": w["measured_bytes"],
                   "calib_kl": w["measured_kl"], "predicted_kl": w["predicted_kl"],
                   "spearman_topk": rep["spearman_topk"], "composition": rep["composition"],
                   "timings": rep["timings"], "candidates": len(rep["candidates"]), "cuts": rep["cuts"],
                   "rtn_kl": rep["rtn_kl"], **_eval(work / "plan" / "model", src)}

    env = RunEnv(progress=False)
    full = list(range(n))
    fitting = [c for c in uniform_configs(layout, cfg.bits, cfg.group_sizes) if layout.quantized_bytes(full, c) <= tbytes]
    if fitting:
        c = max(fitting, key=lambda c: layout.quantized_bytes(full, c))
        t0 = time.perf_counter()
        quantize.run(QuantizeConfig(bits=c[0], group_size=c[1], samples=cfg.samples, seq_len=cfg.seq_len,
                                    seed=cfg.seed), src, work / "uniform", env)
        row["uniform"] = {"config": pair_label(c), "seconds": round(time.perf_counter() - t0, 1),
                          **_eval(work / "uniform", src)}
    else:
        row["uniform"] = {"config": None, "why": "no uniform (bits, group size) of the search set fits"}
    kept = max((k for k in range(1, n + 1) if layout.dense_bytes(list(range(k)), "BF16") <= tbytes), default=None)
    if kept is not None:
        pr = prune.run(PruneConfig(drop=n - kept, select="block-influence", replace="lstsq", samples=cfg.prune_samples,
                                   seq_len=cfg.seq_len), src, work / "cut", env)
        export.run(ExportConfig(save_dtype="bf16", card=False), work / "cut", work / "depth", env)
        row["depth_only"] = {"kept_blocks": kept, "removed": pr["layers"], **_eval(work / "depth", src)}
        assert weight_bytes(work / "depth") <= tbytes
    else:
        row["depth_only"] = {"kept_blocks": None, "why": "the embeddings alone exceed the target"}
    base = [r["kl"] for r in (row["uniform"], row["depth_only"]) if "kl" in r]
    row["best_baseline_kl"] = min(base) if base else None
    row["plan_beats_baselines"] = None if not base else row["plan"]["kl"] <= min(base)
    return row


def _spearman_calibrated(plan: dict) -> float | None:
    from layercut.compress.workflow.planner.measure import spearman

    comp = plan.get("composition") or []
    return spearman([c["calibrated"] for c in comp], [c["measured"] for c in comp])


def table(data: dict) -> str:
    """One row per target; the GPTQ bar is that row's uniform run (else the stored 4g64 run)."""
    lines = ["| target (of bf16) | seed | plan winner | plan MB | plan test KL | uniform GPTQ | uniform MB | uniform test KL "
             "| depth-only kept | depth-only test KL | plan s | uniform GPTQ s | ratio | Spearman top-k raw / calibrated |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for key in sorted((k for k in data if k.startswith("target_")), key=lambda k: (data[k]["target"], k)):
        r = data[key]
        p, u, d = r["plan"], r["uniform"], r["depth_only"]
        bar = u.get("seconds") or data.get("gptq_bar_s")
        raw, cal = p["spearman_topk"], _spearman_calibrated(p)
        lines.append(
            f"| {r['target']} | {r.get('seed', 0)} | {p['winner']} | {p['bytes'] / 1e6:.1f} | {p['kl']:.4f} | {u.get('config') or 'none fits'} | "
            f"{u['bytes'] / 1e6 if 'bytes' in u else nan:.1f} | {u.get('kl', nan):.4f} | "
            f"{d.get('kept_blocks') or '-'} | {d.get('kl', nan):.4f} | {r['plan_s']:.0f} | "
            f"{bar if bar else nan:.0f} | {r['plan_s'] / bar if bar else nan:.1f}x | "
            f"{raw if raw is not None else '-'} / {cal if cal is not None else '-'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="30%,40%,55%")
    ap.add_argument("--seeds", default="0", help="calibration seeds, comma list (each a row: target_T, "
                                                   "target_T_seedS for S > 0)")
    ap.add_argument("--from-json", type=Path)
    args = ap.parse_args()
    if args.from_json:
        import json

        print(table(json.loads(args.from_json.read_text())))
        return
    import torch

    torch.set_num_threads(THREADS)
    for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
        for seed in [int(x) for x in args.seeds.split(",")]:
            work = Path(tempfile.mkdtemp(prefix="plan-bench-"))
            try:
                load = os.getloadavg()
                row = measure(target, work, seed)
                row.update(threads=THREADS, load_before=[round(x, 2) for x in load],
                           load_after=[round(x, 2) for x in os.getloadavg()], seeds=[seed])
            finally:
                shutil.rmtree(work, ignore_errors=True)
            key = f"target_{target.rstrip('%')}" + (f"_seed{seed}" if seed else "")
            update = {key: row, "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), {THREADS} thread(s)"}
            if row["uniform"].get("config") == "4g64" and not seed:
                update["gptq_bar_s"] = row["uniform"]["seconds"]
                update["gptq_bar"] = "wall s of `layercut quantize --bits 4 --group-size 64` (64 x 128 calibration)"
            data = write_merged(OUT, update)
            print(table(data), flush=True)


if __name__ == "__main__":
    main()
