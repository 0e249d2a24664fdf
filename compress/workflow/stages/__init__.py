"""The stages of layercut: one module each, with one config class, ``run`` and the core.

Usage::

    from layercut.compress.workflow.stages import config_types, stage_module
    stage_module("quantize").run(config_types()["quantize"](bits=4), "model/", "q4/")

Every stage has one ``<Name>Config`` (a :class:`~layercut.compress.options.StageConfig`:
the CLI flags, the recipe keys and the Python options all come from it), kept beside its
algorithm and imported here (``CONFIGS``: the one table of the stages and their configs), and
its stage module has ``run(config, source, output, env=None) -> report``; where a stage can
work in memory it also has ``<stage>_model(model, tokenizer, config)``. Importing this package
does not import torch (the configs are torch-free, so ``layercut --help`` stays fast); a stage
module does, and loads only when its stage runs (:func:`stage_module`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from layercut.compress.depth.config import PruneConfig
from layercut.compress.eval.config import EvalConfig
from layercut.compress.options import StageConfig
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.select.config import ScoreConfig
from layercut.export.config import ExportConfig
from layercut.heal.config import HealConfig

__all__ = ["CONFIGS", "STAGES", "EvalConfig", "ExportConfig", "HealConfig", "PruneConfig", "QuantizeConfig",
           "ScoreConfig", "config_types", "stage_module"]

# Stage name -> its config class, in pipeline order (`layercut --help` lists them so). Each config
# lives beside its algorithm: reading a recipe or building the CLI never imports a stage module.
CONFIGS: dict[str, type[StageConfig]] = {"score": ScoreConfig, "prune": PruneConfig, "heal": HealConfig,
                                          "quantize": QuantizeConfig, "export": ExportConfig, "eval": EvalConfig}
STAGES = tuple(CONFIGS)


def stage_module(name: str) -> ModuleType:
    """The stage module of ``name`` (its ``run``), imported on first use: it imports torch."""
    return importlib.import_module(f"layercut.compress.workflow.stages.{name}")


def config_types() -> dict[str, type[StageConfig]]:
    """Stage name -> its config class (a copy of ``CONFIGS``)."""
    return dict(CONFIGS)
