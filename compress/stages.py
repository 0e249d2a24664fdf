"""Stage adapters: each one calls a stage's public function for :mod:`compress.pipeline`.

Usage (the runner does this; a test may call one directly)::

    from compress.stages import ADAPTERS, StageContext
    result = ADAPTERS["eval"](EvalStage(max_tokens=256), input_dir, stage_tmp_dir, ctx)
    result.checkpoint, result.report      # Path | None (None: model unchanged), JSON-able dict

An adapter is ``(stage config, input checkpoint dir, stage folder, context) ->
StageResult``. It loads its input from disk, writes its artifacts (and, if it changes the
model, a checkpoint under ``stage folder/model``) and returns quality figures only —
never timings, which the runner measures. The algorithms live in their packages
(:mod:`compress.select`, :mod:`compress.depth`, :mod:`heal`, :mod:`compress.quant`,
:mod:`export`); nothing here reimplements them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.errors import LayercutError


@dataclass
class StageContext:
    recipe: Any  # compress.recipe.Recipe
    source: Path  # resolved source checkpoint: teacher for heal, reference for eval
    index: int
    seed: int
    progress: bool
    previous: list[dict] = field(default_factory=list)  # records of the finished stages
    run_dir: Path | None = None

    def load(self, path: str | Path, with_tokenizer: bool = True):
        from compress.models import load_model

        return load_model(path, trust_remote_code=self.recipe.trust_remote_code, with_tokenizer=with_tokenizer)


@dataclass
class StageResult:
    checkpoint: Path | None
    report: dict


Adapter = Callable[[Any, Path, Path, StageContext], StageResult]


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def command_args(cfg, **extra) -> argparse.Namespace:
    """The argparse namespace a stage's CLI command would build from the same options."""
    values = cfg.model_dump(exclude={"stage"})
    values.update(extra)
    return argparse.Namespace(**values)


# ---------------------------------------------------------------------------- score
def run_score(cfg, model_dir: Path, out: Path, ctx: StageContext) -> StageResult:
    """``layercut score`` into the stage folder: scores.json (+ plan) and scores.png."""
    from compress.commands import score

    method = ",".join(cfg.method) if isinstance(cfg.method, list) else cfg.method
    args = command_args(cfg, method=method, model=str(model_dir), output=str(out / "scores.json"),
                        plot=str(out / "scores.png"), trust_remote_code=ctx.recipe.trust_remote_code,
                        json=not ctx.progress)
    result = score.run(args)
    result.pop("timings", None)
    result.pop("model", None)
    result["plot"], result["output"] = "scores.png", "scores.json"
    return StageResult(None, result)


# ---------------------------------------------------------------------------- prune
def blocks_to_drop(drop: int | str | None, model_dir: Path) -> int | None:
    """A recipe's ``drop`` as a block count: ``"25%"`` of the model's blocks, rounded, at least 1."""
    if drop is None or isinstance(drop, int):
        return drop
    from compress.commands.score import num_layers_of
    from compress.recipe_stages import parse_fraction

    layers = num_layers_of(json.loads((model_dir / "config.json").read_text()))
    return max(1, int(parse_fraction(drop) * layers + 0.5))


_VOLATILE = ("seconds", "output", "source")  # paths and timings: kept out of checkpoints


def strip_volatile(data: Any, keys: tuple[str, ...] = _VOLATILE) -> Any:
    """``data`` without the named keys at any depth (timings and absolute paths)."""
    if isinstance(data, dict):
        return {k: strip_volatile(v, keys) for k, v in data.items()
                if k not in keys and not str(k).endswith("_seconds")}
    if isinstance(data, list):
        return [strip_volatile(v, keys) for v in data]
    return data


def run_prune(cfg, model_dir: Path, out: Path, ctx: StageContext) -> StageResult:
    """``layercut prune`` into ``stage/model`` (its ``layercut_prune.json`` made path- and time-free)."""
    from compress.depth.prune import prune

    target = out / "model"
    drop = blocks_to_drop(cfg.drop, model_dir)
    layers = ",".join(map(str, cfg.layers)) if isinstance(cfg.layers, list) else cfg.layers
    result = prune(str(model_dir), target, drop=drop, select=cfg.select, layers=layers, what=cfg.what,
                   replace=cfg.replace, fuse=cfg.fuse, fuse_calibrate=cfg.fuse_calibrate, calib=cfg.calib,
                   samples=cfg.samples, seq_len=cfg.seq_len, batch_size=cfg.batch_size, stream=cfg.stream,
                   alpha=cfg.alpha, progress=ctx.progress)
    info_file = target / "layercut_prune.json"
    report = strip_volatile(result)
    if info_file.is_file():
        info = strip_volatile(json.loads(info_file.read_text()))
        write_json(info_file, info)
        if info.get("scores"):  # the selection's scores, selected layers in red
            from compress.select import LayerScores, plot_scores

            highlight = report["layers"] if cfg.select and not cfg.select.startswith("angular") else \
                report["layers"][:1]  # the angular panel's x axis is the span start
            scores = info["scores"]
            scores = LayerScores.from_dict(scores) if "num_layers" in scores else scores  # gate-norm: a dict
            plot_scores(scores, out / "scores.png", highlight=highlight,
                        title=f"{cfg.select}: {cfg.what} {report['layers']} removed")
            report["plot"] = "scores.png"
    what = "blocks" if cfg.what == "block" else f"{cfg.what} sublayers"
    how = {"drop": "dropped", "replace-lstsq": "replaced by a least-squares linear map merged into the "
           "preceding block's down_proj", "replace-cosine": "replaced by a cosine-fitted linear map merged "
           "into the preceding block's down_proj"}.get(report.get("transform"), report.get("transform"))
    chosen = "chosen explicitly" if report.get("select") == "explicit" else f"selected by {report.get('select')}"
    report["description"] = f"{what} {report.get('layers')} of {report.get('num_layers_before')} {how} ({chosen})"
    report["removed_blocks" if cfg.what == "block" else "removed_sublayers"] = report.get("layers")
    return StageResult(target, report)


# ---------------------------------------------------------------------------- heal
def run_heal(cfg, model_dir: Path, out: Path, ctx: StageContext) -> StageResult:
    """``layercut heal MODEL --teacher SOURCE`` into ``stage/model`` (same function as the CLI)."""
    from compress.commands import heal

    opts = cfg.heal_options(ctx.recipe.seed)
    target = out / "model"
    args = argparse.Namespace(
        **{k: v for k, v in opts.items() if k != "gradient_checkpointing"},
        no_gradient_checkpointing=not opts["gradient_checkpointing"], model=str(model_dir),
        teacher=str(ctx.source), output=str(target), checkpoint_every=0, resume=False, overwrite=False,
        trust_remote_code=ctx.recipe.trust_remote_code, json=not ctx.progress,
    )
    result = heal.run(args)
    info_file = target / "heal.json"
    losses: list[float] = []
    if info_file.is_file():
        info = strip_volatile(json.loads(info_file.read_text()), _HEAL_VOLATILE)
        write_json(info_file, info)
        losses = info.get("losses") or []
    report = strip_volatile(result, _HEAL_VOLATILE + ("model", "teacher"))
    # first/last quarter of the steps (heal's own loss_first/last average 10 steps, which overlap on short runs)
    k = max(1, len(losses) // 4)
    if losses:
        report["loss_start"], report["loss_end"] = sum(losses[:k]) / k, sum(losses[-k:]) / k
    else:
        report["loss_start"], report["loss_end"] = report.get("loss_first"), report.get("loss_last")
    report["loss_window"] = k
    return StageResult(target, report)


_HEAL_VOLATILE = _VOLATILE + ("tokens_per_s", "adapter")


# ---------------------------------------------------------------------------- quantize
_QUANT_VOLATILE = _VOLATILE + ("model",)


def run_quantize(cfg, model_dir: Path, out: Path, ctx: StageContext) -> StageResult:
    """``layercut quantize`` into ``stage/model`` (a GPTQ v1 checkpoint; same function as the CLI)."""
    from compress.commands import quantize

    target = out / "model"
    candidates = ",".join(map(str, cfg.candidate_list()))
    args = command_args(cfg, candidates=candidates, seed=ctx.recipe.seed if cfg.seed is None else cfg.seed,
                        model=str(model_dir), output=str(target), overwrite=False, json=not ctx.progress)
    result = quantize.run(args)
    for name in ("quantize.json", "allocation.json"):  # keep timings and paths out of the checkpoint
        if (target / name).is_file():
            write_json(target / name, strip_volatile(json.loads((target / name).read_text()), _QUANT_VOLATILE))
    report = strip_volatile(result, _QUANT_VOLATILE)
    report["bits_per_layer"] = report.get("unit_bits") or {"all linears": cfg.bits}
    sym = "symmetric" if cfg.sym else "asymmetric"
    if cfg.avg_bits is not None:
        report["description"] = (f"{cfg.method.upper()} ({sym}, group size {cfg.group_size}), bits per {cfg.unit} "
                                 f"from {{{candidates}}} under a {cfg.avg_bits}-bit budget "
                                 f"(sensitivity: {cfg.sensitivity}),")
    else:
        report["description"] = f"{cfg.method.upper()} ({sym}, group size {cfg.group_size}), {cfg.bits} bits,"
    if (target / "allocation.png").is_file():
        report["checkpoint_plot"] = "allocation.png"  # travels inside the checkpoint (export keeps it)
    return StageResult(target, report)


# ---------------------------------------------------------------------------- export
def run_export(cfg, model_dir: Path, out: Path, ctx: StageContext) -> StageResult:
    from export.export import write_export_into

    target = out / "model"
    target.mkdir()
    res = write_export_into(model_dir, target, dequantize=cfg.dequantize, dtype=cfg.dtype,
                            max_shard_size=cfg.max_shard_size, trust_remote_code=ctx.recipe.trust_remote_code,
                            extra_files={"recipe.yaml": ctx.recipe.to_yaml()})
    return StageResult(target, {"files": res.files, "bytes": res.bytes, "quantized": res.quantized,
                                "dequantized": res.dequantized})


# ---------------------------------------------------------------------------- eval
def run_eval(cfg, model_dir: Path, out: Path, ctx: StageContext) -> StageResult:
    from compress.evaluate import evaluate
    from compress.gates import check_gates, parse_limit
    from compress.models import weight_bytes

    model, tokenizer = ctx.load(model_dir)
    opts = dict(text=cfg.text, ctx=cfg.ctx, max_tokens=cfg.max_tokens, batch_size=cfg.batch_size,
                progress=ctx.progress)
    baseline, reference = None, None
    if cfg.reference:
        reference, ref_tok = ctx.load(ctx.source)
        if ref_tok.get_vocab() != tokenizer.get_vocab():
            raise LayercutError("eval: the model's tokenizer differs from the source model's; KL is undefined")
        base = evaluate(reference, ref_tok, **opts)
        base.bytes, base.model = weight_bytes(ctx.source), ctx.recipe.model
        baseline = base.to_dict()
    result = evaluate(model, tokenizer, reference=reference, **opts)
    result.bytes = weight_bytes(model_dir)
    result.model = model_dir.name if ctx.run_dir is None else _rel(model_dir, ctx.run_dir)
    figures = result.to_dict()
    gates = check_gates(figures, parse_limit(cfg.max_ppl_increase, "max_ppl_increase"), cfg.max_kl)
    report = {
        "model": figures,
        "baseline": baseline,
        "gates": [g.__dict__ for g in gates],
        "gates_passed": all(g.passed for g in gates),
        "failed_gates": [g.name for g in gates if not g.passed],
    }
    write_json(out / "eval.json", report)
    return StageResult(None, report)


def _rel(path: Path, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


ADAPTERS: dict[str, Adapter] = {
    "score": run_score,
    "prune": run_prune,
    "heal": run_heal,
    "quantize": run_quantize,
    "export": run_export,
    "eval": run_eval,
}


def headline(stage: str, report: dict) -> str:
    """A one-line summary of a stage's report for the run's summary table."""
    if stage == "eval":
        m, b = report["model"], report.get("baseline")
        text = f"ppl {m['ppl']:.3f}" + (f" (source {b['ppl']:.3f})" if b else "")
        if m.get("kl") is not None:
            text += f", KL {m['kl']:.4f}"
        text += f", {m['tokens_per_s']:.0f} tok/s"
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
