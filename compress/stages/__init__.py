"""The stages of layercut: one module each, with one config class, ``run`` and the core.

Usage::

    from layercut.compress.stages import config_types, stage_module
    stage_module("quantize").run(config_types()["quantize"](bits=4), "model/", "q4/")

Every stage module defines ``<Name>Config`` (a :class:`~layercut.compress.options.StageConfig`:
the CLI flags, the recipe keys and the Python options all come from it) and
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
CONFIG_NAMES = {"score": "ScoreConfig", "prune": "PruneConfig", "heal": "HealConfig", "quantize": "QuantizeConfig",
                "export": "ExportConfig", "eval": "EvalConfig"}


def stage_module(name: str) -> ModuleType:
    return importlib.import_module(f"layercut.compress.stages.{name}")


def config_types() -> dict[str, type[StageConfig]]:
    """Stage name -> its config class."""
    return {name: getattr(stage_module(name), CONFIG_NAMES[name]) for name in STAGES}
