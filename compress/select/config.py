"""Options of ``layercut score`` (a recipe's ``score`` stage) and the score-method names, beside the
selection algorithms they drive. Torch-free."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from layercut.calibrate import DEFAULT_CALIB_TEXT
from layercut.compress.core.errors import closest
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
    text_field_option,
)

METHODS = ("angular", "angular-all", "block-influence", "attn-cosine", "mlp-cosine", "gate-norm", "swap-kl")


class ScoreConfig(StageConfig, TextOptions):
    """Options of ``layercut score`` and of a recipe's ``score`` stage."""

    help: ClassVar[str] = "score every layer's importance and list the layers each method would drop"
    examples: ClassVar[tuple[str, ...]] = (
        "layercut score bundled:smollm2-135m --method all --span 8 --drop 8 --plot scores.png",
        "layercut score ./model --method gate-norm --drop 8 -o plan.json",
    )

    stage: Literal["score"] = "score"
    method: str | list[str] = Field("all", description=f"{', '.join(METHODS)}, or all (every method but the slow "
                                                       "swap-kl); comma-separate several", json_schema_extra={"metavar": "METHODS"})
    span: int | None = Field(None, ge=1, description="length n of the block spans the angular distance compares "
                                                     "(none: --drop, else 1)", json_schema_extra={"metavar": "N"})
    drop: int | None = Field(None, ge=1, description="also list the N layers each method would drop (none: --span)",
                             json_schema_extra={"metavar": "N"})
    calib: TextSpec = Field(DEFAULT_CALIB_TEXT, description="calibration text: " + TEXT_SPEC_HELP)
    text_field: str | None = text_field_option()
    messages_field: str | None = messages_field_option()
    chat_template: bool = chat_template_option()
    samples: int = Field(64, ge=1, description="calibration sequences")
    seq_len: int = Field(512, ge=2, description="tokens per calibration sequence")
    batch_size: int = Field(8, ge=1, description="sequences per forward pass")
    swap_samples: int = Field(4, ge=1, description="sequences used by swap-kl")
    device: str = device_option()
    dtype: Dtype = Field("auto", description=STREAM_DTYPE_HELP)
    whole_model: bool = Field(False, description=WHOLE_MODEL_HELP + "; swap-kl always loads it")

    @field_validator("method")
    @classmethod
    def _methods(cls, v: str | list[str]) -> str | list[str]:
        parse_methods(v)
        return v


def parse_methods(value: str | list[str]) -> list[str]:
    """``"all"`` or a comma list -> method names (swap-kl only when named).

    >>> parse_methods("block-influence, angular")
    ['block-influence', 'angular']
    """
    names = [m.strip() for m in (value.split(",") if isinstance(value, str) else value) if m.strip()]
    if "all" in names:
        # swap-kl needs full-model forwards per adjacent pair (tens of CPU-minutes on a
        # 135M model): a diagnostic you ask for by name, not part of "all".
        return [m for m in METHODS if m != "swap-kl"] + [m for m in names if m == "swap-kl"]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        bad = unknown[0] if unknown else value
        near = closest(str(bad), [*METHODS, "all"])
        hint = f", did you mean '{near}'?" if near else ""
        raise ValueError(f"unknown score method '{bad}'{hint} (choose from {', '.join(METHODS)}, all)")
    return list(dict.fromkeys(names))
