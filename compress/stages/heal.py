"""The heal stage: LoRA distillation from the original model, merged into dense weights.

Run it::

    layercut heal pruned/ --teacher bundled:smollm2-135m -o healed/ --steps 200

    from layercut.compress.stages.heal import HealConfig, run
    run(HealConfig(steps=200, teacher="bundled:smollm2-135m"), "pruned/", "healed/")

    from layercut.heal.train import heal_model                   # in memory: the same config
    result = heal_model(student, teacher, tokenizer, HealConfig(steps=200))

Checks run before anything is loaded or written: settings, output location, tokenizers,
configs, data. With ``teacher_topk`` (default 64; 0 turns it off) the teacher runs once over the data, is freed, and
only then is the student loaded, so the two never need to fit in memory together. Rank,
alpha, learning rate and loss default to what ``benchmarks/heal.py`` measured on SmolLM2
with 8 blocks removed (``docs/results-heal.md``).
"""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, ValidationError, model_validator

from layercut.calibrate import DEFAULT_CALIB_TEXT
from layercut.calibrate.sources import FIELD_KEYS
from layercut.compress.devices import on_device
from layercut.compress.stages.base import (
    SOURCE,
    TEXT_SPEC_HELP,
    Dtype,
    RunEnv,
    StageConfig,
    TextOptions,
    TextSpec,
    chat_template_option,
    device_option,
    messages_field_option,
    strip_volatile,
    text_field_option,
    unknown_key_message,
)

log = logging.getLogger("layercut.heal")
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
    help: ClassVar[str] = "LoRA distillation from the original model, merged into dense weights"
    text_option: ClassVar[str] = "data"
    examples: ClassVar[tuple[str, ...]] = (
        "layercut heal cut8 --teacher bundled:smollm2-135m -o healed --steps 300 --rank 16",
        "layercut heal cut8 --teacher bundled:smollm2-135m -o healed --teacher-topk 64 --no-gradient-checkpointing",
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
    steps: int = Field(200, ge=1, description="optimizer steps")
    rank: int = Field(16, ge=1, description="LoRA rank")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (none: 2 × rank)", json_schema_extra={"metavar": "X"})
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    lr: float = Field(5e-4, gt=0, description="peak AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    warmup: float = Field(0.05, ge=0.0, le=0.5, description="fraction of the steps with a linear warmup")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="learning rate after the warmup")
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
        return self

    @classmethod
    def parse(cls, values: dict[str, Any] | None = None, **kwargs: Any) -> HealConfig:
        """Build from a dict (e.g. a recipe section); bad keys/values become one LayercutError."""
        from layercut.compress.errors import LayercutError
        from layercut.compress.stages.flags import format_error

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
                                        *unset})


def _train_dtype(name: str, path):
    """``--dtype`` for training: ``auto`` keeps bf16/fp32 checkpoints as they are, but loads fp16 ones
    (no loss scaling here) and GPTQ ones (dequantized into dense layers) in float32."""
    import json

    import torch

    from layercut.compress.stages.base import torch_dtype

    dtype = torch_dtype(name, path)
    if name == "auto" and (dtype == torch.float16 or "quantization_config" in json.loads(
            (Path(path) / "config.json").read_text())):
        return torch.float32
    return dtype


_HEAL_VOLATILE = ("seconds", "output", "source", "tokens_per_s", "adapter")


def _dims(config) -> tuple[int | None, int | None]:
    return getattr(config, "hidden_size", None), getattr(config, "vocab_size", None)


@on_device
def run(config: HealConfig, source: str | Path, output: str | Path, env: RunEnv | None = None) -> dict:
    """Heal ``source`` by distillation from ``config.teacher``; write the merged model to ``output``.

    Returns the report; ``heal.json`` in the checkpoint holds it without timings or paths.
    """
    from transformers import AutoConfig

    from layercut.compress.errors import LayercutError
    from layercut.compress.models import load_model, load_tokenizer, resolve_model
    from layercut.export.checkpoint import check_output_dir
    from layercut.heal.data import build_topk_cache, heal_data
    from layercut.heal.lora import check_tokenizers
    from layercut.heal.state import default_state_dir
    from layercut.heal.train import heal_model

    env = env or RunEnv()
    out = check_output_dir(output, env.overwrite)
    if config.loss != "lm" and config.teacher is None:
        raise LayercutError(f"--loss {config.loss} needs a teacher (--teacher ORIGINAL)")
    state = default_state_dir(out)
    if config.resume and not state.is_dir():
        raise LayercutError(f"--resume: no heal checkpoint in {state}")
    trust = env.trust_remote_code
    student_path = resolve_model(source)
    tokenizer = load_tokenizer(student_path, trust)
    teacher_path = env.resolve(config.teacher, "teacher")
    if teacher_path is not None:
        check_tokenizers(tokenizer, load_tokenizer(teacher_path, trust))
        s_hidden, s_vocab = _dims(AutoConfig.from_pretrained(student_path, trust_remote_code=trust))
        t_hidden, t_vocab = _dims(AutoConfig.from_pretrained(teacher_path, trust_remote_code=trust))
        if s_vocab != t_vocab:
            raise LayercutError(f"teacher has a different vocabulary ({t_vocab} vs the student's {s_vocab})")
        if s_hidden != t_hidden:
            raise LayercutError(f"student is not a descendant of the teacher: hidden size {s_hidden} vs {t_hidden}")
    data = heal_data(tokenizer, config)

    teacher = None
    if teacher_path is not None and config.loss != "lm":
        teacher, _ = load_model(teacher_path, dtype=_train_dtype(config.dtype, teacher_path), trust_remote_code=trust)
        if config.teacher_topk:
            cache = build_topk_cache(teacher, data, config.teacher_topk, config.temperature, config.batch_size,
                                     progress=env.progress)
            del teacher
            gc.collect()
            teacher = cache
    student, _ = load_model(student_path, dtype=_train_dtype(config.dtype, student_path), trust_remote_code=trust)
    result = heal_model(student, teacher, tokenizer, config, out_dir=out, progress=env.progress, data=data,
                        overwrite=env.overwrite)
    for note in result.notes:
        log.warning("note: %s", note)
    info_file = out / "heal.json"
    losses: list[float] = []
    if info_file.is_file():  # no timings or paths inside the checkpoint: reruns are byte-identical
        info = strip_volatile(json.loads(info_file.read_text()), _HEAL_VOLATILE)
        info_file.write_text(json.dumps(info, indent=2, default=str) + "\n")
        losses = info.get("losses") or []
    report = result.to_dict()
    # first/last quarter of the steps (heal's own loss_first/last average 10 steps, which overlap on short runs)
    k = max(1, len(losses) // 4)
    if losses:
        report["loss_start"], report["loss_end"] = sum(losses[:k]) / k, sum(losses[-k:]) / k
    else:
        report["loss_start"], report["loss_end"] = report.get("loss_first"), report.get("loss_last")
    report["loss_window"] = k
    report.update(model=str(source), teacher=str(config.teacher) if config.teacher else None)
    return report
