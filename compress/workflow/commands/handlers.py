"""What each ``layercut`` command does with its parsed command line.

Usage::

    from layercut.compress.workflow.cli import build_parser
    from layercut.compress.workflow.commands.handlers import handle
    report = handle(build_parser().parse_args(["eval", "bundled:smollm2-135m", "--max-tokens", "256"]))

The parsers are the modules beside this one (each ``register(subparsers)`` defines a command's
flags and imports nothing heavy, since ``layercut --help`` builds them all). This module imports
the pipeline, the planner and the stage table, and with them torch: the CLI
(:func:`layercut.compress.workflow.cli.main`) loads it only once a command runs. Each handler
returns a JSON-able dict (printed as the last stdout line with ``--json``).
"""

from __future__ import annotations

import argparse
import signal
import sys

from layercut.compress.core.errors import GateFailed, LayercutError
from layercut.compress.eval.gates import Gate
from layercut.compress.workflow.commands.plan import config_from_args as plan_config
from layercut.compress.workflow.commands.stage import DRY_RUN
from layercut.compress.workflow.pipeline import run_recipe
from layercut.compress.workflow.planner.search import plan
from layercut.compress.workflow.recipe import load_recipe
from layercut.compress.workflow.stages import STAGES, config_types, stage_module
from layercut.compress.workflow.stages.base import RunEnv
from layercut.compress.workflow.stages.flags import config_from_args
from layercut.export.push import push


def handle(args: argparse.Namespace) -> dict | None:
    """Run the command ``args.command`` (a stage's, ``run``, ``plan`` or ``push``) with its options."""
    if args.command in STAGES:
        return stage_command(args.command, args)
    return {"run": run_command, "plan": plan_command, "push": push_command}[args.command](args)


def stage_command(name: str, args: argparse.Namespace) -> dict:
    """``layercut score|prune|heal|quantize|export|eval``: the stage's ``run`` on the parsed flags."""
    config = config_from_args(config_types()[name], args)
    dry_run = getattr(args, "dry_run", False)
    if name in DRY_RUN and args.output is None and not dry_run:
        raise LayercutError("the following arguments are required: -o/--output")
    env = RunEnv(progress=not args.json and not getattr(args, "quiet", False),
                 trust_remote_code=args.trust_remote_code, overwrite=getattr(args, "overwrite", False),
                 dry_run=dry_run)
    extra = {"plot": args.plot} if getattr(args, "plot", None) else {}
    report = stage_module(name).run(config, args.model, args.output, env, **extra)
    return present_eval(report) if name == "eval" else report


def present_eval(report: dict) -> dict:
    """eval's report as the CLI prints it: the model's figures at the top level; exit 3 on a failed gate."""
    flat = {**report["model"]}
    if report.get("baseline") is not None:
        flat["baseline"] = report["baseline"]
    if report.get("tasks") is not None:
        flat.update(tasks=report["tasks"], lm_eval_version=report["lm_eval_version"])
    if report["gates"]:
        flat.update(gates=report["gates"], gates_passed=report["gates_passed"], failed_gates=report["failed_gates"])
    failed = [Gate(**g) for g in report["gates"] if not g["passed"]]
    if failed:
        exc = GateFailed("quality gate failed: " + "; ".join(g.describe() for g in failed))
        exc.payload = flat
        raise exc
    return flat


def _terminate(signum, frame):  # SIGTERM (CI cancel, kill) -> the same clean stop as Ctrl-C
    raise KeyboardInterrupt


def run_command(args: argparse.Namespace) -> dict:
    """``layercut run RECIPE -o OUT``: every stage of the recipe (:func:`~layercut.compress.workflow.pipeline.run_recipe`)."""
    signal.signal(signal.SIGTERM, _terminate)
    recipe = load_recipe(args.recipe)
    report = run_recipe(recipe, args.output, resume=args.resume, progress=not args.json and not getattr(args, "quiet", False))
    if args.json:
        return report
    return {"output": args.output, "final_model": report["final_model"], "total_wall_s": report["total_wall_s"]}


def plan_command(args: argparse.Namespace) -> dict:
    """``layercut plan MODEL --target-size SIZE -o OUT``: the search (:func:`~layercut.compress.workflow.planner.search.plan`)."""
    config = plan_config(args)
    report = plan(config, args.model, args.output, progress=not args.json and not getattr(args, "quiet", False),
                  overwrite=args.overwrite)
    w = report["winner"]
    return {"output": report["output"], "winner": w["label"], "kept_blocks": w["kept_blocks"],
            "bytes": w["measured_bytes"], "target_bytes": report["target_bytes"],
            "size_vs_bf16": round(w["measured_bytes"] / report["bf16_bytes"], 4), "kl": w["measured_kl"],
            "predicted_kl": w["predicted_kl"], "predicted_speedup": w["predicted_speedup"],
            "spearman_topk": report["spearman_topk"], "verified": report["verified"],
            "candidates": len(report["candidates"]), "speed": report["speed"],
            "seconds": report["timings"]["total_s"]}


def push_command(args: argparse.Namespace) -> dict:
    """``layercut push OUT --repo-id ORG/NAME``: the upload (:func:`~layercut.export.push.push`)."""
    pushed = push(args.folder, args.repo_id, private=args.private, revision=args.revision,
                  dry_run=args.dry_run, commit_message=args.commit_message)
    if not args.json:
        verb = "would upload" if pushed.dry_run else "uploaded"
        print(f"{verb} {len(pushed.files)} files ({pushed.bytes / 2**20:.1f} MiB) from {pushed.folder} "
              f"to {pushed.repo_id}{'@' + pushed.revision if pushed.revision else ''}", file=sys.stderr)
        if pushed.extra.get("card"):
            print(pushed.extra["card"], file=sys.stderr)
        for name in pushed.files:
            print(name)
        return {"repo_id": pushed.repo_id, "files": len(pushed.files), "bytes": pushed.bytes,
                "dry_run": pushed.dry_run, **({"commit_url": pushed.commit_url} if pushed.commit_url else {})}
    return pushed.to_dict()
