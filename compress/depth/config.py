"""Options of ``layercut prune`` (a recipe's ``prune`` stage), beside the depth algorithms they drive.

Torch-free: the recipe and the CLI build their parsers from it without loading a model. The request
checks that need no model (``parse_layers``, ``check_request``) live here too: the config runs them
when it is built; the checks that need the model are :mod:`layercut.compress.depth.prune`'s."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from layercut.calibrate import DEFAULT_CALIB_TEXT
from layercut.compress.core.errors import LayercutError
from layercut.compress.options import (
    STREAM_DTYPE_HELP,
    TEXT_SPEC_HELP,
    WHOLE_MODEL_HELP,
    Dtype,
    StageConfig,
    TextOptions,
    TextSpec,
    chat_template_option,
    device_option,
    messages_field_option,
    parse_fraction,
    text_field_option,
)

WHATS = ("block", "attention", "mlp")
REPLACES = ("none", "lstsq", "cosine")
SELECT_FOR = {
    "block": ("angular", "angular-all", "block-influence"),
    "attention": ("attn-cosine", "gate-norm", "cosine"),
    "mlp": ("mlp-cosine", "cosine"),
}


def parse_layers(text: str | Sequence[int] | None) -> list[int] | None:
    """``"3,4,5"`` or ``"12-17,25"`` -> sorted distinct ints; None stays None."""
    if text is None or not isinstance(text, str):
        return None if text is None else sorted(set(int(i) for i in text))
    out: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                if int(hi) < int(lo):
                    raise ValueError(part)
                out.update(range(int(lo), int(hi) + 1))
            else:
                out.add(int(part))
    except ValueError as exc:
        raise LayercutError(f"cannot parse --layers '{text}': use a list like 3,4,5 or 12-17,25") from exc
    if not out:
        raise LayercutError("--layers is empty")
    return sorted(out)


def check_request(
    what: str, drop: int | None, select: str | None, layers: list[int] | None, replace: str, fuse: bool,
    fuse_calibrate: bool = False,
) -> None:
    """Argument checks that need no model."""
    if fuse_calibrate and not fuse:
        raise LayercutError("--fuse-calibrate needs --fuse")
    if what not in WHATS:
        raise LayercutError(f"unknown --what '{what}' (choose from {', '.join(WHATS)})")
    if replace not in REPLACES:
        raise LayercutError(f"unknown --replace '{replace}' (choose from {', '.join(REPLACES)})")
    if replace != "none" and fuse:
        raise LayercutError("--replace and --fuse are alternatives: pick one")
    if what != "block" and (replace != "none" or fuse):
        raise LayercutError("--replace and --fuse apply to whole blocks (--what block)")
    if (select is None) == (layers is None):
        raise LayercutError("give exactly one of --select METHOD or --layers LIST")
    if select is not None:
        if select not in SELECT_FOR[what]:
            raise LayercutError(f"unknown selection method '{select}' for --what {what} "
                                f"(choose from {', '.join(SELECT_FOR[what])})")
        if drop is None:
            raise LayercutError("--select needs --drop N")
    if drop is not None and drop < 1:
        raise LayercutError(f"--drop must be at least 1 (got {drop})")
    if layers is not None and drop is not None and drop != len(layers):
        raise LayercutError(f"--drop {drop} disagrees with --layers ({len(layers)} layers)")


class PruneConfig(StageConfig, TextOptions):
    """Options of ``layercut prune`` and of a recipe's ``prune`` stage.

    >>> PruneConfig(drop="25%", select="angular").drop
    '25%'
    """

    help: ClassVar[str] = "remove blocks or sublayers (drop, linear replacement, fuse) and save a checkpoint"
    examples: ClassVar[tuple[str, ...]] = (
        "layercut prune bundled:smollm2-135m -o cut8 --drop 8 --select block-influence --replace lstsq",
        "layercut prune ./model -o cut --layers 12-17,25 --what attention",
    )

    stage: Literal["prune"] = "prune"
    drop: int | str | None = Field(None, description="how many blocks or sublayers to remove, or a percentage "
                                                     "of the blocks such as 25%", json_schema_extra={"metavar": "N"})
    select: str | None = Field(None, description="how to choose them: angular, angular-all or block-influence "
                                                 "(blocks); attn-cosine or gate-norm (attention); mlp-cosine (mlp)",
                               json_schema_extra={"metavar": "METHOD"})
    layers: str | list[int] | None = Field(None, description="or name the layers, e.g. 3,4,5 or 12-17,25",
                                           json_schema_extra={"metavar": "LIST"})
    what: Literal["block", "attention", "mlp"] = Field("block", description="what to remove")
    replace: Literal["none", "lstsq", "cosine"] = Field(
        "none", description="repair each removed span with one linear map fitted on data (least squares or "
                            "cosine) and merged into the block before it")
    stream: Literal["original", "sequential"] = Field(
        "sequential", description="activations the maps are fitted on: the original model's, or those of the "
                                  "model repaired so far")
    alpha: float = Field(1e-4, ge=0.0, description="ridge term of the least-squares fit, relative to the mean "
                                                   "squared activation")
    fuse: bool = Field(False, description="fold the removed blocks into their neighbour instead (LaCo)")
    fuse_calibrate: bool = Field(False, description="fit one merge coefficient per matrix on data (with --fuse)")
    calib: TextSpec = Field(DEFAULT_CALIB_TEXT, description="calibration text: " + TEXT_SPEC_HELP)
    text_field: str | None = text_field_option()
    messages_field: str | None = messages_field_option()
    chat_template: bool = chat_template_option()
    samples: int = Field(64, ge=1, description="calibration sequences")
    seq_len: int = Field(512, ge=2, description="tokens per calibration sequence")
    batch_size: int = Field(8, ge=1, description="sequences per forward pass")
    device: str = device_option()
    dtype: Dtype = Field("auto", description=STREAM_DTYPE_HELP)
    whole_model: bool = Field(False, description=WHOLE_MODEL_HELP + "; sublayer removal and fuse always load it")

    @field_validator("drop")
    @classmethod
    def _drop(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"drop must be a count >= 1 or a percentage like 25%, got {v}")
        if isinstance(v, str):
            frac = parse_fraction(v, "drop") if v.strip().endswith("%") else None
            if frac is None or not 0 < frac < 1:
                raise ValueError(f"drop must be a count >= 1 or a percentage in (0%, 100%), got '{v}'")
        return v

    @model_validator(mode="after")
    def _request(self) -> PruneConfig:
        drop = self.drop if isinstance(self.drop, int) or self.drop is None else None if self.layers else 1
        try:
            picked = parse_layers(self.layers)
            check_request(self.what, drop, self.select, picked, self.replace, self.fuse, self.fuse_calibrate)
        except LayercutError as exc:  # the checks speak in flags; a config names its keys
            raise ValueError(re.sub(r"--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), str(exc))) from None
        return self

    def count(self, num_layers: int) -> int | None:
        """``drop`` as a count: ``"25%"`` of ``num_layers``, rounded, at least 1.

        >>> PruneConfig(drop="25%", select="angular").count(30)
        8
        """
        if self.drop is None or isinstance(self.drop, int):
            return self.drop
        return max(1, int(parse_fraction(self.drop) * num_layers + 0.5))
