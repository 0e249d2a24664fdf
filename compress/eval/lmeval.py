"""Task evals through lm-eval (EleutherAI's lm-evaluation-harness), on a model held in memory.

Usage::

    layercut eval bundled:smollm2-135m --tasks brown_cloze --limit 200
    layercut eval OUT --tasks my_task --include-path my_tasks/ --num-fewshot 5

    from layercut.compress.eval.lmeval import load_tasks, run_tasks
    tasks = load_tasks(["brown_cloze"])                   # fails fast on a bad name, folder or dataset
    report = run_tasks(model, tokenizer, tasks, limit=50)

The model (dense, depth-pruned, or with layercut's GPTQ ``QuantLinear`` layers) is wrapped
as it is, with lm-eval's ``HFLM(pretrained=<model>)``: lm-eval scores through the whole
model, so task evals hold it in memory (perplexity and KL stay streamed).

Tasks come from lm-eval task folders: layercut's own (:data:`TASK_DIR`, which ships
``brown_cloze``), an ``--include-path`` folder, then lm-eval's built-in tasks (those fetch
their datasets from the Hub, so offline they work only from the local datasets cache).
lm-eval is an optional extra (``pip install 'layercut[eval]'``), imported only here and
only when tasks are asked for.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layercut.compress.core.errors import LayercutError

TASK_DIR = Path(__file__).resolve().parent / "tasks"
INSTALL_HINT = "task evals need lm-eval: pip install 'layercut[eval]'"
# datasets' builders for local files: the data file names say more than the builder's name
_LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}


def require_lm_eval():
    """The ``lm_eval`` module, or one clear :class:`LayercutError` when the extra is not installed."""
    try:
        import lm_eval
    except ImportError as exc:
        if exc.name not in (None, "lm_eval"):  # installed, but one of its own imports fails
            raise LayercutError(f"lm-eval is installed but cannot be imported ({exc})") from exc
        raise LayercutError(INSTALL_HINT) from exc
    return lm_eval


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


@dataclass
class TaskSet:
    """Tasks found and built, their data loaded: what :func:`run_tasks` evaluates."""

    names: list[str]
    manager: Any  # lm_eval.tasks.TaskManager
    specs: list[Any] = field(default_factory=list)  # built Task / Group objects (a tag or a file: its name)


def load_tasks(tasks: list[str], include_path: str | os.PathLike | None = None) -> TaskSet:
    """Find and build ``tasks`` with their data; one clear error for a bad name, folder or dataset.

    Searches :data:`TASK_DIR` and ``include_path`` first (fast); lm-eval's own few thousand
    task definitions are indexed only when a name is not found there. Called before any
    model work, so that bad input costs nothing.
    """
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [TASK_DIR]
    if include_path is not None:
        folder = Path(include_path).expanduser()
        if not folder.is_dir():
            raise LayercutError(f"include path not found: {folder} (expected a folder of lm-eval task YAML files)")
        paths.append(folder)
    with _quiet_lm_eval():
        manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=False)
        if _unknown(manager, tasks):
            manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=True)
        unknown = _unknown(manager, tasks)
        if unknown:
            name = unknown[0]
            near = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            hint = f"; close: {', '.join(near)}" if near else ""
            where = ", ".join(str(p) for p in paths)
            raise LayercutError(f"unknown task '{name}' (not in {where} nor among lm-eval's tasks{hint})")
        try:
            loaded = manager.load(list(tasks))
        except Exception as exc:  # missing data files, a dataset not in the offline cache, a bad YAML
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise LayercutError(f"cannot load task(s) {', '.join(tasks)}: {type(exc).__name__}: {first}") from exc
    # lm-eval gets the built tasks, so the data is read once (a tag or a file path is rebuilt by name)
    specs = [loaded.get("groups", {}).get(t) or loaded["tasks"].get(t) or t for t in tasks]
    return TaskSet(list(tasks), manager, specs)


def _unknown(manager, tasks: list[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [t for t in tasks if t not in known and not (t.endswith((".yaml", ".yml")) and Path(t).is_file())]


def run_tasks(model, tokenizer, tasks: TaskSet, limit: int | None = None, num_fewshot: int | None = None,
              batch_size: int = 4, progress: bool = True) -> dict[str, Any]:
    """Evaluate the in-memory ``model`` on ``tasks``: ``{"tasks": {name: figures}, "lm_eval_version": ...}``.

    Each task's figures: ``metrics`` (``{"acc": x, "acc_stderr": s, ...}``; a metric under an
    lm-eval filter other than ``none`` is named ``metric,filter``), ``num_fewshot``, ``limit``
    (items per task, None = all), ``samples`` (items scored), ``dataset`` (the task's dataset:
    a Hub id, ``id:config`` with a config, or the local data file names) and ``task_version``.
    ``progress=False`` hides the scoring progress bars (lm-eval still shows a short one per task
    while it builds the requests). A :class:`TaskSet` is used up by one run.
    """
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    with _quiet_lm_eval():
        lm = (HFLM if progress else _without_bars(HFLM))(pretrained=model, tokenizer=tokenizer,
                                                         batch_size=batch_size)
        results = simple_evaluate(lm, tasks=tasks.specs, task_manager=tasks.manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=False)
    names = list(results["results"])
    return {"tasks": {name: _task_figures(results, name, limit, num_fewshot) for name in names},
            "lm_eval_version": lm_eval_version()}


def _task_figures(results: dict, name: str, limit: int | None, num_fewshot: int | None) -> dict[str, Any]:
    metrics: dict[str, float | None] = {}
    for key, value in results["results"][name].items():
        if "," not in key:  # name, alias, sample_len
            continue
        metric, filt = key.split(",", 1)
        stderr = metric.endswith("_stderr")
        base = metric.removesuffix("_stderr")
        label = base if filt == "none" else f"{base},{filt}"
        metrics[label + ("_stderr" if stderr else "")] = _number(value)
    config = results.get("configs", {}).get(name, {})
    return {
        "metrics": metrics,
        "num_fewshot": results.get("n-shot", {}).get(name, num_fewshot),
        "limit": limit,
        "samples": _samples(results, name),
        "dataset": _dataset(config) if config else None,
        "task_version": results.get("versions", {}).get(name),
    }


def _number(value: Any) -> float | None:
    """A metric as a JSON-safe float (lm-eval writes "N/A" for a stderr it could not compute)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _samples(results: dict, name: str) -> int | None:
    counts = results.get("n-samples", {})
    if name in counts:
        return int(counts[name]["effective"])
    leaves = results.get("group_subtasks", {}).get(name)  # a group: the sum over its tasks
    if not leaves:
        return None
    found = [n for n in (_samples(results, leaf) for leaf in leaves) if n is not None]
    return sum(found) if found else None


def _dataset(config: dict) -> str | None:
    path, name = config.get("dataset_path"), config.get("dataset_name")
    if path in _LOCAL_BUILDERS:
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, dict):
            files = list(files.values())
        if files:
            flat = [f for item in ([files] if isinstance(files, str) else files)
                    for f in ([item] if isinstance(item, str) else item)]
            return ",".join(sorted({Path(f).name for f in flat}))
    if path is None:
        return None
    return f"{path}:{name}" if name else str(path)


def _without_bars(base: type) -> type:
    """``base`` (lm-eval's HFLM) with the ``disable_tqdm`` switch of its scoring calls turned on."""

    class WithoutBars(base):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=True)

    return WithoutBars


class _quiet_lm_eval:
    """Keep lm-eval's INFO/WARNING chatter (about being handed a model object, seeds, ...) off the
    console unless the application asked for INFO (``layercut -v``)."""

    def __enter__(self):
        self.logger = logging.getLogger("lm_eval")
        self.level = self.logger.level
        if logging.getLogger().getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
        return False
