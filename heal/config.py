"""Healing settings (validated strictly) and the result record.

Usage::

    from heal.config import HealConfig
    cfg = HealConfig(steps=300, rank=16, loss="kd", lr=5e-4)    # typo'd keys are errors
    cfg = HealConfig.parse({"steps": 300})                      # LayercutError on bad input

Rank, alpha, learning rate and loss default to what ``benchmarks/heal.py`` measured on
SmolLM2 with 8 blocks removed (``docs/results-heal.md``; the benchmark itself used 2 × 256
tokens per step and a constant schedule to fit the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compress.errors import LayercutError

DEFAULT_DATA = "bundled:brown-calib"
# Heal windows on the bundled calibration text start at this token of its EOS-joined stream.
# A default calibration draw (128 x 512 tokens, offset 0) only ever reads the first
# (128 + 1) * 512 * 4 + 512 = 264,704 tokens (see calibrate.data.calibration_batch), so the
# heal windows never reuse a calibration sequence; ~780k of the 1.08M SmolLM2 tokens remain.
BUNDLED_HEAL_OFFSET = 300_000


class HealConfig(BaseModel):
    """One healing run. ``batch`` is per process (the global batch is batch × processes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(200, description="optimizer steps")
    rank: int = Field(16, description="LoRA rank r")
    alpha: float | None = Field(None, description="LoRA alpha (default 2·rank)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    lr: float = Field(5e-4, description="peak AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0)
    warmup: float = Field(0.05, ge=0.0, le=0.5, description="fraction of steps with linear warmup")
    schedule: Literal["cosine", "constant"] = "cosine"
    grad_clip: float = Field(1.0, ge=0.0, description="max grad norm (0: off)")
    targets: str = Field("all-linear", description="all-linear | mlp | attn | comma list of block linears")
    loss: Literal["kd", "lm", "kd+lm"] = "kd"
    kd_weight: float = Field(0.5, ge=0.0, le=1.0, description="weight of KD in kd+lm")
    temperature: float = Field(1.0, gt=0.0)
    teacher_topk: int | None = Field(None, description="cache the teacher's top-k log-probs (None: on the fly)")
    data: str = DEFAULT_DATA
    data_offset: int | None = Field(None, ge=0, description=f"token offset (None: {BUNDLED_HEAL_OFFSET} "
                                                            f"for {DEFAULT_DATA}, else 0)")
    samples: int | None = Field(None, description="distinct sequences (None: steps × batch, each seen once)")
    seq_len: int = Field(512, ge=8)
    batch: int = Field(4, ge=1)
    seed: int = 0
    gradient_checkpointing: bool = True
    checkpoint_every: int = Field(0, ge=0, description="save training state every K steps (0: never)")
    resume: bool = False
    save_adapter: bool = False

    @model_validator(mode="after")
    def _check(self) -> HealConfig:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1 (got {self.steps})")
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1 (got {self.rank})")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0 (got {self.lr})")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"alpha must be > 0 (got {self.alpha})")
        if self.teacher_topk is not None and self.teacher_topk < 1:
            raise ValueError(f"teacher_topk must be >= 1 (got {self.teacher_topk})")
        if self.teacher_topk is not None and self.loss == "lm":
            raise ValueError("teacher_topk needs a distillation loss (kd or kd+lm), not lm")
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples must be >= 1 (got {self.samples})")
        if not self.targets.strip():
            raise ValueError("targets is empty")
        return self

    @classmethod
    def parse(cls, values: dict[str, Any] | None = None, **kwargs: Any) -> HealConfig:
        """Build from a dict (e.g. a recipe section); bad keys/values become one LayercutError."""
        try:
            return cls(**{**(values or {}), **kwargs})
        except ValidationError as exc:
            allowed = ", ".join(cls.model_fields)
            msgs = []
            for err in exc.errors():
                where = ".".join(str(p) for p in err["loc"])
                msg = err["msg"].removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    msg = f"unknown key (allowed: {allowed})"
                msgs.append(f"{where}: {msg}" if where else msg)
            raise LayercutError("heal config: " + "; ".join(msgs)) from None

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

    @property
    def num_samples(self) -> int:
        return self.samples if self.samples is not None else self.steps * self.batch

    @property
    def offset(self) -> int:
        if self.data_offset is not None:
            return self.data_offset
        return BUNDLED_HEAL_OFFSET if self.data == DEFAULT_DATA else 0

    def fingerprint(self) -> dict[str, Any]:
        """The settings a resumed run must share with the interrupted one."""
        return self.model_dump(exclude={"checkpoint_every", "resume", "save_adapter"})


@dataclass
class HealResult:
    """What :func:`heal.train.heal_model` did. ``model`` is the merged (dense) student."""

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
