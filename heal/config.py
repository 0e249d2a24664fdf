"""Healing settings and the result record.

Usage::

    from layercut.heal.config import HealConfig
    cfg = HealConfig(steps=300, rank=16, loss="kd", lr=5e-4)    # typo'd keys are errors
    cfg = HealConfig.parse({"steps": 300})                      # LayercutError on bad input

``HealConfig`` is the heal stage's one config, defined here beside the algorithm and shared by
the stage (:mod:`layercut.compress.workflow.stages.heal`), the CLI, recipes and
:func:`layercut.heal.train.heal_model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, ValidationError, model_validator

from layercut.calibrate import DEFAULT_CALIB_TEXT
from layercut.calibrate.sources import FIELD_KEYS
from layercut.compress.core.errors import LayercutError, format_error, unknown_key_message
from layercut.compress.options import (
    SOURCE,
    TEXT_SPEC_HELP,
    Dtype,
    StageConfig,
    TextOptions,
    TextSpec,
    chat_template_option,
    device_option,
    messages_field_option,
    text_field_option,
)

__all__ = ["HealConfig", "HealResult", "BUNDLED_HEAL_OFFSET", "DEFAULT_DATA"]

DEFAULT_DATA = DEFAULT_CALIB_TEXT
# Heal windows on the bundled calibration text start at this token of its EOS-joined stream.
# A default calibration draw (128 x 512 tokens, offset 0) only ever reads the first
# (128 + 1) * 512 * 4 + 512 = 264,704 tokens (see layercut.calibrate.data.calibration_batch), so the
# heal windows never reuse a calibration sequence; ~780k of the 1.08M SmolLM2 tokens remain.
BUNDLED_HEAL_OFFSET = 300_000
_ALIASES = {"batch": "batch_size"}  # the option's name before every stage said --batch-size


class HealConfig(StageConfig, TextOptions):
    """Options of ``layercut heal``, of a recipe's ``heal`` stage and of :func:`layercut.heal.train.heal_model`.

    ``batch_size`` is per process (the global batch is batch_size × processes).

    >>> HealConfig(steps=300, rank=16).lora_alpha
    32.0
    """

    model_config = StageConfig.model_config | {"frozen": True, "validate_assignment": False,
                                               "populate_by_name": True}
    help: ClassVar[str] = ("distillation from the original model: LoRA merged into dense weights (over a 4-bit copy "
                           "with --method qlora), or a GPTQ checkpoint's scales tuned in place (--method scales)")
    text_option: ClassVar[str] = "data"
    examples: ClassVar[tuple[str, ...]] = (
        "layercut heal cut8 --teacher bundled:smollm2-135m -o healed --steps 300 --rank 16",
        "layercut heal cut8 --teacher bundled:smollm2-135m -o healed --teacher-topk 64 --no-gradient-checkpointing",
        "layercut heal q4 --method scales --teacher bundled:smollm2-135m -o q4-tuned --steps 60",
        "layercut heal cut8 --method qlora --teacher bundled:smollm2-135m -o healed --steps 300",
    )

    stage: Literal["heal"] = "heal"
    teacher: str | None = Field(SOURCE, description="the original model to distil from (needed for kd and "
                                                    "kd+lm); in a recipe 'source' is the recipe's model",
                                json_schema_extra={"cli_default": None, "metavar": "MODEL"})
    data: TextSpec = Field(DEFAULT_DATA, description="training text: " + TEXT_SPEC_HELP)
    text_field: str | None = text_field_option()
    messages_field: str | None = messages_field_option()
    chat_template: bool = chat_template_option()
    data_offset: int | None = Field(None, ge=0, description=f"first token taken from each text source (none: "
                                                            f"{BUNDLED_HEAL_OFFSET} for {DEFAULT_DATA}, past every "
                                                            "calibration draw, else 0)",
                                    json_schema_extra={"metavar": "N"})
    samples: int | None = Field(None, ge=1, description="distinct training sequences (none: steps × batch size, "
                                                        "each seen once)", json_schema_extra={"metavar": "N"})
    method: Literal["lora", "qlora", "scales"] = Field(
        "lora", description="lora: LoRA adapters on the linears, merged into dense weights; qlora: the same "
                            "adapters trained over a --base-bits RTN copy of the student (far less memory), merged "
                            "into its dense weights; scales: a GPTQ checkpoint's group scales are trained in place "
                            "(codes, zeros and bytes unchanged; rank, alpha, dropout and targets do not apply)")
    base_bits: Literal[2, 3, 4, 8] = Field(4, description="qlora: bits of the frozen base (layercut's RTN, group "
                                                          "size 64)")
    steps: int = Field(200, ge=1, description="optimizer steps")
    rank: int = Field(16, ge=1, description="LoRA rank")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (none: 2 × rank)", json_schema_extra={"metavar": "X"})
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    lr: float = Field(5e-4, gt=0, description="peak AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    warmup: float = Field(0.05, ge=0.0, le=0.5, description="fraction of the steps with a linear warmup")
    schedule: Literal["cosine", "constant"] = Field("constant", description="learning rate after the warmup (constant beat cosine on brown-val, 3 of 3 seeds: docs/results/heal-schedule-brown-val.md)")
    grad_clip: float = Field(1.0, ge=0.0, description="largest gradient norm (0: no clipping)")
    targets: str = Field("all-linear", description="which linears get adapters: all-linear, mlp, attn, or a "
                                                   "comma list of a block's linears")
    loss: Literal["kd", "lm", "kd+lm"] = Field("kd", description="distillation from the teacher (kd), plain "
                                                                 "next-token loss (lm), or both")
    kd_weight: float = Field(0.5, ge=0.0, le=1.0, description="weight of the distillation term in kd+lm")
    temperature: float = Field(1.0, gt=0.0, description="distillation temperature")
    teacher_topk: int = Field(64, ge=0, description="run the teacher once over the data, keep only its K most likely "
                                                    "tokens per position (N·L·(8K+4) bytes) and free it before the "
                                                    "student loads, so the two are never resident together (0: run "
                                                    "it beside the student, full distributions)",
                              json_schema_extra={"metavar": "K"})
    seq_len: int = Field(512, ge=8, description="tokens per training sequence")
    batch_size: int = Field(4, ge=1, validation_alias=AliasChoices("batch_size", "batch"),
                            description="sequences per step per process")
    seed: int = Field(0, description="training seed (in a recipe: the recipe's seed unless given)")
    gradient_checkpointing: bool = Field(True, description="recompute activations in the backward pass: less "
                                                           "memory, slower")
    save_adapter: bool = Field(False, description="also keep the LoRA adapter in OUT/adapter")
    checkpoint_every: int = Field(0, ge=0, description="save the training state every K steps (0: never)")
    resume: bool = Field(False, description="continue an interrupted heal from OUT.heal-state")
    device: str = device_option()
    dtype: Dtype = Field("auto", description="dtype the models are loaded in: the frozen base trains in it, the "
                                             "LoRA adapters in float32 (auto: the checkpoint's own if bf16 or fp32; "
                                             "fp32 for fp16 and GPTQ checkpoints, which train poorly in fp16)")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:  # also accepts the old spelling `batch`
        if isinstance(data, dict):
            allowed = [*cls.model_fields, *_ALIASES]
            unknown = [k for k in data if k not in allowed]
            if unknown:
                raise ValueError(unknown_key_message(str(unknown[0]), cls.option_names()))
        return data

    @model_validator(mode="after")
    def _check(self) -> HealConfig:
        if self.teacher_topk and self.loss == "lm" and "teacher_topk" in self.model_fields_set:
            raise ValueError("teacher_topk needs a distillation loss (kd or kd+lm), not lm")
        if not self.targets.strip():
            raise ValueError("targets is empty")
        if self.method != "lora" and (self.resume or self.checkpoint_every):
            raise ValueError(f"method {self.method}: --checkpoint-every/--resume are built for --method lora only (a "
                             "run restarts from its input)")
        if self.method != "qlora" and self.base_bits != type(self).model_fields["base_bits"].default:
            raise ValueError("base_bits is an option of --method qlora")
        return self

    @classmethod
    def parse(cls, values: dict[str, Any] | None = None, **kwargs: Any) -> HealConfig:
        """Build from a dict (e.g. a recipe section); bad keys/values become one LayercutError."""
        try:
            return cls(**{**(values or {}), **kwargs})
        except ValidationError as exc:
            raise LayercutError("heal config: " + format_error(exc)) from None

    @property
    def batch(self) -> int:
        return self.batch_size

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

    @property
    def num_samples(self) -> int:
        return self.samples if self.samples is not None else self.steps * self.batch_size

    @property
    def offset(self) -> int:
        """The first token of the (first) text source's stream."""
        return self.source_offsets()[0]

    def source_offsets(self) -> list[int]:
        """The first token taken from each text source: past every calibration draw on the bundled text."""
        if self.data_offset is not None:
            return [self.data_offset] * len(self.text_sources())
        return [BUNDLED_HEAL_OFFSET if s.source == DEFAULT_DATA else 0 for s in self.text_sources()]

    def fingerprint(self) -> dict[str, Any]:
        """The settings a resumed run must share with the interrupted one."""
        unset = {k for k in FIELD_KEYS if getattr(self, k) in (None, False)}
        # (the text options at their defaults stay out: states saved before they existed still resume)
        return self.model_dump(exclude={"checkpoint_every", "resume", "save_adapter", "teacher", "stage", "dtype", "device",
                                        "base_bits", *unset})



@dataclass
class HealResult:
    """What :func:`layercut.heal.train.heal_model` did. ``model`` is the merged (dense) student."""

    steps: int
    tokens: int  # real (non-pad) tokens trained on, this process
    seconds: float
    tokens_per_s: float
    loss_first: float  # mean loss of the first min(10, steps) steps
    loss_last: float  # mean loss of the last min(10, steps) steps
    trainable_params: int
    targets: list[str]
    lora_modules: int
    quantized_input: bool
    merged: bool
    resumed_from: int = 0
    output: str | None = None
    adapter: str | None = None
    notes: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    model: Any = None

    def to_dict(self, with_losses: bool = False) -> dict[str, Any]:
        # shallow on purpose: dataclasses.asdict would deep-copy the model
        d = {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items() if k != "model"}
        if not with_losses:
            d.pop("losses", None)
        return d
