"""The eval stage: held-out perplexity, KL to a reference model, size and speed, quality gates;
optionally lm-eval task evals.

Run it::

    layercut eval bundled:smollm2-135m --json
    layercut eval OUT --reference bundled:smollm2-135m --max-ppl-increase 5% --max-kl 0.1
    layercut eval OUT --tasks brown_cloze --limit 200      # needs the `eval` extra (lm-eval)

    from layercut.compress.stages.eval import EvalConfig, run
    report = run(EvalConfig(max_tokens=256, reference=None), "bundled:smollm2-135m")

The protocol is :mod:`layercut.compress.evaluate`'s; tasks run through :mod:`layercut.compress.lmeval`
after the perplexity pass, on the whole model in memory. A failed gate is reported
(``failed_gates``), not raised: the CLI exits with code 3, a recipe run finishes first.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from layercut.calibrate import DEFAULT_EVAL_TEXT
from layercut.compress.devices import on_device
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
from layercut.compress.stages.base import RunEnv, write_json


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


@on_device
def run(config: EvalConfig, source: str | Path, output: str | Path | None = None,
        env: RunEnv | None = None) -> dict:
    """Evaluate ``source`` (and its reference); write the report to ``output`` (a .json file) if given.

    Report: ``model`` (figures of ``source``), ``baseline`` (the reference's own figures or
    None), ``gates``, ``gates_passed``, ``failed_gates``; with ``tasks`` also ``tasks``
    (``{task: {metrics, num_fewshot, limit, samples, dataset, task_version}}``, see
    :func:`layercut.compress.lmeval.run_tasks`) and ``lm_eval_version``.
    """
    from layercut.compress.errors import LayercutError
    from layercut.compress.evaluate import evaluate
    from layercut.compress.gates import check_gates, parse_limit
    from layercut.compress.models import load_model, load_tokenizer, resolve_model, weight_bytes
    from layercut.compress.options import torch_dtype
    from layercut.compress.stages.base import load_streamed

    env = env or RunEnv()
    max_ppl = parse_limit(config.max_ppl_increase, "max_ppl_increase")
    path = resolve_model(source)
    tasks = None
    if config.tasks:  # a bad task name, folder or dataset, or no lm-eval, fail before the perplexity pass
        from layercut.compress.lmeval import load_tasks

        tasks = load_tasks(config.tasks, config.include_path)
    ref_path = env.resolve(config.reference, "reference")
    opts = dict(text=config.text_sources()[0], ctx=config.ctx, max_tokens=config.max_tokens, batch_size=config.batch_size,
                progress=env.progress)
    lazy = load_streamed(path, config.dtype, env, config.whole_model, "eval")
    ref_lazy = load_streamed(ref_path, config.dtype, env, config.whole_model, "eval") \
        if ref_path is not None else None
    baseline = None
    model = None
    if lazy is not None and (ref_path is None or ref_lazy is not None):
        from layercut.compress.stream_eval import evaluate_lazy  # one block in memory at a time

        tokenizer = load_tokenizer(path, env.trust_remote_code)
        if ref_path is not None and load_tokenizer(ref_path, env.trust_remote_code).get_vocab() != tokenizer.get_vocab():
            raise LayercutError("eval: the reference model has a different tokenizer vocabulary; KL is undefined")
        result, ref_seconds = evaluate_lazy(lazy, tokenizer, reference=ref_lazy, **opts)
        if ref_lazy is not None:  # the reference's own figures come from the same pass
            baseline = {**result.to_dict(), "ppl": result.reference_ppl, "nll": math.log(result.reference_ppl),
                        "params": ref_lazy.num_params, "bytes": weight_bytes(ref_path), "kl": None,
                        "reference_ppl": None, "model": env.name(ref_path, config.reference),
                        "seconds": ref_seconds, "tokens_per_s": result.tokens / ref_seconds}
    else:
        model, tokenizer = load_model(path, dtype=torch_dtype(config.dtype, path),
                                      trust_remote_code=env.trust_remote_code)
        reference = None
        if ref_path is not None:
            reference, ref_tok = load_model(ref_path, dtype=torch_dtype(config.dtype, ref_path),
                                            trust_remote_code=env.trust_remote_code)
            if ref_tok.get_vocab() != tokenizer.get_vocab():
                raise LayercutError("eval: the reference model has a different tokenizer vocabulary; "
                                    "KL is undefined")
            base = evaluate(reference, ref_tok, **opts)
            base.bytes, base.model = weight_bytes(ref_path), env.name(ref_path, config.reference)
            baseline = base.to_dict()
        result = evaluate(model, tokenizer, reference=reference, **opts)
        del reference
    result.bytes = weight_bytes(path)
    result.model = env.name(path, str(source))
    figures = result.to_dict()
    gates = check_gates(figures, max_ppl, config.max_kl)
    report = {
        "model": figures,
        "baseline": baseline,
        "gates": [g.__dict__ for g in gates],
        "gates_passed": all(g.passed for g in gates),
        "failed_gates": [g.name for g in gates if not g.passed],
    }
    if tasks is not None:
        from layercut.compress.lmeval import run_tasks

        if model is None:  # perplexity streamed: lm-eval needs the whole model
            model, tokenizer = load_model(path, dtype=torch_dtype(config.dtype, path),
                                          trust_remote_code=env.trust_remote_code)
        report.update(run_tasks(model, tokenizer, tasks, limit=config.limit,
                                num_fewshot=config.num_fewshot, batch_size=config.batch_size,
                                progress=env.progress))
    if output is not None:
        write_json(Path(output), report)
    return report
