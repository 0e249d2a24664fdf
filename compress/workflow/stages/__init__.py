"""The stages of layercut: one module each, with one config class, ``run`` and the core.

Usage::

    from layercut.compress.workflow.stages import config_types, stage_module
    stage_module("quantize").run(config_types()["quantize"](bits=4), "model/", "q4/")

Every stage has one ``<Name>Config`` (a :class:`~layercut.compress.options.StageConfig`:
the CLI flags, the recipe keys and the Python options all come from it), kept beside its
algorithm (``CONFIG_HOMES``), and its stage module has
``run(config, source, output, env=None) -> report``; where a stage can work in memory it
also has ``<stage>_model(model, tokenizer, config)``. Importing this package or a stage
module does not import torch (``layercut --help`` stays fast).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from layercut.compress.options import StageConfig

# in pipeline order; `layercut --help` lists them so
STAGES = ("score", "prune", "heal", "quantize", "export", "eval")
# Each stage's config lives beside its algorithm: reading a recipe never imports a stage module.
CONFIG_HOMES = {"score": "layercut.compress.select.config:ScoreConfig",
                "prune": "layercut.compress.depth.config:PruneConfig",
                "heal": "layercut.heal.config:HealConfig",
                "quantize": "layercut.compress.quant.config:QuantizeConfig",
                "export": "layercut.export.config:ExportConfig",
                "eval": "layercut.compress.eval.config:EvalConfig"}


def stage_module(name: str) -> ModuleType:
    return importlib.import_module(f"layercut.compress.workflow.stages.{name}")


def config_types() -> dict[str, type[StageConfig]]:
    """Stage name -> its config class (imported from its home, not from the stage module)."""
    out = {}
    for name in STAGES:
        module, _, cls = CONFIG_HOMES[name].partition(":")
        out[name] = getattr(importlib.import_module(module), cls)
    return out
