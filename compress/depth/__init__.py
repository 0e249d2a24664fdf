"""Depth compression: remove blocks or sublayers and repair the hole without training.

Usage::

    from layercut.compress.depth import drop_blocks, drop_sublayers, linear_replace, fuse_blocks
    from layercut.compress.workflow.stages.prune import prune    # the stage, with keywords
    drop_blocks(model, [12, 13])                                  # in place, stock config
    pruned = drop_sublayers(model, [4, 7], "attention")           # needs trust_remote_code to reload
    linear_replace(model, [12, 13, 25], calib, method="lstsq")    # ReplaceMe, one map per span
    fuse_blocks(model, [12, 13], calib=calib)                     # LaCo, calibrated coefficients
    prune("bundled:smollm2-135m", "out", drop=8, select="block-influence", replace="lstsq")

    layercut prune MODEL -o OUT --drop 8 --select block-influence --replace lstsq

Modules: ``cores`` (tensor formulas), ``blocks``, ``sublayers`` (+ ``templates/``),
``replace``, ``fuse``, ``prune`` (checks, selection and the transform the prune stage calls).
"""

import importlib

# Loaded on first use, so `layercut --help` does not import transformers' model code.
_EXPORTS = {
    "drop_blocks": "layercut.compress.depth.blocks",
    "cosine_map": "layercut.compress.depth.cores",
    "laco_merge": "layercut.compress.depth.cores",
    "lstsq_map": "layercut.compress.depth.cores",
    "merge_map_into_down": "layercut.compress.depth.cores",
    "apply_fuse": "layercut.compress.depth.fuse",
    "fuse_blocks": "layercut.compress.depth.fuse",
    "prune_model": "layercut.compress.depth.prune",
    "fit_linear_maps": "layercut.compress.depth.replace",
    "linear_replace": "layercut.compress.depth.replace",
    "merge_maps": "layercut.compress.depth.replace",
    "drop_sublayers": "layercut.compress.depth.sublayers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'layercut.compress.depth' has no attribute '{name}'")
