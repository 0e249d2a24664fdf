"""What every stage's ``run`` shares: the run environment (``RunEnv``), report writing and
scrubbing, and streamed loading. The stage configs' base and option helpers are
:mod:`layercut.compress.options`, a layer below, so an algorithm may own its stage's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.io.lazy import LazyModel, stream_blocker
from layercut.compress.io.models import resolve_model
from layercut.compress.options import SOURCE, torch_dtype


@dataclass
class RunEnv:
    """How a stage is invoked (not what it does, which is the config): the same for every stage.

    ``origin`` is the run's source model (a recipe's ``model``): eval's and heal's
    ``source`` default refers to it. ``run_dir``: reports name models relative to it.
    """

    origin: Path | None = None
    origin_name: str | None = None
    progress: bool = True
    trust_remote_code: bool = False
    overwrite: bool = False
    run_dir: Path | None = None
    dry_run: bool = False  # plan only: print what the stage would do, write nothing (prune, quantize)

    def resolve(self, spec: str | None, what: str) -> Path | None:
        """A model option: ``source`` -> the run's source model, a spec -> its path, None -> None."""
        if spec is None:
            return None
        if spec == SOURCE:
            if self.origin is None:
                raise LayercutError(f"{what} '{SOURCE}' means a recipe's source model: outside a recipe, "
                                    "give a model path")
            return Path(self.origin)
        return resolve_model(spec)

    def name(self, path: Path, spec: str | None = None) -> str:
        """How a report names a model: relative to the run directory, else as given."""
        if self.run_dir is not None:
            try:
                return Path(path).resolve().relative_to(Path(self.run_dir).resolve()).as_posix()
            except ValueError:
                pass
        if spec == SOURCE and self.origin_name:
            return self.origin_name
        return str(spec) if spec is not None else str(path)


def write_json(path: Path, data: dict) -> None:
    import json

    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# The one list of volatile report keys: timings, speeds, memory and absolute paths. They differ
# between two runs of the same settings, so they stay out of the reports written into
# checkpoints (quantize.json, heal.json, report.json, ...) and out of the resume comparison.
VOLATILE = ("seconds", "timings", "wall_s", "cpu_s", "total_wall_s", "total_cpu_s", "tokens_per_s", "peak_rss_mb",
            "rss_method", "output", "source", "input", "adapter")


def strip_volatile(data: Any, keys: tuple[str, ...] = VOLATILE) -> Any:
    """``data`` without the named keys at any depth, nor any ``*_seconds`` key.

    >>> strip_volatile({"a": 1, "seconds": 2.0, "x": [{"solve_seconds": 1, "b": 2}]})
    {'a': 1, 'x': [{'b': 2}]}
    """
    if isinstance(data, dict):
        return {k: strip_volatile(v, keys) for k, v in data.items()
                if k not in keys and not str(k).endswith("_seconds")}
    if isinstance(data, list):
        return [strip_volatile(v, keys) for v in data]
    return data


def quality_report(report: dict) -> dict:
    """The run report without timings, RSS, speed and absolute paths: what goes inside the checkpoint."""
    return strip_volatile(report)


def load_streamed(path: Path, dtype: str, env: RunEnv, whole_model: bool, what: str, quantized: bool = False):
    """A :class:`layercut.compress.io.lazy.LazyModel` for ``path``, or None where the stage must load the whole model.

    ``quantized``: the stage streams GPTQ checkpoints too (eval, score: blocks only run forward).
    Under ``auto`` such a checkpoint's dense tensors are read in their stored dtype (fp16):
    blocks compute in float32 either way, so only the embedding and head bytes change.
    """
    import logging

    if whole_model:
        return None

    reason = stream_blocker(path, quantized=quantized)
    if reason is not None:
        logging.getLogger(f"layercut.{what}").info("%s: loading the whole model (%s)", what, reason)
        return None

    stored = quantized and dtype == "auto" and is_quantized(path)
    return LazyModel(path, storage_dtype=None if stored else torch_dtype(dtype, path),
                     trust_remote_code=env.trust_remote_code, allow_quantized=quantized)
