"""The depth algorithm: pick layers, remove them (drop / linear replace / fuse), write a checkpoint.

Usage::

    from layercut.compress.workflow.stages.prune import prune     # the stage, with keywords
    report = prune("bundled:smollm2-135m", "out/cut8", drop=8, select="block-influence", replace="lstsq")

The stage itself (config, validation, report) is :mod:`layercut.compress.workflow.stages.prune`; this
module holds the checks that need the model and the transform core it calls, and imports no stage
(the request checks that need no model are :mod:`layercut.compress.depth.config`'s).

    layercut prune bundled:smollm2-135m -o out/cut8 --drop 8 --select block-influence --replace lstsq
    layercut prune MODEL -o OUT --layers 12-17,25,26                       # explicit blocks
    layercut prune MODEL -o OUT --drop 8 --what attention --select gate-norm

Every argument is validated before any work, and the output directory appears only when
complete (``layercut.compress.core.save.atomic_dir``). Besides the weights it holds
``layercut_prune.json``: which layers (old numbering), how they were chosen (with the
scores), the transform and its per-span fit statistics.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from layercut.compress.core.arch import arch_for
from layercut.compress.core.errors import LayercutError
from layercut.compress.depth.blocks import check_block_drop_supported, drop_blocks, validate_layers
from layercut.compress.depth.fuse import fuse_blocks
from layercut.compress.depth.replace import check_replace_supported, linear_replace
from layercut.compress.depth.sublayers import drop_sublayers, sublayer_family
from layercut.compress.select.driver import LayerScores, compute_scores, select_blocks, select_sublayers
from layercut.compress.select.gate_norm import gate_norm_from_model, gate_norm_scores

PRUNE_VERSION = 1
def check_against_model(model: nn.Module, what: str, count: int, layers: list[int] | None, replace: str) -> int:
    """Checks that need the model; returns its layer count."""
    num_layers = len(arch_for(model).layers_of(model))
    if count >= num_layers:
        raise LayercutError(f"cannot remove {count} {what}{'s' if what == 'block' else ' sublayers'} of a "
                            f"{num_layers}-layer model: at least one must remain")
    if layers is not None:
        validate_layers(layers, num_layers, what)
    if what == "block":
        check_block_drop_supported(model)
    else:
        sublayer_family(model)
    if replace != "none":
        check_replace_supported(model)
        if layers is not None and 0 in layers:
            raise LayercutError("--replace needs block 0 kept: its down_proj would absorb no map")
    return num_layers


def exclude_first_block(scores):
    """A copy of block scores in which block 0 cannot be chosen (no earlier block to take a map)."""
    import copy

    out = copy.deepcopy(scores)
    for name in ("block_influence", "angular", "angular_all"):
        values = getattr(out, name)
        if values:
            values[0] = float("inf")
    for table in (out.angular_spans or {}).values():
        table[0] = float("inf")
    return out


def choose_layers(model, model_dir: Path | None, what: str, drop: int, select: str, calib, batch_size: int,
                  progress: bool, keep_first: bool = False, scores: dict | None = None) -> tuple[list[int], dict | None]:
    """Run the selection API; returns (layers, scores as a dict).

    ``keep_first``: never choose block 0 (linear replacement folds each map into the block
    before its span). ``scores``: block scores an earlier call returned (same model and
    calibration) to select from instead of scoring again (``layercut plan`` scores once for
    all its depth cuts); refused by the selection where they cannot serve (an angular span).
    """
    if select == "gate-norm":  # from the files when there are files, else from the weights in memory
        scores = gate_norm_scores(model_dir) if model_dir is not None else gate_norm_from_model(model)
        source = model_dir if model_dir is not None else model
        return select_sublayers(source, drop, "gate-norm", "attention"), {"gate_norm": scores}
    methods = [select if select != "cosine" else ("attn-cosine" if what == "attention" else "mlp-cosine")]
    span = drop if select.startswith("angular") else 1
    if scores is not None and what == "block":
        scores = LayerScores.from_dict(scores)
    else:
        scores = compute_scores(model, calib, span=span, methods=methods, batch_size=batch_size, progress=progress)
    if what == "block":
        picked = select_blocks(exclude_first_block(scores) if keep_first else scores, drop, select)
    else:
        picked = select_sublayers(scores, drop, select, what)
    return [int(i) for i in picked], scores.to_dict()


def transform_name(replace: str, fuse: bool, fuse_calibrate: bool) -> str:
    if fuse:
        return "fuse-calibrated" if fuse_calibrate else "fuse"
    return "drop" if replace == "none" else f"replace-{replace}"


def prune_model(model: nn.Module, layers: list[int], what: str = "block", replace: str = "none", fuse: bool = False,
                calib=None, batch_size: int = 8, progress: bool = True, **replace_kwargs) -> tuple[nn.Module, dict]:
    """Apply one depth transform; returns (model, details). Block transforms work in place."""
    if what != "block":
        return drop_sublayers(model, layers, what), {}
    if replace != "none":
        fits = linear_replace(model, layers, calib, method=replace, batch_size=batch_size, progress=progress,
                              **replace_kwargs)
        return model, {"spans": [f.to_dict() for f in fits]}
    if fuse:
        groups = fuse_blocks(model, layers, calib=calib, batch_size=batch_size, progress=progress)
        return model, {"fuse_groups": [g.to_dict() for g in groups]}
    return drop_blocks(model, layers), {}
