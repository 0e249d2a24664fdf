"""The eval stage: held-out perplexity, KL to a reference model, size and speed, quality gates;
optionally lm-eval task evals.

Run it::

    layercut eval bundled:smollm2-135m --json
    layercut eval OUT --reference bundled:smollm2-135m --max-ppl-increase 5% --max-kl 0.1
    layercut eval OUT --tasks brown_cloze --limit 200      # needs the `eval` extra (lm-eval)

    from layercut.compress.workflow.stages.eval import EvalConfig, eval_model, run
    report = run(EvalConfig(max_tokens=256, reference=None), "bundled:smollm2-135m")
    figures = eval_model(model, tokenizer, EvalConfig(max_tokens=256), reference=None)   # in memory

The protocol is :mod:`layercut.compress.eval.evaluate`'s; tasks run through :mod:`layercut.compress.eval.lmeval`
after the perplexity pass, on the whole model in memory. A failed gate is reported
(``failed_gates``), not raised: the CLI exits with code 3, a recipe run finishes first.
"""

from __future__ import annotations

import math
from pathlib import Path

from layercut.compress.core.devices import on_device
from layercut.compress.core.errors import LayercutError
from layercut.compress.eval.config import EvalConfig
from layercut.compress.eval.evaluate import evaluate
from layercut.compress.eval.gates import check_gates, parse_limit
from layercut.compress.eval.lmeval import load_tasks, run_tasks
from layercut.compress.eval.stream_eval import evaluate_lazy
from layercut.compress.io.models import load_model, load_tokenizer, resolve_model, weight_bytes
from layercut.compress.options import torch_dtype
from layercut.compress.workflow.stages.base import RunEnv, load_streamed, write_json


def eval_model(model, tokenizer, config: EvalConfig, reference=None, progress: bool = True) -> dict:
    """Evaluate an in-memory model (KL to the in-memory ``reference`` if given; ``config.reference``
    is not read): perplexity and the other figures, and lm-eval ``tasks`` if given (keys ``tasks``
    and ``lm_eval_version``). No gates: :func:`run` checks them."""
    tasks = None
    if config.tasks:  # checked (and their data loaded) before any model work
        tasks = load_tasks(config.tasks, config.include_path)
    result = evaluate(model, tokenizer, text=config.text_sources()[0], ctx=config.ctx, max_tokens=config.max_tokens,
                      reference=reference, batch_size=config.batch_size, progress=progress)
    figures = result.to_dict()
    if tasks is not None:
        figures.update(run_tasks(model, tokenizer, tasks, limit=config.limit, num_fewshot=config.num_fewshot,
                                 batch_size=config.batch_size, progress=progress))
    return figures


@on_device
def run(config: EvalConfig, source: str | Path, output: str | Path | None = None,
        env: RunEnv | None = None) -> dict:
    """Evaluate ``source`` (and its reference); write the report to ``output`` (a .json file) if given.

    Report: ``model`` (figures of ``source``), ``baseline`` (the reference's own figures or
    None), ``gates``, ``gates_passed``, ``failed_gates``; with ``tasks`` also ``tasks``
    (``{task: {metrics, num_fewshot, limit, samples, dataset, task_version}}``, see
    :func:`layercut.compress.eval.lmeval.run_tasks`) and ``lm_eval_version``.
    """
    env = env or RunEnv()
    max_ppl = parse_limit(config.max_ppl_increase, "max_ppl_increase")
    path = resolve_model(source)
    tasks = None
    if config.tasks:  # a bad task name, folder or dataset, or no lm-eval, fail before the perplexity pass
        tasks = load_tasks(config.tasks, config.include_path)
    ref_path = env.resolve(config.reference, "reference")
    opts = dict(text=config.text_sources()[0], ctx=config.ctx, max_tokens=config.max_tokens, batch_size=config.batch_size,
                progress=env.progress)
    lazy = load_streamed(path, config.dtype, env, config.whole_model, "eval", quantized=True)
    ref_lazy = load_streamed(ref_path, config.dtype, env, config.whole_model, "eval", quantized=True) \
        if ref_path is not None else None
    baseline = None
    model = None
    if lazy is not None and (ref_path is None or ref_lazy is not None):
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
        if model is None:  # perplexity streamed: lm-eval needs the whole model
            model, tokenizer = load_model(path, dtype=torch_dtype(config.dtype, path),
                                          trust_remote_code=env.trust_remote_code)
        report.update(run_tasks(model, tokenizer, tasks, limit=config.limit,
                                num_fewshot=config.num_fewshot, batch_size=config.batch_size,
                                progress=env.progress))
    if output is not None:
        write_json(Path(output), report)
    return report
