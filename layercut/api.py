"""The Python API behind ``import layercut``: the same stages as the command line, on models in memory.

``layercut/__init__.py`` re-exports these names lazily; see its docstring for usage. Every function
takes the options of its stage as keywords (``group_size=64``) or a config object
(``config=layercut.QuantizeConfig(bits=4)``); they are the CLI's flags and the recipe's keys,
defined once beside each stage. A bad option raises :class:`LayercutError` naming the closest valid one.
Each function calls its stage's in-memory entry point (``<stage>_model`` in
``layercut.compress.workflow.stages.<stage>``; heal's is :func:`layercut.heal.train.heal_model`),
imported when first called: importing this module loads no torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from layercut.compress.core.errors import LayercutError, format_error
from layercut.compress.depth.config import PruneConfig
from layercut.compress.eval.config import EvalConfig
from layercut.compress.options import StageConfig, torch_dtype
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.select.config import ScoreConfig
from layercut.compress.workflow.recipe import Recipe, load_recipe
from layercut.export.config import ExportConfig
from layercut.heal.config import HealConfig

__all__ = ["load", "score", "prune", "heal", "quantize", "evaluate", "export", "run"]


def _config(cls: type[StageConfig], config: StageConfig | None, options: dict[str, Any]) -> Any:
    """``config`` (updated with ``options``) or ``cls(**options)``; one-line LayercutError if invalid."""
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

    path = resolve_model(model)
    return load_model(path, dtype=torch_dtype(dtype, path), device=device, trust_remote_code=trust_remote_code)


def score(model, tokenizer, config: ScoreConfig | None = None, progress: bool = False, **options) -> dict:
    """Per-layer scores of an in-memory model and the layers each method would drop.

    Returns ``{"selection": {method: layers}, "ranking": ..., "scores": ...}``.
    """
    from layercut.compress.workflow.stages.score import score_model

    return score_model(model, tokenizer, _config(ScoreConfig, config, options), progress)


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
    from layercut.compress.workflow.stages.eval import eval_model

    return eval_model(model, tokenizer, _config(EvalConfig, config, {"reference": None, **options}), reference,
                      progress)


def export(model, tokenizer, output: str | os.PathLike, config: ExportConfig | None = None, overwrite: bool = False,
           **options) -> Path:
    """Write an in-memory model as a checkpoint (sharded safetensors + index), atomically; returns its path."""
    from layercut.compress.workflow.stages.export import export_model

    return export_model(model, tokenizer, _config(ExportConfig, config, options), output, overwrite)


def run(recipe: Recipe | str | os.PathLike, output: str | os.PathLike, resume: bool = False,
        progress: bool = True) -> dict:
    """Run a whole recipe (a :class:`Recipe` or a YAML path) into the run directory ``output``."""
    from layercut.compress.workflow.pipeline import run_recipe

    return run_recipe(recipe if isinstance(recipe, Recipe) else load_recipe(recipe), output, resume=resume,
                      progress=progress)
