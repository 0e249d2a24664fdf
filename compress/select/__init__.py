"""Layer selection: which blocks / sublayers a model can lose.

Usage::

    from layercut.compress.select import compute_scores, select_blocks, select_sublayers, gate_norm_scores
    scores = compute_scores(model, calib, span=8)      # one capture-driver pass
    select_blocks(scores, 8, "block-influence")

    layercut score bundled:smollm2-135m --method all --span 8 --json

Modules: ``cores`` (tensor formulas), ``stage`` (driver callback, LayerScores, selection),
``gate_norm`` (data-free, from safetensors), ``swap_kl`` (diagnostic), ``plot`` (PNG).
"""

from layercut.compress.select.driver import (
    BLOCK_METHODS,
    DATA_METHODS,
    SUBLAYER_METHODS,
    LayerScores,
    compute_scores,
    load_scores,
    rankings,
    select_blocks,
    select_sublayers,
)
from layercut.compress.select.gate_norm import gate_norm_from_model, gate_norm_scores, gate_norm_select
from layercut.compress.select.plot import plot_scores
from layercut.compress.select.swap_kl import swap_kl_scores

__all__ = [
    "BLOCK_METHODS",
    "DATA_METHODS",
    "SUBLAYER_METHODS",
    "LayerScores",
    "compute_scores",
    "gate_norm_from_model",
    "gate_norm_scores",
    "gate_norm_select",
    "load_scores",
    "plot_scores",
    "rankings",
    "select_blocks",
    "select_sublayers",
    "swap_kl_scores",
]
