"""The Python API behind ``import layercut``: the same stages as the command line, on models in memory.

``layercut/__init__.py`` re-exports these names lazily; see its docstring for usage. Every function
takes the options of its stage as keywords (``group_size=64``) or a config object
(``config=layercut.QuantizeConfig(bits=4)``); they are the CLI's flags and the recipe's keys,
defined once beside each stage. A bad option raises :class:`LayercutError` naming the closest valid one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from layercut.compress.core.errors import LayercutError
from layercut.compress.depth.config import PruneConfig
from layercut.compress.eval.config import EvalConfig
from layercut.compress.options import StageConfig
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.select.config import ScoreConfig
from layercut.compress.workflow.recipe import Recipe
from layercut.export.config import ExportConfig
from layercut.heal.config import HealConfig

__all__ = ["load", "score", "prune", "heal", "quantize", "evaluate", "export", "run"]


def _config(cls: type[StageConfig], config: StageConfig | None, options: dict[str, Any]) -> Any:
    """``config`` (updated with ``options``) or ``cls(**options)``; one-line LayercutError if invalid."""
    from pydantic import ValidationError

    from layercut.compress.core.errors import format_error

    try:
        if config is None:
            return cls(**options)
        if not isinstance(config, cls):
            raise LayercutError(f"expected a {cls.__name__}, got {type(config).__name__}")
        return cls(**{**config.model_dump(exclude_unset=True), **options}) if options else config
    except ValidationError as exc:
        raise LayercutError(f"{cls.__name__}: {format_error(exc)}") from None


def load(model: str | os.PathLike, dtype: str = "fp32", device: str = "cpu", trust_remote_code: bool = False):
    """``(model, tokenizer)`` from a checkpoint directory, a ``.gguf`` file or ``bundled:NAME``.

    ``dtype``: auto (the checkpoint's own), bf16, fp16 or fp32.
    """
    from layercut.compress.io.models import load_model, resolve_model
    from layercut.compress.options import torch_dtype

    path = resolve_model(model)
    return load_model(path, dtype=torch_dtype(dtype, path), device=device, trust_remote_code=trust_remote_code)


def score(model, tokenizer, config: ScoreConfig | None = None, progress: bool = False, **options) -> dict:
    """Per-layer scores of an in-memory model and the layers each method would drop.

    Returns ``{"selection": {method: layers}, "ranking": ..., "scores": ...}``.
    """
    from layercut.calibrate.data import calibration_batch
    from layercut.compress.core.arch import arch_for
    from layercut.compress.select import compute_scores
    from layercut.compress.select.config import parse_methods
    from layercut.compress.select.driver import DATA_METHODS, rankings
    from layercut.compress.workflow.stages.score import selections

    cfg = _config(ScoreConfig, config, options)
    methods = parse_methods(cfg.method)
    layers = len(arch_for(model).layers_of(model))
    span, drop = cfg.span or cfg.drop or 1, cfg.drop or cfg.span
    calib = None
    if any(m in DATA_METHODS or m == "swap-kl" for m in methods):
        calib = calibration_batch(tokenizer, cfg.text_sources(), samples=cfg.samples, seq_len=cfg.seq_len, seed=0)
    scores = compute_scores(model, calib, span=span, methods=methods, batch_size=cfg.batch_size, progress=progress)
    return {"num_layers": layers, "methods": methods, "span": span, "drop": drop,
            "selection": selections(scores, methods, drop) if drop else {}, "ranking": rankings(scores),
            "scores": scores.to_dict()}


def prune(model, tokenizer, config: PruneConfig | None = None, progress: bool = False, **options):
    """Remove blocks or sublayers of an in-memory model (in place); returns the model."""
    from layercut.compress.workflow.stages.prune import prune_model

    return prune_model(model, tokenizer, _config(PruneConfig, config, options), progress)


def quantize(model, tokenizer, config: QuantizeConfig | None = None, progress: bool = False, **options):
    """GPTQ in memory: each linear's weight becomes its dequantized quantized weight; returns the model.

    To write a packed GPTQ checkpoint, run the stage on disk:
    ``layercut quantize MODEL -o OUT`` or :func:`layercut.compress.workflow.stages.quantize.run`.
    """
    from layercut.compress.workflow.stages.quantize import quantize_model

    return quantize_model(model, tokenizer, _config(QuantizeConfig, config, options), progress)


def heal(model, tokenizer, teacher=None, config: HealConfig | None = None, progress: bool = False, **options):
    """LoRA distillation from ``teacher`` (an in-memory model, or None for ``loss="lm"``), merged.

    Returns the healed model.
    """
    from layercut.heal.train import heal_model

    cfg = _config(HealConfig, config, {"teacher": None, **options})
    return heal_model(model, teacher, tokenizer, cfg, progress=progress).model


def evaluate(model, tokenizer, reference=None, config: EvalConfig | None = None, progress: bool = False,
             **options) -> dict:
    """Perplexity (and KL to an in-memory ``reference``) on held-out text, and lm-eval ``tasks`` if
    given (report keys ``tasks`` and ``lm_eval_version``); returns the figures."""
    from layercut.compress.eval.evaluate import evaluate as evaluate_model

    cfg = _config(EvalConfig, config, {"reference": None, **options})
    tasks = None
    if cfg.tasks:  # checked (and their data loaded) before any model work
        from layercut.compress.eval.lmeval import load_tasks

        tasks = load_tasks(cfg.tasks, cfg.include_path)
    result = evaluate_model(model, tokenizer, text=cfg.text_sources()[0], ctx=cfg.ctx, max_tokens=cfg.max_tokens,
                            reference=reference, batch_size=cfg.batch_size, progress=progress)
    figures = result.to_dict()
    if tasks is not None:
        from layercut.compress.eval.lmeval import run_tasks

        figures.update(run_tasks(model, tokenizer, tasks, limit=cfg.limit, num_fewshot=cfg.num_fewshot,
                                 batch_size=cfg.batch_size, progress=progress))
    return figures


def export(model, tokenizer, output: str | os.PathLike, config: ExportConfig | None = None, overwrite: bool = False,
           **options) -> Path:
    """Write an in-memory model as a checkpoint (sharded safetensors + index), atomically; returns its path."""
    from layercut.compress.core.save import atomic_dir, check_output_dir, write_checkpoint_into
    from layercut.export.export import DTYPES, ensure_index

    cfg = _config(ExportConfig, config, options)
    check_output_dir(output, overwrite)
    # save_dtype casts what is written, not the caller's model: keep its tensors and put them back
    params = {n: p.data for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    dtype = model.config.dtype
    if cfg.save_dtype is not None:
        model.to(DTYPES[cfg.save_dtype])
        model.config.dtype = DTYPES[cfg.save_dtype]
    try:
        with atomic_dir(output, overwrite) as tmp:
            write_checkpoint_into(model, tokenizer, tmp, cfg.max_shard_size)
            ensure_index(tmp)
    finally:
        for name, param in model.named_parameters():
            param.data = params[name]
        for name, buf in buffers.items():
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = buf
        model.config.dtype = dtype
    return Path(output)


def run(recipe: Recipe | str | os.PathLike, output: str | os.PathLike, resume: bool = False,
        progress: bool = True) -> dict:
    """Run a whole recipe (a :class:`Recipe` or a YAML path) into the run directory ``output``."""
    from layercut.compress.workflow.pipeline import run_recipe
    from layercut.compress.workflow.recipe import load_recipe

    return run_recipe(recipe if isinstance(recipe, Recipe) else load_recipe(recipe), output, resume=resume,
                      progress=progress)
