"""layercut: post-training compression for causal LMs, and its Python API.

Usage (the README's "Python API" block, which ``tests/test_api.py`` runs)::

    import layercut
    model, tokenizer = layercut.load("bundled:smollm2-135m")
    before = layercut.evaluate(model, tokenizer, max_tokens=512)
    model = layercut.prune(model, tokenizer, drop=2, select="block-influence", samples=8, seq_len=128)
    after = layercut.evaluate(model, tokenizer, max_tokens=512)
    layercut.export(model, tokenizer, "smollm2-28-blocks", save_dtype="bf16")

    report = layercut.run("recipes/smollm2-demo.yaml", "runs/demo")     # a whole recipe, on disk

The functions live in :mod:`layercut.api`. This file imports nothing up front (PEP 562), so
``import layercut.calibrate.data`` does not drag in the top layer, and ``import layercut`` is cheap:
torch loads on the first call. The packages under this root, bottom to top, are described in
``docs/architecture.md``.

``layercut.heal`` and ``layercut.export`` name both a subpackage and an API function: the
subpackages are callable and forward to :func:`layercut.api.heal` and :func:`layercut.api.export`,
so ``layercut.export(model, tokenizer, path)`` and ``import layercut.export.card`` both work.
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from pathlib import Path
from typing import Any

# A checkout used without installing it (PYTHONPATH=checkout, as scripts/gpu_check.sh runs): the
# subpackages are the sibling folders compress/, calibrate/, heal/ and export/. Installed (wheel or
# editable), setuptools' package-dir mapping finds them and the folders checked here do not exist.
_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "compress" / "__init__.py").is_file():
    __path__.append(str(_ROOT))  # noqa: F821 (a package's __path__)

try:
    __version__ = _version("layercut")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# The stage configs come from the stage table (layercut.compress.workflow.stages.CONFIGS), which
# imports each from its home: this file names them, it does not say where they live.
_STAGES = "layercut.compress.workflow.stages"
_LAZY = {
    "load": "layercut.api", "score": "layercut.api", "prune": "layercut.api", "quantize": "layercut.api",
    "evaluate": "layercut.api", "run": "layercut.api",
    "heal": "layercut.heal", "export": "layercut.export",  # callable subpackages, see above
    "LayercutError": "layercut.compress.core.errors", "GateFailed": "layercut.compress.core.errors",
    "Recipe": "layercut.compress.workflow.recipe",
    "ScoreConfig": _STAGES, "PruneConfig": _STAGES, "HealConfig": _STAGES, "QuantizeConfig": _STAGES,
    "EvalConfig": _STAGES, "ExportConfig": _STAGES,
}

__all__ = [*_LAZY, "__version__"]


class _CallableModule(types.ModuleType):
    """A subpackage that can be called: ``layercut.heal(...)`` is :func:`layercut.api.heal`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        api = import_module("layercut.api")
        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


def make_callable(module_name: str) -> None:
    """Make the subpackage ``module_name`` callable as the API function of its last name."""
    sys.modules[module_name].__class__ = _CallableModule


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'layercut' has no attribute {name!r}")
    module = import_module(_LAZY[name])
    value = module if name in ("heal", "export") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
