"""The export stage: a release checkpoint (sharded safetensors + index, config, tokenizer, card).

Run it::

    layercut export runs/demo -o release                       # a run dir: its final model, card, report
    layercut export runs/demo/03-quantize/model -o dense --dequantize

    from layercut.compress.workflow.stages.export import ExportConfig, export_model, run
    run(ExportConfig(save_dtype="bf16"), "pruned/", "release/")
    export_model(model, tokenizer, ExportConfig(save_dtype="bf16"), "release/")     # in memory

Writes atomically (nothing is left at the output on any error); the format is
:mod:`layercut.export.export`'s. Given a layercut run directory, exports its final model with the
run's recipe and report beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.core.save import atomic_dir, check_output_dir, write_checkpoint_into
from layercut.compress.io.models import resolve_model
from layercut.compress.workflow.stages.base import RunEnv, quality_report
from layercut.export.card import card_files
from layercut.export.config import ExportConfig
from layercut.export.export import DTYPES, ensure_index, export_checkpoint


def run(config: ExportConfig, source: str | Path, output: str | Path, env: RunEnv | None = None,
        extra_files: dict[str, str | bytes] | None = None) -> dict:
    """Export ``source`` (a checkpoint, or a layercut run directory) to ``output``; returns a report."""
    env = env or RunEnv()
    src = Path(source).expanduser()
    report = run_dir_report(src) if src.is_dir() else None
    extra: dict[str, str | bytes] = {}
    if report is not None:  # a run directory: its final model, with the run's recipe and report
        run_dir, model = src, src / report["final_model"]
        extra["recipe.yaml"] = (run_dir / "recipe.yaml").read_text()
        extra["report.json"] = json.dumps(quality_report(report), indent=2) + "\n"
        origin = Path(report["source"]) if Path(report["source"]).is_dir() else model
    else:
        run_dir, model = None, resolve_model(source)
        origin = model
        report = _checkpoint_report(model) or {"model": str(source), "stages": []}
        for name in ("recipe.yaml", "report.json"):
            if (model / name).is_file():
                extra[name] = (model / name).read_bytes()
    if env.run_dir is not None and config.format != "safetensors":
        raise LayercutError(f"export format '{config.format}' is for `layercut export`, not a recipe's export "
                            f"stage: export the run's model afterwards with --format {config.format}")
    # the card's loading snippets are for safetensors checkpoints: none for GGUF / compressed-tensors
    if config.card and env.run_dir is None and config.format == "safetensors":
        step = {"stage": "export", "dir": "", "report": {"quantized": is_quantized(model),
                                                         "dequantized": config.dequantize}}
        card_report = {**report, "stages": [r for r in report["stages"] if r["stage"] != "export"] + [step]}
        recipe = None if run_dir is not None or not (model / "recipe.yaml").is_file() \
            else (model / "recipe.yaml").read_text()
        extra.update(card_files(card_report, origin, run_dir, recipe=recipe, ref=str(Path(output).expanduser().resolve())))
    extra.update(extra_files or {})
    result = export_checkpoint(
        model, output, dequantize=config.dequantize, save_dtype=config.save_dtype, load_dtype=config.dtype,
        max_shard_size=config.max_shard_size, trust_remote_code=env.trust_remote_code, extra_files=extra,
        overwrite=env.overwrite, stream=not config.whole_model, fmt=config.format, gguf_type=config.gguf_type,
    )
    return result.to_dict()


def export_model(model, tokenizer, config: ExportConfig, output: str | Path, overwrite: bool = False) -> Path:
    """Write an in-memory model as a checkpoint (sharded safetensors + index), atomically; returns its path.

    ``config.save_dtype`` casts what is written, not the caller's model: its tensors and dtype are
    put back afterwards, even on an error.
    """
    check_output_dir(output, overwrite)
    params = {n: p.data for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    dtype = model.config.dtype
    if config.save_dtype is not None:
        model.to(DTYPES[config.save_dtype])
        model.config.dtype = DTYPES[config.save_dtype]
    try:
        with atomic_dir(output, overwrite) as tmp:
            write_checkpoint_into(model, tokenizer, tmp, config.max_shard_size)
            ensure_index(tmp)
    finally:
        for name, param in model.named_parameters():
            param.data = params[name]
        for name, buf in buffers.items():
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = buf
        model.config.dtype = dtype
    return Path(output)


def run_dir_report(path: Path) -> dict | None:
    """The report of a layercut run directory (``report.json`` + ``recipe.yaml``), else None."""
    report_file = path / "report.json"
    if not (path / "recipe.yaml").is_file() or not report_file.is_file():
        return None
    try:
        report = json.loads(report_file.read_text())
    except json.JSONDecodeError as exc:
        raise LayercutError(f"{report_file}: invalid JSON ({exc.msg})") from None
    if not isinstance(report, dict) or "stages" not in report:
        return None
    if not report.get("final_model"):
        raise LayercutError(f"{path}: the run has no model yet (no finished stage wrote one)")
    return report


def _checkpoint_report(model: Path) -> dict | None:
    """The timing-free report a layercut export put inside a checkpoint, if any."""
    try:
        report = json.loads((model / "report.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return report if isinstance(report, dict) and isinstance(report.get("stages"), list) else None
