"""Evaluation results of a card: ``model-index`` entries (``EvalResult``) and the body's tables.

Usage::

    from layercut.export.card_results import eval_results, quality_table, tasks_table
    results, left_out = eval_results(eval_report)      # list[EvalResult], tasks not in model-index

From the eval stage's report: perplexity and KL on its text (``report["model"]``), and
lm-eval tasks (``report["tasks"]``: ``{task: {"metrics": {m: v, m + "_stderr": e}, "num_fewshot",
"limit", "samples", "dataset", "task_version"}}``; ``dataset_config`` / ``dataset_split`` are
used when present). A text that is not a Hub dataset gets a ``dataset.type`` that cannot be
mistaken for one (``bundled:brown-test``, ``local:notes.txt``: Hub ids have no colon).
Speed never enters ``model-index``: it is a property of the machine, not of the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from huggingface_hub import EvalResult

from layercut.calibrate.data import DATA_DIR
from layercut.calibrate.sources import parse_hf
from layercut.export.card_meta import hub_dataset_id

TASK = "text-generation"


def describe_text(source: str) -> dict:
    """``dataset_type``, ``dataset_name`` (+ config, split) of a text source, honestly."""
    if source.startswith("hf:"):
        name, config, split = parse_hf(source.removeprefix("hf:"))
        hub = hub_dataset_id(name)
        return {"dataset_type": hub or f"local:{Path(name).name}", "dataset_name": name,
                "dataset_config": config, "dataset_split": split}
    if source.startswith("bundled:"):
        return {"dataset_type": source, "dataset_name": bundled_text_name(source)}
    return {"dataset_type": f"local:{Path(source).name}", "dataset_name": f"local file {Path(source).name}"}


def bundled_text_name(source: str) -> str:
    """A bundled Brown split, described from ``calibrate/data/brown.json``."""
    split = source.removeprefix("bundled:").removeprefix("brown-")
    try:
        info = json.loads((DATA_DIR / "brown.json").read_text())
        docs = info["splits"][split]["documents"]
    except (OSError, KeyError, ValueError):
        return f"{source} (bundled with layercut, not on the Hub)"
    return f"Brown Corpus, {split} split ({docs} files), bundled with layercut (not on the Hub)"


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def task_metrics(entry: dict) -> list[tuple[str, str, float, float | None]]:
    """(metric, filter, value, stderr) of one lm-eval task; ``acc,none`` keys are split."""
    metrics = entry.get("metrics") or {}
    out = []
    for key, value in metrics.items():
        name, _, filt = str(key).partition(",")
        if name.endswith("_stderr") or _number(value) is None:
            continue
        err = metrics.get(f"{name}_stderr" + (f",{filt}" if filt else ""))
        out.append((name, "" if filt == "none" else filt, value, _number(err)))
    return out


def _ppl_results(m: dict) -> list[EvalResult]:
    text = describe_text(str(m.get("text")))
    args = {k: v for k, v in (("context", m.get("ctx")), ("scored_tokens", m.get("tokens"))) if v is not None}
    out = []
    if _number(m.get("ppl")) is not None:
        out.append(EvalResult(task_type=TASK, task_name="perplexity (layercut eval)", **text,
                              metric_type="perplexity", metric_value=round(m["ppl"], 3),
                              metric_name="perplexity", metric_args=args or None))
    if _number(m.get("kl")) is not None:
        out.append(EvalResult(task_type=TASK, task_name="perplexity (layercut eval)", **text,
                              metric_type="kl_divergence", metric_value=round(m["kl"], 4),
                              metric_name="KL(source || compressed), nats per token", metric_args=args or None))
    return out


def _task_results(task: str, entry: dict) -> list[EvalResult]:
    dataset = str(entry.get("dataset") or task)
    hub = hub_dataset_id(dataset)
    shots, limit = entry.get("num_fewshot"), entry.get("limit")
    args = {k: v for k, v in (("num_few_shot", shots), ("limit", limit)) if v is not None}
    pretty = f"{task} ({shots}-shot)" if shots is not None else task
    return [EvalResult(task_type=TASK, task_name=task, dataset_type=hub or f"local:{Path(dataset).name}",
                       dataset_name=pretty, dataset_config=entry.get("dataset_config"),
                       dataset_split=entry.get("dataset_split"), dataset_args=args or None,
                       metric_type=name, metric_value=round(value, 4),
                       metric_name=f"{name} ({filt})" if filt else name)
            for name, filt, value, _ in task_metrics(entry)]


def eval_results(ev: dict | None) -> tuple[list[EvalResult], list[str]]:
    """``model-index`` results of an eval report, and the tasks left out of it.

    ``model-index`` groups results by (task, dataset, config, split, revision): a task whose
    group another task already holds would be merged under that task's name, so it is left
    out (it stays in the body's table).
    """
    if not ev:
        return [], []
    results = _ppl_results(ev.get("model") or {})
    owner = {r.unique_identifier: "perplexity" for r in results}
    left_out = []
    for task, entry in sorted((ev.get("tasks") or {}).items()):
        rows = _task_results(task, entry if isinstance(entry, dict) else {})
        if not rows:
            continue
        if owner.setdefault(rows[0].unique_identifier, task) != task:
            left_out.append(task)
            continue
        results += rows
    return results, left_out


def _fmt(value, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "–" if value is None else f"{value / scale:{spec}}{unit}"


def quality_table(ev: dict) -> list[str]:
    """Source vs compressed: perplexity, KL, parameters, bytes, speed, and the quality gates."""
    m, b = ev.get("model") or {}, ev.get("baseline") or {}
    if not m:
        return []
    lines = [
        "## Quality, size and speed",
        "",
        f"Measured with `layercut eval` on `{m.get('text')}` ({m.get('tokens')} scored tokens, context {m.get('ctx')}); "
        "KL is the mean KL(p_source ‖ p_compressed) per token, in nats.",
        "",
        "| | source | compressed |",
        "|---|---:|---:|",
        f"| perplexity | {_fmt(b.get('ppl') or m.get('reference_ppl'), '.3f')} | {_fmt(m.get('ppl'), '.3f')} |",
        f"| KL to source | 0 | {_fmt(m.get('kl'), '.4f')} |",
        f"| parameters | {_fmt(b.get('params'), '.1f', 1e6, ' M')} | {_fmt(m.get('params'), '.1f', 1e6, ' M')} |",
        f"| weights on disk | {_fmt(b.get('bytes'), '.1f', 2**20, ' MiB')} | {_fmt(m.get('bytes'), '.1f', 2**20, ' MiB')} |",
        f"| tokens/s (this run's machine) | {_fmt(b.get('tokens_per_s'), '.0f')} | {_fmt(m.get('tokens_per_s'), '.0f')} |",
    ]
    for g in ev.get("gates", []):
        limit = f"{g['limit']:.4g}" if g["name"] == "max_kl" else f"{g['limit']:.0%}"
        value = "–" if g["value"] is None else (f"{g['value']:.4f}" if g["name"] == "max_kl" else f"{g['value']:+.1%}")
        lines.append(f"| gate: {g['name'].replace('_', ' ')} ≤ {limit} | | {value}, {'passed' if g['passed'] else 'FAILED'} |")
    return lines + [""]


def tasks_table(ev: dict, left_out: list[str]) -> list[str]:
    """One row per lm-eval task metric, with its standard error, shots and sample count."""
    tasks = ev.get("tasks") or {}
    if not tasks:
        return []
    lines = ["## Task evaluations (lm-eval)", "",
             "| task | metric | value | ± stderr | few-shot | samples | dataset |", "|---|---|---:|---:|---:|---:|---|"]
    for task, entry in sorted(tasks.items()):
        entry = entry if isinstance(entry, dict) else {}
        limit = f" (limit {entry['limit']})" if entry.get("limit") is not None else ""
        for name, filt, value, err in task_metrics(entry):
            metric = f"{name} ({filt})" if filt else name
            lines.append(f"| {task} | {metric} | {value:.4f} | {_fmt(err, '.4f')} | {entry.get('num_fewshot', '–')} "
                         f"| {entry.get('samples', '–')}{limit} | {entry.get('dataset', '–')} |")
    lines.append("")
    if left_out:
        lines += [f"Not in `model-index` ({', '.join(left_out)}): another task already reports on the same "
                  "dataset, config and split there, and the Hub would merge the two.", ""]
    return lines
