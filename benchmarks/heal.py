"""Healing SmolLM2-135M after removing 8 of 30 blocks: held-out ppl vs LoRA-KD steps and CPU time.

Run (CPU; hours on a loaded 2-core machine, see docs/results/heal.md)::

    # choices (lr, loss, rank) on the validation half of the held-out Brown files
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/heal.py --threads 1 --text bundled:brown-val
    # the reported curve on the test half, at the chosen defaults
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/heal.py --threads 1
    # re-render the markdown from stored results, no training
    .venv/bin/python benchmarks/heal.py --from-json benchmarks/results/heal.json

Prints a table, writes ``benchmarks/results/heal.json`` and ``docs/results/heal.md`` (for
``--text bundled:brown-val``: ``heal-brown-val.json`` and ``docs/results/heal-brown-val.md``).

Students: the angular span (Gromov et al.) of 8 blocks chosen with ``layercut.compress.depth.prune``
on ``--calib-samples`` × ``--calib-seq-len`` calibration tokens, removed by plain drop and
by lstsq linear replacement (ReplaceMe). Each is healed with ``layercut.heal.train.heal_model``
(LoRA through peft, token-level KD from the original: by default on the teacher's top-64 log-probs,
cached in one teacher pass before training, as each run's recorded ``teacher_topk`` says); perplexity on ``--text``
(default ``bundled:brown-test``, ctx 512, the first ``--max-tokens`` tokens) is measured before
healing and at the listed steps of one run (constant LR after a 10-step warmup, so the
step-N point is what an N-step run at that LR gives; ``schedule=cosine`` in a run's overrides
decays over that run's own steps, so only its last point is an N-step run). Results merge into
``--json-out``: stored runs of the same setup that this invocation does not rerun are kept. All runs draw from the same
``--samples`` heal sequences in the same order. Times exclude the evaluations; "CPU s" is
``time.process_time`` of the whole process (all threads), "wall s" is elapsed time.

"Gap recovered" is given two ways: in log-perplexity (the headline), (log ppl_before − log
ppl) / (log ppl_before − log ppl_original), i.e. the share of the excess mean token NLL
removed, which is what the KD loss works on; and in linear perplexity, (ppl_before − ppl) /
(ppl_before − ppl_original), which flatters early steps because perplexity is convex in the
NLL (25 steps: 81% linear, 59% log on the stored run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from layercut.calibrate import DEFAULT_CALIB_TEXT, DEFAULT_EVAL_TEXT  # noqa: E402
from layercut.compress.eval.evaluate import evaluate  # noqa: E402
from layercut.compress.io.models import load_model  # noqa: E402
from layercut.compress.workflow.stages.prune import prune
from layercut.heal import train as heal_train  # noqa: E402
from layercut.heal.config import HealConfig  # noqa: E402
from layercut.heal.data import build_topk_cache  # noqa: E402
from layercut.heal.train import heal_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_runs(text: str) -> list[dict]:
    """``name:variant:steps1/steps2:key=value,key=value;...`` -> run specs."""
    runs = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, variant, points, *rest = item.split(":")
        overrides = {}
        for kv in filter(None, (rest[0] if rest else "").split(",")):
            key, value = kv.split("=")
            overrides[key] = value if key in ("loss", "targets", "schedule") else float(value) if "." in value or "e" in value else int(value)
        runs.append({"name": name, "variant": variant, "points": [int(p) for p in points.split("/")],
                     "overrides": overrides})
    return runs


# Reported on the test split: the default recipe's curve, and the lstsq student.
# Three seeds each (LoRA init and heal-data order): the table gives mean and min–max.
TEST_RUNS = ("main:drop:25/50/100:seed=0;main:drop:25/50/100:seed=1;main:drop:25/50/100:seed=2;"
             "lstsq:lstsq:25/50:seed=0;lstsq:lstsq:25/50:seed=1;lstsq:lstsq:25/50:seed=2")
# Choices (lr, loss, rank) are made on the validation split; "main" is the baseline they are compared to.
VAL_RUNS = ("main:drop:50:;"
            "lm-loss:drop:50:loss=lm;"
            "lr-1.5e-4:drop:50:lr=1.5e-4;"
            "lr-2e-3:drop:50:lr=2e-3;"
            "rank-4:drop:50:rank=4")


def recovered(ppl_before: float, ppl: float, ppl_original: float) -> dict[str, float | None]:
    """Share of the gap to the original closed: in log-perplexity (mean NLL) and in linear perplexity."""
    gap, log_gap = ppl_before - ppl_original, math.log(ppl_before) - math.log(ppl_original)
    return {"recovered_log": (math.log(ppl_before) - math.log(ppl)) / log_gap if log_gap else None,
            "recovered": (ppl_before - ppl) / gap if gap else None}


def default_outputs(text: str) -> tuple[str, str]:
    if text in (DEFAULT_EVAL_TEXT, "bundled:brown-heldout"):  # heldout: results from before the val/test split
        return str(ROOT / "benchmarks/results/heal.json"), str(ROOT / "docs/results/heal.md")
    slug = text.split(":", 1)[-1]
    return str(ROOT / f"benchmarks/results/heal-{slug}.json"), str(ROOT / f"docs/results/heal-{slug}.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:smollm2-135m")
    ap.add_argument("--drop", type=int, default=8)
    ap.add_argument("--select", default="angular", help="how the removed blocks are chosen (a `layercut prune "
                                                         "--select` method; default %(default)s)")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--samples", type=int, default=600, help="heal sequences shared by all runs")
    ap.add_argument("--runs", help="name:variant:steps/steps:key=value;... (default: the split's run set)")
    ap.add_argument("--text", default=DEFAULT_EVAL_TEXT,
                    help="evaluation text (default %(default)s; bundled:brown-val for the choice runs)")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine 2 threads ran ~5x slower per step)")
    ap.add_argument("--workdir", help="where the pruned students go (default: a temp dir)")
    ap.add_argument("--json-out", help="default: benchmarks/results/heal.json (test split) or heal-<text>.json")
    ap.add_argument("--md-out", help="default: docs/results/heal.md (test split) or results-heal-<text>.md")
    ap.add_argument("--from-json", help="only re-render the markdown from a previous JSON result")
    args = ap.parse_args()
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        md = markdown(report)
        Path(args.md_out or report.get("md_out") or default_outputs(report["eval"]["text"])[1]).write_text(md)
        print(md)
        return
    json_default, md_default = default_outputs(args.text)
    args.json_out, args.md_out = args.json_out or json_default, args.md_out or md_default
    torch.set_num_threads(args.threads)
    runs_text = args.runs or (TEST_RUNS if args.text == DEFAULT_EVAL_TEXT else VAL_RUNS)
    runs = parse_runs(runs_text)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="heal-bench-"))
    t_start = time.perf_counter()

    teacher, tok = load_model(args.model)
    ev = dict(text=args.text, ctx=args.ctx, max_tokens=args.max_tokens, progress=False)
    ppl_teacher = evaluate(teacher, tok, **ev).ppl
    print(f"original ppl {ppl_teacher:.3f}", flush=True)

    # The blocks are chosen once (--select; block 0 kept since linear replacement needs it) and both
    # students remove the same blocks.
    students: dict[str, dict] = {}
    want_lstsq = any(r["variant"] == "lstsq" for r in runs)
    first, second = ("lstsq", "drop") if want_lstsq else ("drop", None)
    t0 = time.perf_counter()
    if not (work / first).exists():
        prune(args.model, work / first, drop=args.drop, select=args.select, replace="none" if first == "drop" else first,
              samples=args.calib_samples, seq_len=args.calib_seq_len, progress=False)
    layers = json.loads((work / first / "layercut_prune.json").read_text())["layers"]
    students[first] = {"dir": work / first, "layers": layers, "prune_s": time.perf_counter() - t0}
    if second is not None:
        t0 = time.perf_counter()
        if not (work / second).exists():
            prune(args.model, work / second, layers=layers, progress=False)
        students[second] = {"dir": work / second, "layers": layers, "prune_s": time.perf_counter() - t0}
    students = {k: students[k] for k in ("drop", "lstsq") if k in students}
    for name, s in students.items():
        model, _ = load_model(s["dir"])
        s["ppl"] = evaluate(model, tok, **ev).ppl
        print(f"{name}: removed blocks {layers}, ppl {s['ppl']:.3f}", flush=True)
        del model

    # Merge, never drop: runs stored in --json-out that this invocation does not rerun (same name,
    # student and seed) are kept, provided they were measured on the same setup.
    setup = {"model": args.model, "removed_blocks": layers, "select": args.select,
             "eval": {"text": args.text, "ctx": args.ctx, "max_tokens": args.max_tokens},
             "heal": {"seq_len": args.seq_len, "batch": args.batch, "samples": args.samples, "data": DEFAULT_CALIB_TEXT,
                      "offset": HealConfig().offset}}
    kept: list[dict] = []
    if Path(args.json_out).is_file():
        stored = json.loads(Path(args.json_out).read_text())
        differ = [k for k, v in setup.items() if stored.get(k, "angular" if k == "select" else None) != v]
        if differ:
            sys.exit(f"error: {args.json_out} holds runs of another setup ({', '.join(differ)} differ); "
                     "give another --json-out")
        rerun = {(r["name"], r["variant"], r["overrides"].get("seed", 0)) for r in runs}
        kept = [r for r in stored.get("runs", []) if (r["name"], r["variant"], r["config"].get("seed", 0)) not in rerun]
        students = {**{k: v for k, v in stored.get("students", {}).items() if k not in students}, **students}

    def write_report(final: bool) -> None:
        """Write JSON and markdown; called after every run so an interrupted benchmark keeps what it has."""
        report = {
            "model": args.model, "removed_blocks": layers, "select": args.select, "ppl_original": ppl_teacher,
            "students": {k: {kk: (str(vv) if isinstance(vv, Path) else vv) for kk, vv in v.items()}
                         for k, v in students.items()},
            "eval": {"text": args.text, "ctx": args.ctx, "max_tokens": args.max_tokens},
            "heal": {"seq_len": args.seq_len, "batch": args.batch, "samples": args.samples, "data": DEFAULT_CALIB_TEXT,
                     "offset": HealConfig().offset},
            "planned_runs": [f"{r['name']} seed={r['overrides'].get('seed', 0)}" for r in runs],
            "threads": args.threads, "machine": f"{os.cpu_count()}-core CPU, shared with other jobs",
            "runs": kept + results, "total_wall_s": time.perf_counter() - t_start,
            "command": "HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/heal.py " + shlex.join(sys.argv[1:]),
            "md_out": os.path.relpath(args.md_out, ROOT),  # where --from-json renders this JSON back to
        }
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
        md = markdown(report)
        Path(args.md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md_out).write_text(md)
        if final:
            print(md)

    results = []
    for run in runs:
        student_info = students[run["variant"]]
        steps = max(run["points"])
        base = dict(steps=steps, rank=args.rank, lr=args.lr, loss="kd", seq_len=args.seq_len, batch=args.batch,
                    samples=args.samples, schedule="constant", warmup=min(0.5, 10 / steps),
                    gradient_checkpointing=False, seed=0)
        cfg = HealConfig.parse({**base, **run["overrides"]})
        student, _ = load_model(student_info["dir"])
        record = {"name": run["name"], "variant": run["variant"], "config": cfg.model_dump(),
                  "ppl_before": student_info["ppl"], "points": []}
        clock = {"wall": time.perf_counter(), "cpu": time.process_time(), "eval_wall": 0.0, "eval_cpu": 0.0}
        record["cache_cpu_s"] = 0.0  # the one-off teacher top-K cache build, part of train_cpu_s

        def timed_cache(*a, record=record, **k):
            c0 = time.process_time()
            try:
                return build_topk_cache(*a, **k)
            finally:
                record["cache_cpu_s"] += time.process_time() - c0

        def at_step(step: int, loss: float, model, run=run, record=record, clock=clock) -> None:
            if step not in run["points"]:
                return
            w0, c0 = time.perf_counter(), time.process_time()
            train_wall = w0 - clock["wall"] - clock["eval_wall"]
            train_cpu = c0 - clock["cpu"] - clock["eval_cpu"]
            model.eval()
            ppl = evaluate(model, tok, **ev).ppl
            model.train()
            clock["eval_wall"] += time.perf_counter() - w0
            clock["eval_cpu"] += time.process_time() - c0
            point = {"step": step, "ppl": ppl, **recovered(record["ppl_before"], ppl, ppl_teacher),
                     "train_wall_s": train_wall, "train_cpu_s": train_cpu, "loss": loss}
            record["points"].append(point)
            write_report(final=False)
            print(f"{run['name']:>10} step {step:4d}  ppl {ppl:8.3f}  recovered {point['recovered_log']:.2f} (log), "
                  f"{point['recovered']:.2f} (linear)  "
                  f"wall {train_wall / 60:6.1f} min  cpu {train_cpu / 60:6.1f} min  loss {loss:.4f}", flush=True)

        results.append(record)
        heal_train.build_topk_cache = timed_cache
        try:
            result = heal_model(student, teacher, tok, cfg, progress=False, callback=at_step)
        finally:
            heal_train.build_topk_cache = build_topk_cache
        record.update(losses=result.losses, trainable_params=result.trainable_params, tokens=result.tokens)
        del student, result
        write_report(final=False)

    write_report(final=True)


def markdown(r: dict) -> str:
    head = r["runs"][0]["config"] if r["runs"] else {}
    text = r["eval"]["text"]
    role = {"bundled:brown-test": "the test split: reported, nothing chosen on it",
            "bundled:brown-val": "the validation split: where the defaults are chosen",
            "bundled:brown-heldout": "measured before the held-out files were split into val and test, on their "
                                     "union; the lr/loss choices below were made on these same tokens"}.get(text, "")
    ppl0 = r["ppl_original"]

    def gaps(before: float, p: dict) -> str:
        rec = recovered(before, p["ppl"], ppl0)  # recomputed from the ppls, so old JSONs render too
        return f"{100 * rec['recovered_log']:.0f}% | {100 * rec['recovered']:.0f}%"

    lines = [
        f"## Healing (LoRA KD) after removing {len(r['removed_blocks'])} blocks — {r['model']}",
        "",
        f"Removed blocks {r['removed_blocks']} ({SELECT_WORDS.get(r.get('select', 'angular'), r.get('select'))}, "
        f"`layercut prune --select {r.get('select', 'angular')}`). Perplexity on "
        f"`{text}`" + (f" ({role})" if role else "") + f", ctx {r['eval']['ctx']}, first {r['eval']['max_tokens']} "
        f"tokens (cut down to fit the CPU). Original ppl **{ppl0:.2f}**. Heal data: `{r['heal']['data']}` from "
        f"token {r['heal']['offset']:,} on, {r['heal']['samples']} sequences of {r['heal']['seq_len']} tokens, batch "
        f"{r['heal']['batch']}. Defaults below: LoRA rank {head.get('rank')} (alpha 2·rank) on all block linears, "
        f"loss {head.get('loss')} ({teacher_words(head)}), AdamW lr {head.get('lr'):g} {schedule_words(head)}, "
        f"{'' if head.get('gradient_checkpointing') else 'no '}gradient checkpointing, {r['threads']} torch "
        "thread(s). A run's settings that differ from these are named beside it.",
        "",
        f"Machine: {r['machine']}. Wall times are inflated and noisy when other jobs share it, and include any "
        "pause of the process; CPU time (`process_time`, the cost on an otherwise idle core) is the steadier "
        "figure. Times exclude the evaluations.",
        "",
        "Gap recovered, headline in log-perplexity: (log ppl_before − log ppl) / (log ppl_before − log "
        "ppl_original), the share of the excess mean token NLL removed; beside it the linear-perplexity form "
        "(ppl_before − ppl) / (ppl_before − ppl_original), which flatters early steps.",
        "",
        "| run | student | steps | ppl | gap recovered (log ppl) | (linear ppl) | train wall (min) | "
        "train CPU (min) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in r["students"].items():
        lines.append(f"| before healing | {name} | 0 | {s['ppl']:.2f} | 0% | 0% | – | – |")
    for run in r["runs"]:
        diff = {k: v for k, v in run["config"].items() if head.get(k) != v and k not in ("steps", "warmup")}
        label = run["name"] + (f" ({', '.join(f'{k}={v}' for k, v in diff.items())})" if diff else "")
        for p in run["points"]:
            lines.append(f"| {label} | {run['variant']} | {p['step']} | {p['ppl']:.2f} | "
                         f"{gaps(run['ppl_before'], p)} | {p['train_wall_s'] / 60:.1f} | {p['train_cpu_s'] / 60:.1f} |")
    lines += seed_summary(r)
    lines += paired_summary(r)
    lines += ["", "Half the gap in log-perplexity recovered (the linear form reaches half earlier):", ""]
    for run in r["runs"]:
        rec = [(p, recovered(run["ppl_before"], p["ppl"], ppl0)["recovered_log"]) for p in run["points"]]
        hit = next((p for p, g in rec if g is not None and g >= 0.5), None)
        best = max(rec, key=lambda t: t[1] if t[1] is not None else -1e9) if rec else None
        if hit is not None:
            lines.append(f"- **{run['name']}** ({run['variant']}): yes, by step {hit['step']} — "
                         f"{hit['train_cpu_s'] / 60:.1f} CPU-min, {hit['train_wall_s'] / 60:.1f} wall-min.")
        elif best is not None:
            lines.append(f"- **{run['name']}** ({run['variant']}): no, best {100 * best[1]:.0f}% of the gap "
                         f"at step {best[0]['step']} ({best[0]['train_cpu_s'] / 60:.1f} CPU-min).")
    done = {f"{run['name']} seed={run['config'].get('seed', 0)}" for run in r["runs"]}
    not_run = [n for n in r.get("planned_runs", []) if n not in done]
    if not_run:
        lines += ["", f"Planned but not (yet) run: {', '.join(not_run)}."]
    lines += per_step_lines(r)
    lines += ["", f"Reproduce: `{r['command']}` (total wall {r['total_wall_s'] / 3600:.1f} h). Re-render this page "
              "from the stored JSON: `.venv/bin/python benchmarks/heal.py --from-json JSON`.", ""]
    lines += NOTES
    return "\n".join(lines)


SELECT_WORDS = {"angular": "angular span", "block-influence": "block influence"}


def teacher_words(cfg: dict) -> str:
    """How the run's config used the teacher, from the recorded ``loss`` and ``teacher_topk``."""
    if cfg.get("loss") == "lm":
        return "next-token loss only, no teacher"
    kd = "KL(teacher ‖ student)" + (" + LM loss" if cfg.get("loss") == "kd+lm" else "")
    k = cfg.get("teacher_topk")
    if k:
        return f"{kd} on the teacher's top-{k} log-probs and tail mass, cached in one teacher pass before training"
    return f"{kd}, full teacher distributions, teacher run beside the student"


def schedule_words(cfg: dict) -> str:
    """The recorded schedule and warmup (warmup is a fraction of ``steps``; the trainer rounds it down)."""
    steps, warmup = cfg.get("steps") or 0, cfg.get("warmup") or 0.0
    n = int(warmup * steps)
    sched = {"constant": "constant", "cosine": "cosine decay to 0"}.get(cfg.get("schedule"), cfg.get("schedule"))
    return f"{sched} after a {n}-step linear warmup ({warmup:g} of {steps} steps)" if n else f"{sched}, no warmup"


def per_step_lines(r: dict) -> list[str]:
    """CPU seconds per step without the one-off teacher cache build.

    From the stored cache time where the run recorded it (``cache_cpu_s``); otherwise from the
    difference between two measured points of one run, which cancels the one-off cost; a run with
    one point and no recorded cache time cannot be separated and is listed apart.
    """
    tokens = f"{r['heal']['batch']} × {r['heal']['seq_len']} tokens"
    marginal, cached, mixed, no_teacher, how = [], [], [], [], set()
    for run in r["runs"]:
        pts = run["points"]
        if not pts:
            continue
        if run["config"].get("loss") == "lm":
            no_teacher.append((run, pts[-1]["train_cpu_s"] / pts[-1]["step"]))
        elif "cache_cpu_s" in run:
            how.add("the run's recorded cache time subtracted")
            p = pts[-1]
            marginal.append((p["train_cpu_s"] - run["cache_cpu_s"]) / p["step"])
            if run["cache_cpu_s"]:
                cached.append(run["cache_cpu_s"])
        elif len(pts) > 1:
            how.add("from the CPU time between a run's last two measured points, which cancels the one-off cost")
            a, b = pts[-2], pts[-1]
            marginal.append((b["train_cpu_s"] - a["train_cpu_s"]) / (b["step"] - a["step"]))
            topk = run["config"].get("teacher_topk") and run["config"].get("loss") != "lm"
            if topk:
                cached.append(a["train_cpu_s"] - a["step"] * marginal[-1])
        else:
            mixed.append((run, pts[-1]["train_cpu_s"] / pts[-1]["step"]))
    out = []
    if marginal:
        out += ["", f"CPU time per step ({tokens}, student forward/backward on the cached teacher targets), without "
                f"the one-off teacher cache build ({'; '.join(sorted(how))}): {min(marginal):.1f}–{max(marginal):.1f} s."]
        if cached:
            out.append(f"The cache build itself (one teacher pass over all {r['heal']['samples']} heal sequences): "
                       f"{min(cached):.0f}–{max(cached):.0f} CPU-s per run, included in the train CPU columns above.")
    if mixed:
        out += ["", f"CPU time per step ({tokens}) of the distillation runs, **including** the one-off teacher cache "
                f"build (one teacher pass over all {r['heal']['samples']} heal sequences), which runs with one measured "
                "point and no recorded cache time cannot separate: "
                + ", ".join(f"{run['name']} {v:.1f} s" for run, v in mixed) + "."]
    if no_teacher:
        out += ["", "Without a teacher (LM loss, no cache), CPU time per step: "
                + ", ".join(f"{run['name']} {v:.1f} s" for run, v in no_teacher) + "."]
    return out


def paired_summary(r: dict) -> list[str]:
    """Each run name against the first one, seed by seed (same student, last step): Δ log ppl."""
    last = {}
    for run in r["runs"]:
        if run["points"]:
            p = run["points"][-1]
            last[(run["name"], run["variant"], p["step"], run["config"].get("seed", 0))] = p["ppl"]
    if not r["runs"]:
        return []
    base = r["runs"][0]["name"]
    lines = []
    for name in dict.fromkeys(run["name"] for run in r["runs"]):
        if name == base:
            continue
        d = [math.log(v) - math.log(last[(base, var, step, seed)]) for (n, var, step, seed), v in last.items()
             if n == name and (base, var, step, seed) in last]
        if len(d) > 1:
            sd = statistics.stdev(d)
            lines.append(f"| {name} − {base} | {len(d)} | {sum(d) / len(d):+.4f} | {min(d):+.4f} – {max(d):+.4f} | "
                         f"{sd:.4f} | {sum(x < 0 for x in d)} of {len(d)} |")
    if not lines:
        return []
    return ["", f"Paired by seed against **{base}** (same student and steps, last point): Δ log ppl = log ppl(run) − "
            f"log ppl({base}); negative is better.", "",
            "| runs | seeds | mean Δ log ppl | min – max | sd | seeds where the run is better |",
            "|---|---:|---:|---:|---:|---:|", *lines]


def seed_summary(r: dict) -> list[str]:
    """Mean and min–max over seeds of each (run name, student, step) that ran with more than one seed."""
    ppl0, cells = r["ppl_original"], {}
    for run in r["runs"]:
        for p in run["points"]:
            rec = recovered(run["ppl_before"], p["ppl"], ppl0)
            cells.setdefault((run["name"], run["variant"], p["step"]), []).append(
                (run["config"].get("seed", 0), p["ppl"], rec["recovered_log"], rec["recovered"], p["train_cpu_s"]))
    multi = {k: v for k, v in cells.items() if len({c[0] for c in v}) > 1}
    if not multi:
        return []
    lines = ["", "Over seeds (LoRA init and data order; mean, min–max in brackets):", "",
             "| run | student | steps | seeds | ppl | gap recovered (log ppl) | (linear ppl) | train CPU (min) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (name, variant, step), v in multi.items():
        def stat(i: int, pct: bool = False, fmt: str = ".2f", v: list = v) -> str:
            xs = [c[i] * (100 if pct else 1) for c in v]
            f = ".0f" if pct else fmt
            return f"{sum(xs) / len(xs):{f}} [{min(xs):{f}}–{max(xs):{f}}]" + ("%" if pct else "")
        lines.append(f"| {name} | {variant} | {step} | {len(v)} | {stat(1)} | {stat(2, True)} | {stat(3, True)} | "
                     f"{sum(c[4] for c in v) / len(v) / 60:.1f} |")
    return lines


NOTES = [
    "### Method notes",
    "",
    "- **Data.** `bundled:brown-calib`, windows drawn by `calibration_batch(..., offset=300000)`: every window "
    "starts at token 300,000 or later of the EOS-joined stream, while a default calibration draw (128 × 512, "
    "offset 0) only reads the first 264,704 tokens — healing never reuses a calibration sequence and never "
    "sees the held-out text (`bundled:brown-heldout`, `-val` and `-test` are refused as heal data). BOS is "
    "prepended to each window.",
    "- **Loss.** Token-level KL(teacher ‖ student) over every non-pad position, ×τ² (Hinton et al. 2015). "
    "`--teacher-topk K` (default 64; each run's recorded `teacher_topk` says which form it used, and the "
    "settings line above is rendered from it; `--teacher-topk 0` runs the full teacher beside the student) "
    "caches the teacher's top-K log-probs and the log of the remaining mass once, then "
    "trains on the exact KL of the two distributions coarse-grained to K + 1 outcomes (the K tokens + one tail "
    "bucket). That is a lower bound of the full KL (log-sum inequality), equal at K = V; the student learns the "
    "teacher's top-K shape and tail mass, not the shape inside the tail. Cache memory: N·L·(8K + 4) bytes. "
    "Not measured here (tested against the full KL on tiny models).",
    "- **Threads.** On this shared 2-core machine one torch thread ran a SmolLM2 step ~5× faster than two "
    "(OpenMP barriers stall when the other cores are busy); set `OMP_NUM_THREADS=1` when the machine is loaded.",
    "- **Quantized input.** Quantized linears (anything with `dequantize()`) are replaced by dense ones before "
    "LoRA; the adapter is always saved and the merged dense weights need a re-quantize.",
    "- **Data-parallel.** `accelerate launch --multi_gpu --num_processes N -m layercut.cli heal ...`; `--batch-size` is "
    "per process. Tested on CPU as 2 gloo processes against 1 process at the same global batch "
    "(`tests/test_heal_ddp.py`).",
    "",
]


if __name__ == "__main__":
    main()
