"""The two example recipes, measured side by side, and how the demo's settings were chosen.

Run (both recipes one after the other, then a longer test eval of each output; about
20 minutes on 2 free CPU cores, longer on a loaded machine)::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/demo.py
    .venv/bin/python benchmarks/demo.py --from-json benchmarks/results/demo.json   # print the stored figures
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/demo.py --choose    # the candidates, on brown-val

Measuring: first converts the bundled model once if it is not in the layercut cache yet (a
separate process, timed as ``convert_s``, so the measured runs are the README's "bundled model
already converted" case). Then runs ``python -m compress.cli -q run RECIPE -o RUN_DIR`` for
``recipes/smollm2-demo.yaml`` and ``recipes/smollm2-aggressive.yaml``, each in one child
process with the CLI's own thread settings, and measures its wall time, its CPU time and its
peak RSS (``os.wait4``: the child's own high-water mark), with the load average before and
after. Sizes are the output's safetensors bytes against the source in bf16 (2 bytes per
parameter of the source checkpoint, the tied embedding counted once). Perplexity and KL are
the run's own eval stage (its settings, its text: ``bundled:brown-test``); after the timed
run, the output is evaluated again on ``--long-tokens`` test tokens at ctx 512 (untimed), so
a short window cannot flatter it. Writes ``benchmarks/results/demo.json``.

Choosing (``--choose``): runs each of ``CANDIDATES`` (the demo recipe with the knobs below
overridden) with its eval stage on ``bundled:brown-val``; candidates that share their first
stages reuse them (the finished run is copied and resumed). Picks, among candidates within
the size limit and the CPU budget, the one with the lowest validation perplexity, writes
``benchmarks/results/demo-choice.json`` and says whether the pick is the demo recipe.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECIPES = {"demo": "recipes/smollm2-demo.yaml", "aggressive": "recipes/smollm2-aggressive.yaml"}
VAL_TEXT = "bundled:brown-val"
SIZE_LIMIT = 0.45  # weight bytes / bf16 bytes of the source
PPL_LIMIT = 1.25  # perplexity / the original's
WALL_LIMIT_S = 300.0
# What a candidate may spend: its stages' CPU time summed, run at one thread (--choose runs them
# so), within 90% of the wall limit, the rest left for start-up. One thread's CPU time is close
# to the work itself on a shared machine (two threads contending for busy cores spin and inflate
# it), and a run that fits it fits the limit even with one core free.
CPU_BUDGET_S = 0.9 * WALL_LIMIT_S
# The knobs tried for the demo (each set explicitly, so a candidate does not depend on the
# demo recipe's current values for them). 576 input features rule out group size 128, and
# 4-bit g32 is the bundled model's own Q4_1 grid, so every candidate uses group size 64.
_Q4 = {"bits": 4, "avg_bits": None, "candidates": None, "sensitivity": None}
_MIX5 = {"bits": None, "avg_bits": 5.0, "candidates": [4, 8], "sensitivity": "loss"}
CANDIDATES: dict[str, dict] = {
    "drop2-heal24-q4": {"prune": {"drop": 2}, "heal": {"steps": 24}, "quantize": {**_Q4, "samples": 16}},
    "drop2-heal24-q4-calib32": {"prune": {"drop": 2}, "heal": {"steps": 24}, "quantize": {**_Q4, "samples": 32}},
    "drop2-heal24-mix5": {"prune": {"drop": 2}, "heal": {"steps": 24}, "quantize": {**_MIX5, "samples": 16}},
    "drop2-heal24-mix5-calib32": {"prune": {"drop": 2}, "heal": {"steps": 24}, "quantize": {**_MIX5, "samples": 32}},
    "drop2-heal24-mix5-calib64": {"prune": {"drop": 2}, "heal": {"steps": 24}, "quantize": {**_MIX5, "samples": 64}},
    "drop2-heal48-mix5": {"prune": {"drop": 2}, "heal": {"steps": 48}, "quantize": {**_MIX5, "samples": 16}},
    "drop2-heal48-mix5-calib32": {"prune": {"drop": 2}, "heal": {"steps": 48}, "quantize": {**_MIX5, "samples": 32}},
    # 27 blocks leave room for 5.2 bits within the same bytes
    "drop3-heal24-mix5.2": {"prune": {"drop": 3}, "heal": {"steps": 24},
                            "quantize": {**_MIX5, "avg_bits": 5.2, "samples": 16}},
}


def bf16_bytes(model: str) -> int:
    """2 bytes per parameter of the source checkpoint (every tensor once, as stored)."""
    from safetensors import safe_open

    from compress.models import resolve_model

    params = 0
    for f in sorted(Path(resolve_model(model)).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return 2 * params


def run_child(args: list[str], log: Path, threads: int | None = None) -> tuple[int, float, float, float]:
    """Run ``python -m compress.cli ARGS`` in ROOT; (exit code, wall s, CPU s, peak RSS MiB).

    ``threads``: OMP_NUM_THREADS for the child (none: the CLI's own setting, all cores).
    """
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with open(log, "a") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "compress.cli", *args], cwd=ROOT, stdout=fh,
                                stderr=subprocess.STDOUT, env=env)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    # ru_maxrss is in KiB on Linux
    return os.waitstatus_to_exitcode(status), wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def quality(report: dict, run_dir: Path, bf16: int) -> dict:
    """Size, depth, bits and the eval stage's figures of a finished run."""
    stages = {r["stage"]: r for r in report["stages"]}
    ev = stages["eval"]["report"]
    model, base = ev["model"], ev["baseline"]
    q = stages["quantize"]["report"] if "quantize" in stages else {}
    return {
        "blocks": stages["prune"]["report"]["num_layers_after"] if "prune" in stages else None,
        "removed": stages["prune"]["report"]["layers"] if "prune" in stages else [],
        "bits_per_weight": q.get("avg_bits"),  # scales and zeros included
        "bytes": model["bytes"], "bf16_bytes": bf16, "size_vs_bf16": model["bytes"] / bf16,
        "text": model["text"], "tokens": model["tokens"], "ctx": model["ctx"],
        "ppl": model["ppl"], "original_ppl": base["ppl"], "ppl_ratio": model["ppl"] / base["ppl"],
        "kl": model["kl"], "final_model": str(run_dir / report["final_model"]),
    }


def measure(name: str, recipe: str, work: Path, long_tokens: int) -> dict:
    from compress.recipe import Recipe

    run_dir, log = work / name, work / f"{name}.log"
    load_before = os.getloadavg()
    code, wall, cpu, rss = run_child(["-q", "run", recipe, "-o", str(run_dir)], log)
    load_after = os.getloadavg()
    if code != 0:
        sys.exit(f"error: the {name} run failed (exit {code}); log: {log}")
    report = json.loads((run_dir / "report.json").read_text())
    model = Recipe.from_yaml(ROOT / recipe).model
    result = {
        "command": f"layercut run {recipe} -o RUN_DIR", "load_avg_before": list(load_before),
        "load_avg_after": list(load_after), "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss,
        **quality(report, run_dir, bf16_bytes(model)),
    }
    if long_tokens:
        out = work / f"{name}-long.json"
        code, wall, _cpu, _rss = run_child(["-q", "eval", result["final_model"], "--reference", model,
                                            "--max-tokens", str(long_tokens), "--ctx", "512", "-o", str(out)], log)
        if code != 0:
            sys.exit(f"error: the long eval of {name} failed (exit {code}); log: {log}")
        ev = json.loads(out.read_text())
        m, b = ev["model"], ev["baseline"]
        result["long_eval"] = {"text": m["text"], "tokens": m["tokens"], "ctx": m["ctx"], "ppl": m["ppl"],
                               "original_ppl": b["ppl"], "ppl_ratio": m["ppl"] / b["ppl"], "kl": m["kl"],
                               "wall_s": wall}
    result["report"] = report
    return result


def table(results: dict) -> str:
    rows = ["| recipe | blocks | bits/weight | weights MB (of bf16) | test ppl (original) | × original | KL "
            "| long eval ppl (original) | × original | wall | CPU s | peak RSS GiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        long = r.get("long_eval") or {}
        lp = f"{long['ppl']:.2f} ({long['original_ppl']:.2f}) | {long['ppl_ratio']:.2f}×" if long else "– | –"
        rows.append(f"| `{RECIPES.get(name, name)}` | {r['blocks']} | {r['bits_per_weight']:.2f} "
                    f"| {r['bytes'] / 1e6:.1f} ({100 * r['size_vs_bf16']:.1f}%) "
                    f"| {r['ppl']:.2f} ({r['original_ppl']:.2f}) | {r['ppl_ratio']:.2f}× | {r['kl']:.3f} | {lp} "
                    f"| {int(r['wall_s'] // 60)} min {r['wall_s'] % 60:.0f} s | {r['cpu_s']:.0f} "
                    f"| {r['peak_rss_mb'] / 1024:.1f} |")
    any_r = next(iter(results.values()))
    long = any_r.get("long_eval")
    notes = [f"Test ppl: the recipe's eval stage ({any_r['tokens']:,} tokens of `{any_r['text']}` at ctx "
             f"{any_r['ctx']}); long eval: {long['tokens']:,} tokens at ctx {long['ctx']}." if long else "",
             "Load average (1 min) before each run: " + ", ".join(f"{n} {r['load_avg_before'][0]:.1f}"
                                                                 for n, r in results.items()) + "."]
    return "\n".join(rows) + "\n\n" + " ".join(n for n in notes if n)


def main_measure(args: argparse.Namespace) -> None:
    from compress.pipeline import summary_table
    from compress.recipe import Recipe

    names = args.only.split(",") if args.only else list(RECIPES)
    out = Path(args.json_out)
    data = json.loads(out.read_text()) if args.only and out.is_file() else {}
    data.setdefault("runs", {})
    model = Recipe.from_yaml(ROOT / RECIPES[names[0]]).model
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"from compress.models import resolve_model; resolve_model({model!r})"],
                   cwd=ROOT, check=True)
    data.update(machine=f"{platform.machine()}, {os.cpu_count()} CPU cores", convert_s=time.perf_counter() - t0)
    work = Path(args.work or tempfile.mkdtemp(prefix="layercut-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (work / name).exists():
            sys.exit(f"error: {work / name} exists; give a fresh --work")
        data["runs"][name] = measure(name, RECIPES[name], work, args.long_tokens)
        print(f"{name}:\n{summary_table(data['runs'][name]['report'])}\n", flush=True)
    data["runs"] = {n: data["runs"][n] for n in RECIPES if n in data["runs"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data["runs"]))
    print(f"\nwrote {out}; runs in {work}")


def candidate_recipe(name: str) -> dict:
    """The demo recipe with the candidate's knobs, evaluated on the validation text."""
    import yaml

    from compress.recipe import Recipe

    data = yaml.safe_load((ROOT / RECIPES["demo"]).read_text())
    for item in data["stages"]:
        (stage, opts), = item.items()
        opts = dict(opts or {}, **CANDIDATES[name].get(stage, {}))
        if stage == "eval":
            opts["text"] = VAL_TEXT
        item[stage] = {k: v for k, v in opts.items() if v is not None}
    data["name"] = f"demo candidate {name}"
    return Recipe.from_dict(data, name).to_dict()


def _common(a: list[dict], b: list[dict]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _reuse(done: dict[str, list], stages: list[dict], run_dir: Path) -> bool:
    """Prepare ``run_dir`` to resume from the finished stages it can share; False if it starts afresh.

    An existing ``run_dir`` keeps its stages up to the first that differs; a new one copies
    those of the finished run sharing the most leading stages.
    """
    from compress.pipeline import stage_dir_name

    if run_dir.exists():
        src, best = run_dir, _common(stages, done.get(str(run_dir), []))
    else:
        best, src = max(((_common(stages, prev), Path(d)) for d, prev in done.items()), default=(0, None))
        if not best:
            return False
    keep = {stage_dir_name(i, next(iter(s))) for i, s in enumerate(stages[:best], 1)}
    drop = [n for n in os.listdir(src) if n == "report.json" or (n[:2].isdigit() and n not in keep)]
    if src == run_dir:
        for n in drop:
            shutil.rmtree(run_dir / n) if (run_dir / n).is_dir() else (run_dir / n).unlink()
    else:
        shutil.copytree(src, run_dir, ignore=lambda d, names: drop if Path(d) == src else [])
    return True


def main_choose(args: argparse.Namespace) -> None:
    import yaml

    from compress.recipe import Recipe

    work = Path(args.work or "/tmp/layercut-demo-choice")
    work.mkdir(parents=True, exist_ok=True)
    demo = Recipe.from_yaml(ROOT / RECIPES["demo"]).to_dict()
    bf16 = bf16_bytes(demo["model"])
    done = {str(p.parent): yaml.safe_load(p.read_text())["stages"] for p in sorted(work.glob("*/recipe.yaml"))}
    rows = []
    for name in CANDIDATES:
        recipe = candidate_recipe(name)
        run_dir, path = work / name, work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        reused = _reuse(done, recipe["stages"], run_dir)
        load = os.getloadavg()
        code, wall, cpu, _rss = run_child(["-q", "run", str(path), "-o", str(run_dir), *(["--resume"] * reused)],
                                          work / f"{name}.log", threads=1)
        if code != 0:
            sys.exit(f"error: candidate {name} failed (exit {code}); log: {work / name}.log")
        done[str(run_dir)] = recipe["stages"]
        report = json.loads((run_dir / "report.json").read_text())
        row = {"name": name, "knobs": CANDIDATES[name], "load_avg_before": list(load),
               "stage_cpu_s": {r["stage"]: r["cpu_s"] for r in report["stages"]},
               "stage_wall_s": {r["stage"]: r["wall_s"] for r in report["stages"]},
               "total_cpu_s": report["total_cpu_s"], "total_wall_s": report["total_wall_s"],
               **quality(report, run_dir, bf16)}
        row["fits"] = row["size_vs_bf16"] <= SIZE_LIMIT and row["total_cpu_s"] <= CPU_BUDGET_S
        # the pick must be the demo recipe itself, but for the eval text
        as_demo = json.loads(json.dumps(recipe).replace(VAL_TEXT, demo["stages"][-1]["eval"]["text"]))
        row["is_demo_recipe"] = as_demo["stages"] == demo["stages"]
        rows.append(row)
        print(f"{name}: val ppl {row['ppl']:.2f} ({row['ppl_ratio']:.3f}× {row['original_ppl']:.2f}), KL "
              f"{row['kl']:.4f}, size {100 * row['size_vs_bf16']:.1f}% of bf16, CPU {row['total_cpu_s']:.0f} s, "
              f"wall {row['total_wall_s']:.0f} s (load {load[0]:.1f})", flush=True)
    fitting = [r for r in rows if r["fits"]]
    pick = min(fitting, key=lambda r: r["ppl"]) if fitting else None
    out = Path(args.json_out or ROOT / "benchmarks/results/demo-choice.json")
    out.write_text(json.dumps({
        "rule": f"lowest perplexity on {VAL_TEXT} among candidates with weights <= {SIZE_LIMIT:.0%} of bf16 and "
                f"summed stage CPU time <= {CPU_BUDGET_S:.0f} s", "text": VAL_TEXT,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "candidates": rows,
        "pick": pick and pick["name"], "pick_is_demo_recipe": bool(pick and pick["is_demo_recipe"])}, indent=1) + "\n")
    print(f"pick: {pick and pick['name']} ({'is' if pick and pick['is_demo_recipe'] else 'is NOT'} "
          f"{RECIPES['demo']}); wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma list of recipes to (re)measure, kept with the others in the JSON: "
                                   + ", ".join(RECIPES))
    ap.add_argument("--work", help="where runs go (default: a new temp dir; --choose: /tmp/layercut-demo-choice, "
                                   "whose finished candidates are kept and resumed)")
    ap.add_argument("--long-tokens", type=int, default=8192, help="test tokens of the untimed second eval (0: none)")
    ap.add_argument("--json-out", help="default: benchmarks/results/demo.json (--choose: demo-choice.json)")
    ap.add_argument("--from-json", help="only print the figures stored in this JSON")
    ap.add_argument("--choose", action="store_true", help="run the candidates on brown-val and pick the demo's settings")
    args = ap.parse_args()
    if args.from_json:
        print(table(json.loads(Path(args.from_json).read_text())["runs"]))
    elif args.choose:
        main_choose(args)
    else:
        args.json_out = args.json_out or str(ROOT / "benchmarks/results/demo.json")
        main_measure(args)


if __name__ == "__main__":
    main()
