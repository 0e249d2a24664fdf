"""The prune plan: what a prune run will remove and how, as data, before any tensor changes.

Usage::

    from layercut.compress.workflow.stages.prune import choose        # builds it from config + model
    plan = choose(model, tokenizer, PruneConfig(layers=[3, 4]))
    plan.layers, plan.params_after, plan.describe()

    layercut prune MODEL --layers 12-17 --dry-run           # prints it, writes nothing

Both prune paths (whole model and streamed) execute the same plan, and the report is built
from it, so ``--dry-run`` shows exactly what a run would do. The plan is free for explicit
``--layers`` and for data-free selection (``gate-norm``); data-driven selection runs its
scoring pass first (no fit, nothing written).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from layercut.compress.core.arch import arch_for, count_params

if TYPE_CHECKING:
    from torch import nn

TRANSFORM_WORDS = {
    "drop": "dropped",
    "replace-lstsq": "replaced by a least-squares linear map merged into the preceding block's down_proj",
    "replace-cosine": "replaced by a cosine-fitted linear map merged into the preceding block's down_proj",
}


@dataclass
class PrunePlan:
    """Which layers go (old numbering), how they were chosen, what replaces them, and the
    parameter count before and after (exact: the maps merge into existing weights)."""

    what: str                      # block | attention | mlp
    layers: list[int]
    select: str                    # the method, or "explicit"
    transform: str                 # drop | replace-lstsq | replace-cosine | fuse | fuse-calibrated
    num_layers: int
    params_before: int
    params_after: int
    calibration: dict | None = None   # text, samples, seq_len when the plan needs data
    scores: Any = None
    calib_set: Any = field(default=None, repr=False, compare=False)  # the tokens, kept for the fit

    @property
    def layers_after(self) -> int:
        return self.num_layers - len(self.layers) if self.what == "block" else self.num_layers

    def describe(self) -> str:
        what = "blocks" if self.what == "block" else f"{self.what} sublayers"
        how = TRANSFORM_WORDS.get(self.transform, self.transform)
        chosen = "chosen explicitly" if self.select == "explicit" else f"selected by {self.select}"
        return f"{what} {self.layers} of {self.num_layers} {how} ({chosen})"

    def to_dict(self) -> dict:
        """The plan as the report and ``--dry-run`` print it (no tokens, no scores)."""
        return {"what": self.what, "layers": self.layers, "select": self.select, "transform": self.transform,
                "num_layers_before": self.num_layers, "num_layers_after": self.layers_after,
                "params_before": self.params_before, "params_after": self.params_after,
                "calibration": self.calibration, "description": self.describe()}


def removed_params(model: nn.Module, what: str, layers: list[int]) -> int:
    """Parameters the removal takes away: whole blocks, or their attention / MLP sublayers
    (a lazily loaded model's meta tensors count the same; as :func:`count_params` counts them)."""
    spec = arch_for(model)
    blocks = spec.layers_of(model)
    total = 0
    for i in layers:
        block = blocks[i]
        if what == "block":
            total += count_params(block)
            continue
        for name in sublayer_params(spec, what):
            module = block.get_submodule(name) if name else block
            total += count_params(module)
    return total


def sublayer_params(spec, what: str) -> list[str]:
    """The block-relative module names a sublayer removal deletes (its norm included)."""
    names = [spec.attn, spec.attn_norm] if what == "attention" else [spec.mlp, spec.mlp_norm]
    return [n for n in names if n]
