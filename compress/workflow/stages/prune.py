"""The prune stage: pick layers, remove them (drop / linear replace / fuse), write a checkpoint.

Run it::

    layercut prune bundled:smollm2-135m -o out/cut8 --drop 8 --select block-influence --replace lstsq

    from layercut.compress.workflow.stages.prune import PruneConfig, prune_model, run
    run(PruneConfig(drop=8, select="block-influence", replace="lstsq"), "bundled:smollm2-135m", "out/cut8")
    model = prune_model(model, tokenizer, PruneConfig(layers=[3, 4]))          # in memory

Both paths share :func:`apply`; the algorithms are in :mod:`layercut.compress.depth`. Every option
is validated before any work; the output directory appears only when complete. Besides
the weights it holds ``layercut_prune.json`` (no timings or paths, so reruns are
byte-identical): which layers (old numbering), how they were chosen (with the scores),
the transform and its per-span fit statistics.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from layercut.calibrate.data import calibration_batch
from layercut.compress.core.arch import arch_for, count_params
from layercut.compress.core.devices import on_device
from layercut.compress.core.errors import LayercutError, format_error
from layercut.compress.core.save import atomic_dir, check_output_dir, write_checkpoint_into
from layercut.compress.depth.config import PruneConfig, parse_layers
from layercut.compress.depth.plan import PrunePlan, removed_params
from layercut.compress.depth.prune import check_against_model, choose_layers, transform_name
from layercut.compress.depth.prune import prune_model as transform
from layercut.compress.depth.replace import fit_linear_maps
from layercut.compress.depth.stream_drop import map_edits, write_without_blocks
from layercut.compress.depth.sublayers import sublayer_readme
from layercut.compress.io.models import load_model, load_tokenizer, resolve_model
from layercut.compress.options import torch_dtype
from layercut.compress.select.driver import LayerScores
from layercut.compress.select.plot import plot_scores
from layercut.compress.workflow.stages.base import RunEnv, load_streamed, strip_volatile

log = logging.getLogger("layercut.prune")
PRUNE_VERSION = 1




def choose(model, tokenizer, config: PruneConfig, model_dir: Path | None = None,
           progress: bool = True, scores: dict | None = None) -> PrunePlan:
    """Validate the request against ``model`` and plan the cut: pick the layers (scoring on data
    where asked) and count what remains. ``model`` may be a lazily loaded one
    (:class:`layercut.compress.io.lazy.LazyModel`): scoring streams it block by block.
    ``scores``: an earlier plan's block scores (``PrunePlan.scores``, same model and
    calibration) to select from without scoring again.
    """
    picked = parse_layers(config.layers)
    count = config.count(len(arch_for(model).layers_of(model)))
    count = count if count is not None else len(picked)
    num_layers = check_against_model(model, config.what, count, picked, config.replace)
    params_before = count_params(model)
    select, replace = config.select, config.replace
    needs_data = replace != "none" or config.fuse_calibrate or select not in (None, "gate-norm")
    calib_set = calibration_batch(tokenizer, config.text_sources(), samples=config.samples,
                                  seq_len=config.seq_len) \
        if needs_data else None
    given, scores = scores, None
    if select is not None:
        picked, scores = choose_layers(model, model_dir, config.what, count, select, calib_set, config.batch_size,
                                       progress, keep_first=replace != "none", scores=given)
        check_against_model(model, config.what, count, picked, replace)
    calibration = {"text": config.text_label(), "samples": config.samples, "seq_len": config.seq_len} \
        if calib_set is not None else None
    return PrunePlan(what=config.what, layers=picked, select=select or "explicit",
                     transform=transform_name(replace, config.fuse, config.fuse_calibrate), num_layers=num_layers,
                     params_before=params_before,
                     params_after=params_before - removed_params(model, config.what, picked),
                     calibration=calibration, scores=scores, calib_set=calib_set)


def apply(model, tokenizer, config: PruneConfig, model_dir: Path | None = None,
          progress: bool = True, scores: dict | None = None) -> tuple[object, dict]:
    """The shared core: plan the cut and transform ``model`` in place; returns (model, report)."""
    plan = choose(model, tokenizer, config, model_dir, progress, scores)
    replace = config.replace
    extra = {"stream": config.stream, "alpha": config.alpha} if replace != "none" else {}
    fit_data = plan.calib_set if (replace != "none" or config.fuse_calibrate) else None
    model, details = transform(model, plan.layers, config.what, replace, config.fuse, fit_data, config.batch_size,
                               progress, **extra)
    return model, report_of(config, plan, details, int(model.config.num_hidden_layers), count_params(model))


def report_of(config: PruneConfig, plan: PrunePlan, details: dict, layers_after: int, params_after: int) -> dict:
    """The prune report (``layercut_prune.json`` without timings), the same for both paths."""
    if params_after != plan.params_after:  # the plan's count is what --dry-run prints: keep it honest
        raise LayercutError(f"internal: planned {plan.params_after} parameters after the cut, wrote {params_after}")
    extra = {"stream": config.stream, "alpha": config.alpha} if config.replace != "none" else {}
    report = {"version": PRUNE_VERSION, **plan.to_dict(), "num_layers_after": layers_after,
              "params_after": params_after, **details, **extra, "scores": plan.scores}
    report["removed_blocks" if config.what == "block" else "removed_sublayers"] = plan.layers
    log.info("prune: %s", report["description"])
    return report


def _run_streamed(lazy, config: PruneConfig, model_dir: Path, output: str | Path, env: RunEnv,
                  scores: dict | None = None) -> dict:
    """Block drop / linear replacement with one block in memory: select and fit over the lazy driver,
    then copy the checkpoint tensor by tensor (kept dtype), folding the maps in on the way."""
    tokenizer = load_tokenizer(model_dir, env.trust_remote_code)
    plan = choose(lazy.model, tokenizer, config, model_dir, env.progress, scores)
    details, edits = {}, None
    if config.replace != "none":
        fits = fit_linear_maps(lazy.model, plan.layers, plan.calib_set, method=config.replace,
                               alpha=config.alpha, stream=config.stream, batch_size=config.batch_size,
                               progress=env.progress)
        details, edits = {"spans": [f.to_dict() for f in fits]}, map_edits(lazy, fits)
    with atomic_dir(output, env.overwrite) as tmp:
        summary = write_without_blocks(lazy, tmp, plan.layers, edits=edits)
        report = report_of(config, plan, details, summary["layers_after"], summary["params_after"])
        (tmp / "layercut_prune.json").write_text(json.dumps(strip_volatile(report), indent=2, default=str))
    return report


def prune_model(model, tokenizer, config: PruneConfig, progress: bool = True):
    """Prune an in-memory model (small models, notebooks); returns the model (changed in place)."""
    return apply(model, tokenizer, config, None, progress)[0]


@on_device
def run(config: PruneConfig, source: str | Path, output: str | Path, env: RunEnv | None = None,
        plot: str | Path | None = None, scores: dict | None = None) -> dict:
    """Load ``source``, prune it, write the checkpoint to ``output``; returns the report.

    ``plot``: also write a PNG of the selection scores (selected layers in red).
    ``scores``: block scores of an earlier run on the same source and calibration (the
    report's ``scores``, see :func:`choose`): selection reuses them instead of scoring.
    """
    env = env or RunEnv()
    if output is not None or not env.dry_run:
        check_output_dir(output, env.overwrite)
    model_dir = resolve_model(source)
    start = time.perf_counter()
    streamable = config.what == "block" and not config.fuse
    if env.dry_run:
        return _dry_run(config, model_dir, source, output, env, start)
    lazy = load_streamed(model_dir, config.dtype, env, config.whole_model or not streamable, "prune")
    if lazy is not None:
        report = _run_streamed(lazy, config, model_dir, output, env, scores)
    else:
        model, tokenizer = load_model(model_dir, dtype=torch_dtype(config.dtype, model_dir),
                                      trust_remote_code=env.trust_remote_code)
        model, report = apply(model, tokenizer, config, model_dir, env.progress, scores)
        files = {"layercut_prune.json": json.dumps(strip_volatile(report), indent=2, default=str)}
        if config.what != "block":
            files["README.md"] = sublayer_readme(model.config, str(source))
        with atomic_dir(output, env.overwrite) as tmp:
            write_checkpoint_into(model, tokenizer, tmp, extra_files=files)
    seconds = time.perf_counter() - start
    if plot is not None and report["scores"]:
        _plot(report, config, Path(plot))
        report["plot"] = str(plot)
    report = {k: v for k, v in report.items() if k != "scores"}
    return {**report, "source": str(source), "output": str(output), "seconds": round(seconds, 3)}


def _dry_run(config: PruneConfig, model_dir: Path, source, output, env: RunEnv, start: float) -> dict:
    """The plan a run would execute; nothing is written. The model is read lazily where it
    can be (scoring then streams one block at a time), else whole."""
    lazy = load_streamed(model_dir, config.dtype, env, False, "prune")
    if lazy is not None:
        model = lazy.model
    else:
        model, _ = load_model(model_dir, dtype=torch_dtype(config.dtype, model_dir),
                              trust_remote_code=env.trust_remote_code)
    plan = choose(model, load_tokenizer(model_dir, env.trust_remote_code), config, model_dir, env.progress)
    log.info("prune (dry run): %s", plan.describe())
    return {**plan.to_dict(), "dry_run": True, "source": str(source),
            "output": None if output is None else str(output), "seconds": round(time.perf_counter() - start, 3)}


def _plot(report: dict, config: PruneConfig, path: Path) -> None:
    layers = report["layers"]
    highlight = layers if config.select and not config.select.startswith("angular") else layers[:1]
    scores = report["scores"]  # the angular panel's x axis is the span start: highlight only it
    scores = LayerScores.from_dict(scores) if "num_layers" in scores else scores  # gate-norm: a dict
    plot_scores(scores, path, highlight=highlight, title=f"{config.select}: {config.what} {layers} removed")


def prune(model_spec: str, output: str | Path | None, *, overwrite: bool = False, progress: bool = True,
          dry_run: bool = False, **options) -> dict:
    """Load ``model_spec``, prune it, write a checkpoint to ``output``; return a report.

    ``options`` are :class:`layercut.compress.workflow.stages.prune.PruneConfig`'s (``drop``, ``select``,
    ``layers``, ``replace``, ...); this is :func:`run` with keywords. ``dry_run``: return the
    plan (layers, transform, parameters after) and write nothing; ``output`` may then be None.
    """
    from pydantic import ValidationError

    try:
        config = PruneConfig(**options)
    except ValidationError as exc:
        raise LayercutError(format_error(exc)) from None
    return run(config, model_spec, output, RunEnv(overwrite=overwrite, progress=progress, dry_run=dry_run))
