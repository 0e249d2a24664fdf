"""Options of ``layercut eval`` (a recipe's ``eval`` stage), beside the evaluation code they drive
(evaluate, stream_eval, lmeval, gates). Torch-free."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from layercut.calibrate import DEFAULT_EVAL_TEXT
from layercut.compress.options import (
    SOURCE,
    STREAM_DTYPE_HELP,
    WHOLE_MODEL_HELP,
    Dtype,
    StageConfig,
    TextOptions,
    chat_template_option,
    device_option,
    messages_field_option,
    parse_fraction,
    text_field_option,
)


class EvalConfig(StageConfig, TextOptions):
    """Options of ``layercut eval`` and of a recipe's ``eval`` stage."""

    help: ClassVar[str] = ("held-out perplexity, KL to a reference model, size and speed, with quality gates; "
                           "optionally lm-eval tasks")
    examples: ClassVar[tuple[str, ...]] = (
        "layercut eval bundled:smollm2-135m --max-tokens 4096 --json",
        "layercut eval runs/demo/04-export/model --reference bundled:smollm2-135m --max-kl 0.1",
        "layercut eval bundled:smollm2-135m --tasks brown_cloze --limit 200",
    )

    text_option: ClassVar[str] = "text"

    stage: Literal["eval"] = "eval"
    text: str = Field(DEFAULT_EVAL_TEXT, description="evaluation text: bundled:NAME, a .txt or .jsonl file, "
                                                     "or hf:NAME[:CONFIG][@SPLIT]")
    text_field: str | None = text_field_option()
    messages_field: str | None = messages_field_option()
    chat_template: bool = chat_template_option()
    ctx: int = Field(512, ge=2, description="window length in tokens")
    max_tokens: int = Field(16384, ge=2, description="tokens taken from the start of the text")
    batch_size: int = Field(4, ge=1, description="windows (or task requests) per forward pass")
    device: str = device_option()
    dtype: Dtype = Field("auto", description=STREAM_DTYPE_HELP)
    whole_model: bool = Field(False, description=WHOLE_MODEL_HELP)
    reference: str | None = Field(
        SOURCE, description="model to compare with (KL, its own perplexity); in a recipe 'source' is the "
                            "recipe's model", json_schema_extra={"cli_default": None, "metavar": "MODEL"})
    max_ppl_increase: str | float | None = Field(
        None, description="quality gate: fail (exit code 3) if perplexity rises more than this over the "
                          "reference's, e.g. 5% or 0.05", json_schema_extra={"metavar": "PCT"})
    max_kl: float | None = Field(None, ge=0, description="quality gate: fail (exit code 3) if the KL to the "
                                                         "reference exceeds this", json_schema_extra={"metavar": "X"})
    tasks: str | list[str] | None = Field(
        None, description="lm-eval tasks to run after the perplexity pass, comma-separated (brown_cloze ships "
                          "with layercut); unlike perplexity and KL, which stream, task evals load the whole "
                          "model into memory; needs the eval extra: pip install 'layercut[eval]'",
        json_schema_extra={"metavar": "T1,T2"})
    limit: int | None = Field(None, ge=1, le=100_000, description="items scored per task; none = all")
    num_fewshot: int | None = Field(None, ge=0, le=32, description="few-shot examples per task item; "
                                                                    "none = the task's own setting")
    include_path: str | None = Field(None, description="a folder of lm-eval task YAML files to search besides "
                                                       "layercut's own tasks (offline: tasks with local data "
                                                       "files)", json_schema_extra={"metavar": "DIR"})

    @field_validator("reference", mode="before")
    @classmethod
    def _old_bool(cls, v: Any) -> Any:  # recipes before the config rewrite said `reference: true/false`
        return SOURCE if v is True else None if v is False else v

    @field_validator("max_ppl_increase")
    @classmethod
    def _pct(cls, v: str | float | None) -> str | float | None:
        if v is not None:
            parse_fraction(v, "max_ppl_increase")
        return v

    @field_validator("tasks")
    @classmethod
    def _task_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        names = [t.strip() for t in (v.split(",") if isinstance(v, str) else v)]
        if not names or not all(names):
            raise ValueError(f"tasks: expected task names like brown_cloze,other, got {v!r}")
        return list(dict.fromkeys(names))

    @model_validator(mode="after")
    def _task_options_need_tasks(self) -> EvalConfig:
        given = [k for k in ("limit", "num_fewshot", "include_path") if getattr(self, k) is not None]
        if given and not self.tasks:
            raise ValueError(f"{given[0]} applies to task evals: give tasks too")
        return self

    @model_validator(mode="after")
    def _gates_need_reference(self) -> EvalConfig:
        if self.reference is None and (self.max_ppl_increase is not None or self.max_kl is not None):
            raise ValueError("the gates max_ppl_increase and max_kl compare with a reference model: "
                             "give reference (a model, or 'source' in a recipe)")
        return self
