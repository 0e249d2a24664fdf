"""The score stage: per-layer importance scores and the layers each method would drop.

Run it::

    layercut score bundled:smollm2-135m --method all --span 8 --json
    layercut score ./model --method gate-norm --drop 8 -o plan.json     # no data, no model built

    from layercut.compress.workflow.stages.score import ScoreConfig, run, score_model
    report = run(ScoreConfig(method="block-influence", drop=8), "bundled:smollm2-135m")
    report = score_model(model, tokenizer, ScoreConfig(method="block-influence", drop=8))   # in memory

Methods: angular, angular-all, block-influence, attn-cosine, mlp-cosine, gate-norm,
swap-kl, all (every method but swap-kl, which is slow: name it to add it). Every
data-driven score comes from one capture-driver pass (:mod:`layercut.compress.select`). Outputs
(``output`` JSON, ``plot`` PNG) are written only at the end, atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from layercut.calibrate.data import calibration_batch
from layercut.compress.core.arch import arch_for
from layercut.compress.core.devices import on_device
from layercut.compress.core.errors import LayercutError
from layercut.compress.io.models import load_model, load_tokenizer, resolve_model
from layercut.compress.options import torch_dtype
from layercut.compress.select.config import ScoreConfig, parse_methods
from layercut.compress.select.cores import lowest
from layercut.compress.select.driver import (
    DATA_METHODS,
    LayerScores,
    check_count,
    check_span,
    compute_scores,
    rankings,
    select_blocks,
    select_sublayers,
)
from layercut.compress.select.gate_norm import gate_norm_scores
from layercut.compress.select.plot import plot_scores
from layercut.compress.select.swap_kl import swap_kl_scores
from layercut.compress.workflow.stages.base import RunEnv, load_streamed


def num_layers_of(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    raise LayercutError("config.json has no num_hidden_layers")


def selections(scores, methods: list[str], n: int) -> dict:
    """Layers each method would drop at count n (swap-kl is a diagnostic: no selection)."""
    out: dict = {}
    for m in methods:
        if m in ("angular", "angular-all", "block-influence"):
            out[m] = select_blocks(scores, n, m)
        elif m in ("attn-cosine", "mlp-cosine"):
            out[m] = select_sublayers(scores, n, m, "attention" if m == "attn-cosine" else "mlp")
        elif m == "gate-norm":
            out[m] = lowest(scores.gate_norm, n)
    if "attn-cosine" in methods and "mlp-cosine" in methods:
        out["joint"] = [list(t) for t in select_sublayers(scores, n, "joint")]
    return out


def score_model(model, tokenizer, config: ScoreConfig, progress: bool = True) -> dict:
    """Score an in-memory model's layers (every method from the model, gate-norm from its weights).

    Returns ``{"num_layers", "methods", "span", "drop", "selection": {method: layers}, "ranking",
    "scores"}``: :func:`run`'s figures, without its file outputs and timings.
    """
    methods = parse_methods(config.method)
    layers = len(arch_for(model).layers_of(model))
    span, drop = config.span or config.drop or 1, config.drop or config.span
    calib = None
    if any(m in DATA_METHODS or m == "swap-kl" for m in methods):
        calib = calibration_batch(tokenizer, config.text_sources(), samples=config.samples, seq_len=config.seq_len,
                                  seed=0)
    scores = compute_scores(model, calib, span=span, methods=methods, batch_size=config.batch_size, progress=progress)
    return {"num_layers": layers, "methods": methods, "span": span, "drop": drop,
            "selection": selections(scores, methods, drop) if drop else {}, "ranking": rankings(scores),
            "scores": scores.to_dict()}


@on_device
def run(config: ScoreConfig, source: str | Path, output: str | Path | None = None, env: RunEnv | None = None,
        plot: str | Path | None = None) -> dict:
    """Score ``source``'s layers; write the report to ``output`` (.json) and a PNG to ``plot`` if given."""
    env = env or RunEnv()
    start = time.perf_counter()
    methods = parse_methods(config.method)
    json_out, plot_out = _check_out(output, ".json"), _check_out(plot, ".png")
    path = resolve_model(source)
    try:
        model_config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise LayercutError(f"{path}/config.json: invalid JSON ({exc})") from exc
    layers = num_layers_of(model_config)
    span = config.span or config.drop or 1
    drop = config.drop or config.span
    if config.span is not None:
        check_span(config.span, layers)
    if drop is not None:
        check_count(drop, layers, "layers")
    check_span(span, layers)
    if drop is not None and "angular-all" in methods and drop != span:
        raise LayercutError(f"angular-all selects a span of --drop {drop} blocks: pass --span {drop}")

    data = [m for m in methods if m in DATA_METHODS]
    scores = LayerScores(num_layers=layers, span=span)
    model = calib = None
    if data or "swap-kl" in methods:
        lazy = load_streamed(path, config.dtype, env, config.whole_model or "swap-kl" in methods, "score",
                             quantized=True)
        if lazy is not None:  # the scores only need each block's inputs and outputs: one block at a time
            model, tokenizer = lazy.model, load_tokenizer(path, env.trust_remote_code)
        else:
            model, tokenizer = load_model(path, dtype=torch_dtype(config.dtype, path),
                                          trust_remote_code=env.trust_remote_code)
        calib = calibration_batch(tokenizer, config.text_sources(), samples=config.samples, seq_len=config.seq_len,
                                  seed=0)
    timings = {}
    if data:
        t0 = time.perf_counter()
        scores = compute_scores(model, calib, span=span, methods=data, batch_size=config.batch_size,
                                progress=env.progress)
        timings["capture_s"] = time.perf_counter() - t0
    if "gate-norm" in methods:
        t0 = time.perf_counter()
        scores.gate_norm = gate_norm_scores(path)  # from the files: no data, no model
        timings["gate_norm_s"] = time.perf_counter() - t0
        if len(scores.gate_norm) != layers:
            raise LayercutError(f"{path}: {len(scores.gate_norm)} attention layers in the files, config says {layers}")
    if "swap-kl" in methods:
        t0 = time.perf_counter()
        scores.swap_kl = swap_kl_scores(model, calib, samples=config.swap_samples, progress=env.progress)
        timings["swap_kl_s"] = time.perf_counter() - t0
    scores.meta.update(model=env.name(path, str(source)), methods=methods,
                       calib=config.text_label() if model is not None else None,
                       seq_len=config.seq_len if model is not None else None)

    chosen = selections(scores, methods, drop) if drop is not None else {}
    result = {"model": env.name(path, str(source)), "methods": methods, "num_layers": layers, "span": span,
              "drop": drop, "selection": chosen, "ranking": rankings(scores), "scores": scores.to_dict()}
    pending: list[tuple[Path, Path]] = []
    try:
        if plot_out is not None:
            highlight = {
                "block_influence": chosen.get("block-influence", []),
                "attn_importance": chosen.get("attn-cosine", []),
                "mlp_importance": chosen.get("mlp-cosine", []),
                "angular": chosen.get("angular", [])[:1],  # the angular panel's x axis is the span start
                "angular_all": chosen.get("angular-all", [])[:1],
                "gate_norm": chosen.get("gate-norm", []),
            }
            tmp = _temp_beside(plot_out, ".png")
            pending.append((tmp, plot_out))
            plot_scores(scores, tmp, highlight=highlight, title=f"{result['model']}: {layers} layers")
            result["plot"] = str(plot_out)
        if json_out is not None:
            result["output"] = str(json_out)
            tmp = _temp_beside(json_out, ".json")
            pending.append((tmp, json_out))
            tmp.write_text(json.dumps(result, indent=1))
        for tmp, target in pending:
            os.replace(tmp, target)
    finally:
        for tmp, _ in pending:
            if tmp.exists():
                tmp.unlink()
    timings["wall_s"] = time.perf_counter() - start
    result["timings"] = timings
    return result


def _check_out(path: str | Path | None, suffix: str) -> Path | None:
    if path is None:
        return None
    target = Path(path).expanduser()
    if target.suffix.lower() != suffix:
        raise LayercutError(f"{target} must end in {suffix}")
    if target.is_dir():
        raise LayercutError(f"{target} is a directory")
    parent = target.parent
    probe = parent if parent.exists() else next((p for p in parent.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK):
        raise LayercutError(f"output location {probe} is not writable")
    return target


def _temp_beside(target: Path, suffix: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    return Path(tmp)
