"""One strict config per stage; its options mirror the stage's CLI command.

Usage::

    from compress.recipe_stages import QuantizeStage
    QuantizeStage(bits=[2, 3, 4, 8], avg_bits=3.5)     # same as `layercut quantize --bits 2,3,4,8 --avg-bits 3.5`
    QuantizeStage(bitz=4)                               # ValueError: unknown key 'bitz' (allowed: ...)

Every model here forbids unknown keys (and says which keys are allowed), and does not
coerce types (``"4"`` is not an int). :mod:`compress.recipe` assembles them into a recipe.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from calibrate import DEFAULT_EVAL_TEXT


class Strict(BaseModel):
    """Base: unknown keys are errors that list the allowed keys; no silent type coercion."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    @classmethod
    def option_names(cls) -> list[str]:
        return [k for k in cls.model_fields if k != "stage"]

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = set(cls.model_fields)
            unknown = [k for k in data if k not in allowed]
            if unknown:
                raise ValueError(f"unknown key '{unknown[0]}' (allowed: {', '.join(cls.option_names())})")
        return data


_SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$", re.IGNORECASE)


def check_size(text: str) -> str:
    """A shard size such as ``2GB`` or ``500MB`` (what ``save_pretrained`` accepts)."""
    if not _SIZE.match(text.strip()):
        raise ValueError(f"size '{text}' is not like 500MB or 2GB")
    return text.strip()


def parse_fraction(value: str | float | int, what: str = "value") -> float:
    """``"5%"`` -> 0.05, ``0.05`` -> 0.05; non-negative."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a number or a percentage like 5%, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
        except ValueError:
            raise ValueError(f"{what}: expected a number or a percentage like 5%, got '{value}'") from None
    else:
        number = float(value)
    if not number >= 0 or number == float("inf"):
        raise ValueError(f"{what}: must be a finite number >= 0, got {value!r}")
    return number


class CalibOptions(Strict):
    """Calibration options shared by the stages that need activations."""

    calib: str = "bundled:brown-calib"
    samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=2)
    batch_size: int = Field(8, ge=1)


class ScoreStage(CalibOptions):
    """``layercut score``: per-layer importance scores + plot + drop plan (model unchanged)."""

    stage: Literal["score"] = "score"
    method: str | list[str] = "all"
    span: int | None = Field(None, ge=1)
    drop: int | None = Field(None, ge=1)
    samples: int = Field(64, ge=1)
    swap_samples: int = Field(4, ge=1)

    @field_validator("method")
    @classmethod
    def _methods(cls, v: str | list[str]) -> str | list[str]:
        names = v.split(",") if isinstance(v, str) else v
        known = ("angular", "angular-all", "block-influence", "attn-cosine", "mlp-cosine", "gate-norm",
                 "swap-kl", "all")
        bad = [m for m in (n.strip() for n in names) if m not in known]
        if bad or not names:
            raise ValueError(f"unknown score method '{bad[0] if bad else v}' (choose from {', '.join(known)})")
        return v


class PruneStage(CalibOptions):
    """``layercut prune``: drop blocks or sublayers, optionally replace a span by a linear map or fuse.

    ``drop`` is a count as on the CLI, or a percentage of the blocks (``"25%"``, rounded
    to the nearest count, at least 1).
    """

    stage: Literal["prune"] = "prune"
    drop: int | str | None = None
    select: str | None = None
    layers: str | list[int] | None = None
    what: Literal["block", "attention", "mlp"] = "block"
    replace: Literal["none", "lstsq", "cosine"] = "none"
    stream: Literal["original", "sequential"] = "sequential"
    alpha: float = Field(1e-4, ge=0.0)
    fuse: bool = False
    fuse_calibrate: bool = False
    samples: int = Field(64, ge=1)

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
    def _request(self) -> PruneStage:
        from compress.depth.prune import check_request, parse_layers
        from compress.errors import LayercutError

        drop = self.drop if isinstance(self.drop, int) or self.drop is None else None if self.layers else 1
        try:
            picked = parse_layers(self.layers)
            check_request(self.what, drop, self.select, picked, self.replace, self.fuse, self.fuse_calibrate)
        except LayercutError as exc:  # the CLI's wording, with recipe key names
            raise ValueError(re.sub(r"--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), str(exc))) from None
        return self


class HealStage(Strict):
    """``layercut heal``: LoRA distillation from the recipe's source model, merged into dense weights.

    Options and defaults are :class:`heal.config.HealConfig`'s (validated again there);
    ``seed`` defaults to the recipe's seed; ``gradient_checkpointing`` is the CLI's
    ``--no-gradient-checkpointing`` the right way round. The teacher is always the source.
    """

    stage: Literal["heal"] = "heal"
    data: str = "bundled:brown-calib"
    data_offset: int | None = Field(None, ge=0)
    samples: int | None = Field(None, ge=1)
    steps: int = Field(200, ge=1)
    rank: int = Field(16, ge=1)
    alpha: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lr: float = Field(5e-4, gt=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    targets: str = "all-linear"
    loss: Literal["kd", "lm", "kd+lm"] = "kd"
    kd_weight: float = Field(0.5, ge=0.0, le=1.0)
    temperature: float = Field(1.0, gt=0.0)
    teacher_topk: int | None = Field(None, ge=1)
    seq_len: int = Field(512, ge=8)
    batch: int = Field(4, ge=1)
    seed: int | None = None
    gradient_checkpointing: bool = True
    save_adapter: bool = False

    @model_validator(mode="after")
    def _heal_config(self) -> HealStage:
        from compress.errors import LayercutError
        from heal.config import HealConfig

        try:
            HealConfig.parse(self.heal_options(0))
        except LayercutError as exc:
            raise ValueError(str(exc).removeprefix("heal config: ")) from None
        return self

    def heal_options(self, recipe_seed: int) -> dict:
        """The :class:`heal.config.HealConfig` fields for this stage."""
        opts = self.model_dump(exclude={"stage"})
        opts["seed"] = recipe_seed if self.seed is None else self.seed
        return opts


class QuantizeStage(CalibOptions):
    """``layercut quantize``: GPTQ, uniform ``bits`` or bits allocated per unit under ``avg_bits``.

    Options and defaults are the CLI's; ``candidates`` may be a list or ``"2,3,4,8"``;
    ``seed`` defaults to the recipe's seed.
    """

    stage: Literal["quantize"] = "quantize"
    bits: int | None = None
    avg_bits: float | None = Field(None, gt=0)
    candidates: str | list[int] = "2,3,4,8"
    unit: Literal["layer", "group"] = "layer"
    sensitivity: str = "output"
    sensitivity_samples: int = Field(16, ge=1)
    group_size: int = 64
    sym: bool = False
    act_order: bool = True
    static_groups: bool = True
    group_aware: bool = False
    method: Literal["gptq", "rtn"] = "gptq"
    damp: float = Field(0.01, gt=0, lt=1)
    sequential: Literal["block", "sublayer", "linear"] = "block"
    seed: int | None = None
    device: str | None = None
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"

    @model_validator(mode="after")
    def _request(self) -> QuantizeStage:
        from compress.quant.gptq import SUPPORTED_BITS
        from compress.quant.sensitivity import METHODS

        if (self.bits is None) == (self.avg_bits is None):
            raise ValueError("give exactly one of bits (uniform) or avg_bits (allocated per unit)")
        if self.bits is not None and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        bad = [b for b in self.candidate_list() if b not in SUPPORTED_BITS]
        if bad or not self.candidate_list():
            raise ValueError(f"candidates must be among {', '.join(map(str, SUPPORTED_BITS))}, got {self.candidates}")
        if self.sensitivity not in METHODS:
            raise ValueError(f"unknown sensitivity '{self.sensitivity}' (choose from {', '.join(METHODS)})")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 (one group per row) or positive, got {self.group_size}")
        return self

    def candidate_list(self) -> list[int]:
        if isinstance(self.candidates, list):
            return list(self.candidates)
        try:
            return [int(x) for x in self.candidates.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"candidates: expected integers like 2,3,4,8, got '{self.candidates}'") from None


class ExportStage(Strict):
    """``layercut export``: sharded safetensors + index, config, tokenizer, recipe, report, model card."""

    stage: Literal["export"] = "export"
    dequantize: bool = False
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    max_shard_size: str = "2GB"
    card: bool = True

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        return check_size(v)


class EvalStage(Strict):
    """``layercut eval``: held-out perplexity, KL to the source model, size and speed, with gates."""

    stage: Literal["eval"] = "eval"
    text: str = DEFAULT_EVAL_TEXT
    ctx: int = Field(512, ge=2)
    max_tokens: int = Field(16384, ge=2)
    batch_size: int = Field(4, ge=1)
    reference: bool = True  # KL to (and ppl of) the recipe's source model
    max_ppl_increase: str | float | None = None
    max_kl: float | None = Field(None, ge=0)

    _gate_names: ClassVar[tuple[str, ...]] = ("max_ppl_increase", "max_kl")

    @field_validator("max_ppl_increase")
    @classmethod
    def _pct(cls, v: str | float | None) -> str | float | None:
        if v is not None:
            parse_fraction(v, "max_ppl_increase")
        return v

    @model_validator(mode="after")
    def _gates_need_reference(self) -> EvalStage:
        if not self.reference and (self.max_ppl_increase is not None or self.max_kl is not None):
            raise ValueError("gates (max_ppl_increase, max_kl) compare to the source model: set reference: true")
        return self


STAGE_TYPES: dict[str, type[Strict]] = {
    "score": ScoreStage,
    "prune": PruneStage,
    "heal": HealStage,
    "quantize": QuantizeStage,
    "export": ExportStage,
    "eval": EvalStage,
}
