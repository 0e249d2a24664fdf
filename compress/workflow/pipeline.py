"""Run a recipe stage by stage into a resumable run directory.

Usage::

    layercut run recipes/smollm2-demo.yaml -o runs/demo            # fresh run
    layercut run recipes/smollm2-demo.yaml -o runs/demo --resume   # continue after a crash

    from layercut.compress.workflow.pipeline import run_recipe
    report = run_recipe(Recipe.from_yaml("recipes/smollm2-demo.yaml"), "runs/demo")

Layout of ``OUT``::

    recipe.yaml            the resolved recipe (every default filled in)
    run.log                log of every attempt
    report.json            wall time, peak RSS and quality figures of every stage
    01-prune/              one folder per stage: stage.json, log.txt, artifacts, model/
    02-heal/model/ ...
    04-export/model/       the release checkpoint (card, recipe.yaml, report.json inside)

Every stage reads its input checkpoint from disk and writes into a hidden temporary
folder that is renamed to ``NN-name`` only when complete (with ``stage.json`` inside),
so a run killed at any point (even SIGKILL) resumes with ``--resume`` from the first
unfinished stage. Given the same seed, the resumed run's final checkpoint is
byte-identical to an uninterrupted one: stages are deterministic functions of (input
files, config, seed), the checkpoint holds no timings (those live in ``OUT/report.json``),
and only README.md differs, in its speed row.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from layercut.compress.core.devices import resolve_device
from layercut.compress.core.errors import GateFailed, LayercutError
from layercut.compress.core.resources import PeakRSS
from layercut.compress.core.save import atomic_dir, check_output_dir
from layercut.compress.io.models import resolve_model
from layercut.compress.workflow.planner.search import plan
from layercut.compress.workflow.recipe import Recipe
from layercut.compress.workflow.stages import stage_module
from layercut.compress.workflow.stages.base import VOLATILE, RunEnv, quality_report
from layercut.export.card import write_card
from layercut.export.export import probe_writable

log = logging.getLogger("layercut.run")
KILL_ENV = "LAYERCUT_KILL_AT"  # test hook: SIGKILL this process at a named point (see _hook)


def stage_dir_name(index: int, name: str) -> str:
    return f"{index:02d}-{name}"


def _hook(point: str) -> None:
    """Crash-test hook: ``LAYERCUT_KILL_AT=stage-2-written`` SIGKILLs the run right there
    (``stage-2-written:INT`` sends SIGINT instead, i.e. Ctrl-C).

    Points: ``stage-K-start``, ``stage-K-written`` (files in the temp folder, not renamed),
    ``stage-K-renamed`` (renamed, report not updated), ``finalize``.
    """
    wanted = os.environ.get(KILL_ENV)
    if wanted and wanted.split(":")[0] == point:
        sig = signal.SIGINT if wanted.endswith(":INT") else signal.SIGKILL
        os.kill(os.getpid(), sig)


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for torch
        pass


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def prepare_run_dir(recipe: Recipe, out: Path, resume: bool) -> None:
    """Refuse an existing OUT unless resuming the same recipe; clean stale temp folders."""
    recipe_file = out / "recipe.yaml"
    if out.exists() and not resume:
        raise LayercutError(f"output {out} already exists (pass --resume to continue that run, or remove it)")
    if out.exists():
        if not out.is_dir():
            raise LayercutError(f"output {out} exists and is not a directory")
        if recipe_file.is_file():
            _check_resumable(Recipe.from_yaml(recipe_file), recipe, out)
        elif any(not p.name.startswith(".") for p in out.iterdir()):
            raise LayercutError(f"--resume: {out} is not a layercut run directory (no recipe.yaml)")
        for stale in out.glob(".*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    else:
        check_output_dir(out)
        out.mkdir(parents=True)
    if not recipe_file.is_file() or recipe_file.read_text() != recipe.to_yaml():
        tmp = out / ".recipe.yaml.tmp"
        tmp.write_text(recipe.to_yaml())
        os.replace(tmp, recipe_file)


def _check_resumable(previous: Recipe, recipe: Recipe, out: Path) -> None:
    """Resume only where the finished stages ran with exactly the new recipe's settings.

    Stages that have not run yet may change (fix a failing stage, add an eval); the
    model, seed and every finished stage may not.
    """
    old, new = previous.to_dict(), recipe.to_dict()
    for key in ("version", "model", "seed", "trust_remote_code"):
        if old.get(key) != new.get(key):
            raise LayercutError(f"--resume: the recipe differs from the one in {out} "
                                f"({key}: {old.get(key)!r} -> {new.get(key)!r}); use a new output folder")
    for i, stage in enumerate(old["stages"], 1):
        (name, _), = stage.items()
        if not (out / stage_dir_name(i, name) / "stage.json").is_file():
            continue
        if name == "quantize" and i <= len(recipe.stages):  # the plan it ran vs the resumed options' plan
            stage_module(name).check_resume(recipe.stages[i - 1], out / stage_dir_name(i, name) / "model")
        if i > len(new["stages"]) or new["stages"][i - 1] != stage:
            changed = _first_difference({"stages": old["stages"][:i]}, {"stages": new["stages"][:i]})
            raise LayercutError(f"--resume: stage {i} ({name}) already ran with other settings ({changed}); "
                                "use a new output folder")


def _first_difference(a: dict, b: dict, prefix: str = "") -> str:
    for key in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(key), b.get(key)
        if va != vb:
            if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
                for i, (x, y) in enumerate(zip(va, vb)):
                    if x != y:
                        return _first_difference(x, y, f"{prefix}{key}[{i}].") if isinstance(x, dict) and \
                            isinstance(y, dict) else f"{prefix}{key}[{i}] changed"
            if isinstance(va, dict) and isinstance(vb, dict):
                return _first_difference(va, vb, f"{prefix}{key}.")
            return f"{prefix}{key}: {va!r} -> {vb!r}"
    return "no difference"


def run_recipe(recipe: Recipe, out: str | os.PathLike, resume: bool = False, progress: bool = True) -> dict:
    """Run every stage of ``recipe`` into ``out``; returns the run report (also ``out/report.json``).

    Raises :class:`GateFailed` (after writing everything) when an eval stage's gate fails.
    """
    out = Path(out).expanduser()
    if out.exists() and not resume:
        raise LayercutError(f"output {out} already exists (pass --resume to continue that run, or remove it)")
    if not out.exists():
        check_output_dir(out)
        probe_writable(out)  # read-only location, existing file: before any work
    elif not out.is_dir():
        raise LayercutError(f"output {out} exists and is not a directory")
    source = resolve_model(recipe.model)  # a bad model spec fails before OUT is created

    planned = None
    if recipe.target is not None:  # plan the stages first (a bad target: one error, nothing written)
        recipe, planned = _plan_stages(recipe, out, progress)
    for cfg in recipe.stages:  # --device cuda without CUDA, too
        if getattr(cfg, "device", None) is not None:
            resolve_device(cfg.device)
    prepare_run_dir(recipe, out, resume)
    if planned is not None and planned != out / PLAN_DIR:
        os.replace(planned, out / PLAN_DIR)
    handler = _file_log(out / "run.log")
    try:
        return _run(recipe, out, source, progress)
    finally:
        for name in _LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        handler.close()


PLAN_DIR = "00-plan"  # a target recipe's plan (plan.json, plan.png, the plan's own winner)


def _plan_stages(recipe: Recipe, out: Path, progress: bool) -> tuple[Recipe, Path]:
    """A ``target:`` recipe -> the recipe of its plan's winner (stages filled in) and the plan folder.

    A resumed run reuses ``OUT/00-plan``; otherwise the plan is written beside OUT and moved in
    once the run directory exists.
    """
    folder = out / PLAN_DIR
    if not (folder / "recipe.yaml").is_file():
        target = recipe.target
        if "seed" not in target.model_fields_set:
            target = target.model_copy(update={"seed": recipe.seed})
        folder = out.parent / f".{out.name}.plan"
        if folder.exists():
            shutil.rmtree(folder)
        plan(target, recipe.model, folder, progress=progress)
    planned = Recipe.from_yaml(folder / "recipe.yaml")
    return planned.model_copy(update={"name": recipe.name or planned.name,
                                      "trust_remote_code": recipe.trust_remote_code}), folder


def _file_log(path: Path) -> logging.Handler:
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in _LOGGERS:
        logging.getLogger(name).addHandler(handler)
    for name in _LOGGERS[:-1]:
        logging.getLogger(name).setLevel(logging.INFO)
    return handler


# layercut's own loggers (and Python warnings): the run's log files listen to these; the root
# logger is the application's (the CLI's), never touched here
_LOGGERS = ("layercut", "compress", "heal", "calibrate", "export", "py.warnings")


def _run(recipe: Recipe, out: Path, source: Path, progress: bool) -> dict:
    n = len(recipe.stages)
    log.info("run %s: %d stages, model %s (%s)", out, n, recipe.model, source)
    current = source
    records: list[dict] = []
    for index, cfg in enumerate(recipe.stages, 1):
        name = stage_dir_name(index, cfg.stage)
        stage_dir = out / name
        done = stage_dir / "stage.json"
        if done.is_file():
            record = json.loads(done.read_text())
            log.info("[%d/%d] %s: already complete, skipped", index, n, name)
            _say(progress, f"[{index}/{n}] {cfg.stage}: done earlier (resumed)")
        else:
            _hook(f"stage-{index}-start")
            _say(progress, f"[{index}/{n}] {cfg.stage}")
            record = _run_stage(recipe, cfg, index, name, stage_dir, current, source, records, progress)
            _hook(f"stage-{index}-renamed")
        if record.get("checkpoint"):
            current = out / record["checkpoint"]
        records.append(record)
        _write_json_atomic(out / "report.json", _report(recipe, out, source, records, complete=False))
    _hook("finalize")
    # as stored: JSON types (int dict keys become strings), so the return value equals report.json
    report = json.loads(json.dumps(_report(recipe, out, source, records, complete=True), default=str))
    _finalize_export(recipe, out, source, report)
    _write_json_atomic(out / "report.json", report)
    if progress:
        print(summary_table(report), file=sys.stderr)
    failed = [g for r in records for g in r["report"].get("failed_gates", [])]
    if failed:
        exc = GateFailed(f"quality gate failed: {', '.join(failed)} (see {out / 'report.json'})")
        exc.payload = report
        raise exc
    return report


# What each stage writes into its folder: (its `output`, extra keyword arguments of its `run`).
_OUTPUTS = {
    "score": ("scores.json", {"plot": "scores.png"}),
    "prune": ("model", {"plot": "scores.png"}),
    "heal": ("model", {}),
    "quantize": ("model", {}),
    "export": ("model", {}),
    "eval": ("eval.json", {}),
}
# timings, speeds and absolute paths stay out of a stage's report (report.json holds the timings):
# the one list, layercut.compress.workflow.stages.base.VOLATILE, at the top level of each stage's report


def _stage_report(report: dict, tmp: Path) -> dict:
    """The stage's report without timings and input paths; paths inside the stage folder made relative."""
    prefix = str(tmp) + os.sep

    def rel(x):
        if isinstance(x, dict):
            return {k: rel(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rel(v) for v in x]
        return x.removeprefix(prefix) if isinstance(x, str) else x

    return rel({k: v for k, v in report.items() if k not in VOLATILE and not k.endswith("_seconds")
                and not (k in ("model", "teacher") and isinstance(v, str))})


def _run_stage(recipe, cfg, index: int, name: str, stage_dir: Path, current: Path, source: Path,
               records: list[dict], progress: bool) -> dict:
    module = stage_module(cfg.stage)
    output, extra = _OUTPUTS[cfg.stage]
    with atomic_dir(stage_dir) as tmp:
        stage_log = logging.FileHandler(tmp / "log.txt", encoding="utf-8")
        stage_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for logger in _LOGGERS:
            logging.getLogger(logger).addHandler(stage_log)
        logging.captureWarnings(True)
        try:
            _seed(recipe.seed + index)
            env = RunEnv(origin=source, origin_name=recipe.model, progress=progress,
                         trust_remote_code=recipe.trust_remote_code, run_dir=stage_dir.parent)
            kwargs = {k: tmp / v for k, v in extra.items()}
            if cfg.stage == "export":
                kwargs["extra_files"] = {"recipe.yaml": recipe.to_yaml()}
            log.info("stage %s: %s", name, json.dumps(cfg.model_dump(mode="json")))
            with PeakRSS() as rss:
                start, cpu = time.perf_counter(), time.process_time()
                report = module.run(cfg, current, tmp / output, env, **kwargs)
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            checkpoint = f"{name}/{output}" if output == "model" else None
            record = {
                "index": index, "stage": cfg.stage, "dir": name, "input": _rel(current, stage_dir.parent),
                "checkpoint": checkpoint, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "peak_rss_mb": rss.peak_mb,
                "rss_method": rss.method, "report": _stage_report(report, tmp),
            }
            log.info("stage %s done in %.1fs, peak RSS %.0f MB", name, wall, rss.peak_mb)
        finally:
            for logger in _LOGGERS:
                logging.getLogger(logger).removeHandler(stage_log)
            stage_log.close()
            logging.captureWarnings(False)
        _write_json_atomic(tmp / "stage.json", record)
        _hook(f"stage-{index}-written")
    return record


def _rel(path: Path, root: Path) -> str:
    try:
        return Path(path).relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def _report(recipe: Recipe, out: Path, source: Path, records: list[dict], complete: bool) -> dict:
    final = next((r["checkpoint"] for r in reversed(records) if r.get("checkpoint")), None)
    export = next((r for r in records if r["stage"] == "export"), None)
    return {
        "layercut_run": 1,
        "complete": complete,
        "name": recipe.name,
        "model": recipe.model,
        "source": str(source),
        "seed": recipe.seed,
        "final_model": export["checkpoint"] if export else final,
        "total_wall_s": round(sum(r["wall_s"] for r in records), 3),
        "total_cpu_s": round(sum(r.get("cpu_s", 0.0) for r in records), 3),
        "stages": records,
    }


def _finalize_export(recipe: Recipe, out: Path, source: Path, report: dict) -> None:
    """Write the model card and the (timing-free) report into the exported checkpoint."""
    export = next((r for r in report["stages"] if r["stage"] == "export"), None)
    if export is None:
        return

    folder = out / export["checkpoint"]
    cfg = recipe.stages[export["index"] - 1]
    _write_json_atomic(folder / "report.json", quality_report(report))
    if cfg.card:
        write_card(folder, report, source, run_dir=out)


def summary_table(report: dict) -> str:
    """One line per stage: wall time, peak RSS and the stage's headline figures."""
    rows = [("stage", "wall s", "CPU s", "peak RSS MB", "result")]
    for r in report["stages"]:
        rows.append((r["dir"], f"{r['wall_s']:.1f}", f"{r.get('cpu_s', 0.0):.1f}", f"{r['peak_rss_mb']:.0f}",
                     headline(r["stage"], r["report"])))
    rows.append(("total", f"{report['total_wall_s']:.1f}", f"{report.get('total_cpu_s', 0.0):.1f}", "",
                 f"final model: {report['final_model']}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}  {e}" for a, b, c, d, e in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def headline(stage: str, report: dict) -> str:
    """A one-line summary of a stage's report for the run's summary table."""
    if stage == "eval":
        m, b = report["model"], report.get("baseline")
        text = f"ppl {m['ppl']:.3f}" + (f" (source {b['ppl']:.3f})" if b else "")
        if m.get("kl") is not None:
            text += f", KL {m['kl']:.4f}"
        text += f", {m['tokens_per_s']:.0f} tok/s"
        for task, t in (report.get("tasks") or {}).items():
            if "acc" in t.get("metrics", {}):
                text += f", {task} acc {t['metrics']['acc']:.3f}"
        if report.get("gates"):
            text += ", gates " + ("passed" if report["gates_passed"] else "FAILED: " + ", ".join(report["failed_gates"]))
        return text
    if stage == "export":
        return f"{len(report['files'])} files, {report['bytes'] / 2**20:.1f} MiB weights"
    if stage == "prune":
        return (f"{report.get('transform')} {report.get('what')} {report.get('layers')}: "
                f"{report.get('num_layers_before')} -> {report.get('num_layers_after')} layers")
    if stage == "quantize":
        return f"avg {report.get('avg_bits', float('nan')):.2f} bits"
    if stage == "heal":
        return f"{report.get('steps', '?')} steps, loss {report.get('loss_start', float('nan')):.4g} -> " \
               f"{report.get('loss_end', float('nan')):.4g}"
    if stage == "score":
        return f"methods {', '.join(report.get('methods', []))}"
    return ""
