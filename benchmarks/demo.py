"""The two example recipes measured side by side, and how the demo's settings were chosen.

Run (both recipes, each followed by a longer test eval; about 7 minutes on 2 free cores)::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/demo.py            # -> benchmarks/results/demo.json
    .venv/bin/python benchmarks/demo.py --from-json benchmarks/results/demo.json   # the table in docs/results/demo.md
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/demo.py --choose   # -> benchmarks/results/demo-choice.json

Measuring: converts the bundled model first if it is not cached (timed apart as ``convert_s``),
then runs ``python -m layercut.cli -q run RECIPE -o RUN_DIR`` for each of ``RECIPES`` in one
child process (the CLI's own threads unless ``--threads``) and takes its wall time, CPU time and
peak RSS from ``os.wait4``, with the load average before and after. Size: the output's
safetensors bytes against the source in bf16 (2 bytes per parameter of the source, as its eval
counts them: the tied embedding once). Perplexity and KL: the run's own eval stage (``bundled:brown-test``),
then, untimed, ``--long-tokens`` test tokens at ctx 512, so a short window cannot flatter them.

``plain-4bit`` is the baseline the demo must beat at no more bytes: its quantize stage alone.

Choosing (the former demo's prune + LoRA heal + mixed-bit settings; the current demo's scale-tuning
settings were chosen by ``benchmarks/heal_scales.py --text bundled:brown-val``): runs each of ``CANDIDATES`` (the demo recipe with those knobs set) at one thread with
its eval stage on ``bundled:brown-val``, reusing the finished leading stages of earlier candidates
(copied and resumed); picks the lowest validation perplexity among those within the limits below
and says whether the pick is the demo recipe.
"""

from __future__ import annotations

import argparse
import json
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

RECIPES = {"demo": "recipes/smollm2-demo.yaml", "plain-4bit": "recipes/smollm2-4bit.yaml",
           "prune-heal": "recipes/smollm2-prune-heal.yaml", "aggressive": "recipes/smollm2-aggressive.yaml"}
VAL_TEXT = "bundled:brown-val"
SIZE_LIMIT = 0.45  # weight bytes / bf16 bytes of the source
PPL_LIMIT = 1.25  # perplexity / the original's
WALL_LIMIT_S = 300.0
# What a candidate may spend: its stages' CPU time summed, run at one thread (--choose runs them
# so), within 90% of the wall limit, the rest left for start-up. One thread's CPU time is close
# to the work itself on a shared machine (two threads contending for busy cores spin and inflate
# it), and a run that fits it fits the limit even with one core free.
CPU_BUDGET_S = 0.9 * WALL_LIMIT_S
# The knobs tried for the demo, each set explicitly (a candidate does not depend on the demo
# recipe's current values for them). 576 input features rule out group size 128, and 4-bit g32
# is the bundled model's own Q4_1 grid, so every candidate uses group size 64.
Q4 = {"bits": 4, "avg_bits": None, "candidates": None, "sensitivity": None}
MIX5 = {"bits": None, "avg_bits": 5.0, "candidates": [4, 8], "sensitivity": "loss"}
MIX52 = {**MIX5, "avg_bits": 5.2}  # 27 blocks leave room for 5.2 bits within the same bytes


def _candidate(drop: int, heal_steps: int, quant: dict, quant_samples: int) -> dict:
    return {"prune": {"drop": drop}, "heal": {"steps": heal_steps}, "quantize": {**quant, "samples": quant_samples}}


CANDIDATES: dict[str, dict] = {
    "drop2-heal24-q4": _candidate(2, 24, Q4, 16),
    "drop2-heal24-q4-calib32": _candidate(2, 24, Q4, 32),
    "drop2-heal24-mix5": _candidate(2, 24, MIX5, 16),
    "drop2-heal24-mix5-calib32": _candidate(2, 24, MIX5, 32),
    "drop2-heal24-mix5-calib64": _candidate(2, 24, MIX5, 64),
    "drop2-heal48-mix5": _candidate(2, 48, MIX5, 16),
    "drop2-heal48-mix5-calib32": _candidate(2, 48, MIX5, 32),
    "drop3-heal24-mix5.2": _candidate(3, 24, MIX52, 16),
}


def run_child(args: list[str], log: Path, threads: int | None = None) -> tuple[int, float, float, float]:
    """Run ``python -m layercut.cli ARGS`` in ROOT; (exit code, wall s, CPU s, peak RSS MiB).

    ``threads``: OMP_NUM_THREADS for the child (none: the CLI's own setting, all cores).
    """
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with open(log, "a") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "layercut.cli", *args], cwd=ROOT, stdout=fh,
                                stderr=subprocess.STDOUT, env=env)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    # ru_maxrss is in KiB on Linux
    return os.waitstatus_to_exitcode(status), wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def ppl_figures(model: dict, base: dict) -> dict:
    """An eval report's perplexity, against the reference's, and KL."""
    return {"text": model["text"], "tokens": model["tokens"], "ctx": model["ctx"], "ppl": model["ppl"],
            "original_ppl": base["ppl"], "ppl_ratio": model["ppl"] / base["ppl"], "kl": model["kl"]}


def quality(report: dict, run_dir: Path) -> dict:
    """Size, depth, bits and the eval stage's figures of a finished run (its reference: the source)."""
    stages = {r["stage"]: r for r in report["stages"]}
    ev = stages["eval"]["report"]
    model, base = ev["model"], ev["baseline"]
    bf16 = 2 * base["params"]  # the source's parameters (a tied embedding once), 2 bytes each
    q = stages["quantize"]["report"] if "quantize" in stages else {}
    return {
        "blocks": stages["prune"]["report"]["num_layers_after"] if "prune" in stages else None,
        "removed": stages["prune"]["report"]["layers"] if "prune" in stages else [],
        "bits_per_weight": q.get("avg_bits"),  # scales and zeros included
        "bytes": model["bytes"], "bf16_bytes": bf16, "size_vs_bf16": model["bytes"] / bf16,
        **ppl_figures(model, base), "final_model": str(run_dir / report["final_model"]),
    }


def measure(name: str, recipe: str, work: Path, long_tokens: int, threads: int | None) -> dict:
    from layercut.compress.workflow.recipe import Recipe

    run_dir, log = work / name, work / f"{name}.log"
    load_before = os.getloadavg()
    code, wall, cpu, rss = run_child(["-q", "run", recipe, "-o", str(run_dir)], log, threads)
    load_after = os.getloadavg()
    if code != 0:
        sys.exit(f"error: the {name} run failed (exit {code}); log: {log}")
    report = json.loads((run_dir / "report.json").read_text())
    model = Recipe.from_yaml(ROOT / recipe).model
    result = {
        "command": f"{f'OMP_NUM_THREADS={threads} ' if threads else ''}layercut run {recipe} -o RUN_DIR",
        "threads": threads or "CLI default", "load_avg_before": list(load_before),
        "load_avg_after": list(load_after), "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss,
        **quality(report, run_dir),
    }
    if long_tokens:
        out = work / f"{name}-long.json"
        code, wall, _cpu, _rss = run_child(["-q", "eval", result["final_model"], "--reference", model,
                                            "--max-tokens", str(long_tokens), "--ctx", "512", "-o", str(out)], log,
                                           threads)
        if code != 0:
            sys.exit(f"error: the long eval of {name} failed (exit {code}); log: {log}")
        ev = json.loads(out.read_text())
        result["long_eval"] = {**ppl_figures(ev["model"], ev["baseline"]), "wall_s": wall}
    result["report"] = report
    return result


def table(results: dict) -> str:
    rows = ["| recipe | blocks | bits/weight | weights MB (of bf16) | test ppl (original) | × original | KL "
            "| long eval ppl (original) | × original | wall | CPU s | peak RSS GiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for name, r in results.items():
        long = r.get("long_eval") or {}
        lp = f"{long['ppl']:.2f} ({long['original_ppl']:.2f}) | {long['ppl_ratio']:.2f}×" if long else "– | –"
        rows.append(f"| `{RECIPES.get(name, name)}` | {r['blocks'] or 'all'} | {r['bits_per_weight']:.2f} "
                    f"| {r['bytes'] / 1e6:.1f} ({100 * r['size_vs_bf16']:.1f}%) "
                    f"| {r['ppl']:.2f} ({r['original_ppl']:.2f}) | {r['ppl_ratio']:.2f}× | {r['kl']:.3f} | {lp} "
                    f"| {int(r['wall_s'] // 60)} min {r['wall_s'] % 60:.0f} s | {r['cpu_s']:.0f} "
                    f"| {r['peak_rss_mb'] / 1024:.1f} |")
        notes.append(f"{name}: eval stage {r['tokens']:,} tokens of `{r['text']}` at ctx {r['ctx']}"
                     + (f", long eval {long['tokens']:,} at ctx {long['ctx']}" if long else "")
                     + f"; threads {r.get('threads', 'CLI default')}; load average {r['load_avg_before'][0]:.1f}"
                     " before the run.")
    return "\n".join(rows) + "\n\n" + " ".join(notes)


def choice_table(choice: dict) -> str:
    rows = ["| candidate | val ppl | × original | KL | weights of bf16 | CPU s (1 thread) | within limits |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for c in choice["candidates"]:
        rows.append(f"| {'**' * (c['name'] == choice['pick'])}{c['name']}{'**' * (c['name'] == choice['pick'])} "
                    f"| {c['ppl']:.2f} | {c['ppl_ratio']:.3f}× | {c['kl']:.3f} | {100 * c['size_vs_bf16']:.1f}% "
                    f"| {c['total_cpu_s']:.0f} | {'yes' if c['fits'] else 'no'} |")
    first = choice["candidates"][0]
    return "\n".join(rows) + (f"\n\nOriginal: {first['original_ppl']:.2f} on {first['tokens']:,} tokens of "
                              f"`{first['text']}` at ctx {first['ctx']}. Rule: {choice['rule']}.")


def main_measure(args: argparse.Namespace) -> None:
    from layercut.compress.workflow.pipeline import summary_table
    from layercut.compress.workflow.recipe import Recipe

    names = args.only.split(",") if args.only else list(RECIPES)
    out = Path(args.json_out)
    data = json.loads(out.read_text()) if out.is_file() else {}  # merge: recipes not rerun stay as stored
    data.setdefault("runs", {})
    model = Recipe.from_yaml(ROOT / RECIPES[names[0]]).model
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"from layercut.compress.io.models import resolve_model; resolve_model({model!r})"],
                   cwd=ROOT, check=True)
    data.update(machine=f"{platform.machine()}, {os.cpu_count()} CPU cores", convert_s=time.perf_counter() - t0)
    work = Path(args.work or tempfile.mkdtemp(prefix="layercut-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (work / name).exists():
            sys.exit(f"error: {work / name} exists; give a fresh --work")
        data["runs"][name] = measure(name, RECIPES[name], work, args.long_tokens, args.threads)
        print(f"{name}:\n{summary_table(data['runs'][name]['report'])}\n", flush=True)
    data["runs"] = {n: data["runs"][n] for n in RECIPES if n in data["runs"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data["runs"]))
    print(f"\nwrote {out}; runs in {work}")


def candidate_recipe(name: str) -> dict:
    """The demo recipe with the candidate's knobs, evaluated on the validation text."""
    import yaml

    from layercut.compress.workflow.recipe import Recipe

    data = yaml.safe_load((ROOT / RECIPES["prune-heal"]).read_text())  # the former demo's knobs
    for item in data["stages"]:
        (stage, opts), = item.items()
        opts = dict(opts or {}, **CANDIDATES[name].get(stage, {}))
        if stage == "eval":
            opts["text"] = VAL_TEXT
        item[stage] = {k: v for k, v in opts.items() if v is not None}
    data["name"] = f"demo candidate {name}"
    return Recipe.from_dict(data, name).to_dict()


def _reuse(done: dict[str, list], stages: list[dict], run_dir: Path) -> bool:
    """Prepare ``run_dir`` to resume from the finished stages it can share; False if it starts afresh.

    An existing ``run_dir`` keeps its stages up to the first that differs; a new one copies
    those of the finished run sharing the most leading stages.
    """
    from layercut.compress.workflow.pipeline import stage_dir_name

    def common(prev: list[dict]) -> int:
        return next((i for i, (a, b) in enumerate(zip(stages, prev)) if a != b), min(len(stages), len(prev)))

    best, src = (common(done.get(str(run_dir), [])), run_dir) if run_dir.exists() else \
        max(((common(prev), Path(d)) for d, prev in done.items()), default=(0, None))
    if src is None or (not best and src != run_dir):
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

    from layercut.compress.workflow.recipe import Recipe

    work = Path(args.work or "/tmp/layercut-demo-choice")
    work.mkdir(parents=True, exist_ok=True)
    demo = Recipe.from_yaml(ROOT / RECIPES["prune-heal"]).to_dict()
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
               **quality(report, run_dir)}
        row["fits"] = (row["size_vs_bf16"] <= SIZE_LIMIT and row["ppl_ratio"] <= PPL_LIMIT
                       and row["total_cpu_s"] <= CPU_BUDGET_S)
        recipe["stages"][-1]["eval"]["text"] = demo["stages"][-1]["eval"]["text"]
        row["is_demo_recipe"] = recipe["stages"] == demo["stages"]  # but for the eval text
        rows.append(row)
        print(f"{name}: val ppl {row['ppl']:.2f} ({row['ppl_ratio']:.3f}× {row['original_ppl']:.2f}), KL "
              f"{row['kl']:.4f}, size {100 * row['size_vs_bf16']:.1f}% of bf16, CPU {row['total_cpu_s']:.0f} s, "
              f"wall {row['total_wall_s']:.0f} s (load {load[0]:.1f})", flush=True)
    fitting = [r for r in rows if r["fits"]]
    pick = min(fitting, key=lambda r: r["ppl"]) if fitting else None
    out = Path(args.json_out or ROOT / "benchmarks/results/demo-choice.json")
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    write_merged(out, {
        "rule": f"lowest perplexity on {VAL_TEXT} among candidates with weights <= {SIZE_LIMIT:.0%} of bf16, "
                f"perplexity <= {PPL_LIMIT}x the original's and summed stage CPU time at one thread <= "
                f"{CPU_BUDGET_S:.0f} s", "text": VAL_TEXT,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "candidates": rows,
        "pick": pick and pick["name"], "pick_is_demo_recipe": bool(pick and pick["is_demo_recipe"])})
    print(f"pick: {pick and pick['name']} ({'is' if pick and pick['is_demo_recipe'] else 'is NOT'} "
          f"{RECIPES['prune-heal']}); wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma list of recipes to (re)measure, kept with the others in the JSON: "
                                   + ", ".join(RECIPES))
    ap.add_argument("--work", help="where runs go (default: a new temp dir; --choose: /tmp/layercut-demo-choice, "
                                   "whose finished candidates are kept and resumed)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the measured runs (default: the CLI's own, "
                                                "all cores; 1 on a machine whose other jobs hold a core)")
    ap.add_argument("--long-tokens", type=int, default=8192, help="test tokens of the untimed second eval (0: none)")
    ap.add_argument("--json-out", help="default: benchmarks/results/demo.json (--choose: demo-choice.json)")
    ap.add_argument("--from-json", help="only print the figures stored in this JSON (demo.json or demo-choice.json)")
    ap.add_argument("--choose", action="store_true", help="run the candidates on brown-val and pick the demo's settings")
    args = ap.parse_args()
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        print(choice_table(data) if "candidates" in data else table(data["runs"]))
    elif args.choose:
        main_choose(args)
    else:
        args.json_out = args.json_out or str(ROOT / "benchmarks/results/demo.json")
        main_measure(args)


if __name__ == "__main__":
    main()
