"""Layer selection: which blocks / sublayers a model can lose.

Usage::

    from layercut.compress.select import compute_scores, select_blocks, select_sublayers, gate_norm_scores
    scores = compute_scores(model, calib, span=8)      # one capture-driver pass
    select_blocks(scores, 8, "block-influence")

    layercut score bundled:smollm2-135m --method all --span 8 --json

Modules: ``config`` (the score stage's options), ``cores`` (tensor formulas), ``driver`` (driver
callback, LayerScores, selection),
``gate_norm`` (data-free, from safetensors), ``swap_kl`` (diagnostic), ``plot`` (PNG).
"""

import importlib

_DRIVER = "layercut.compress.select.driver"
_EXPORTS = {
    "BLOCK_METHODS": _DRIVER, "DATA_METHODS": _DRIVER, "SUBLAYER_METHODS": _DRIVER, "LayerScores": _DRIVER,
    "compute_scores": _DRIVER, "load_scores": _DRIVER, "rankings": _DRIVER, "select_blocks": _DRIVER,
    "select_sublayers": _DRIVER,
    "gate_norm_from_model": "layercut.compress.select.gate_norm",
    "gate_norm_scores": "layercut.compress.select.gate_norm",
    "gate_norm_select": "layercut.compress.select.gate_norm",
    "plot_scores": "layercut.compress.select.plot",
    "swap_kl_scores": "layercut.compress.select.swap_kl",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # lazy (PEP 562): the torch-free select.config must not pull in torch
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
