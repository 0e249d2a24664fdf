"""``layercut export MODEL -o OUT [--dequantize] [--dtype D] [--max-shard-size S] [--json]``.

Examples::

    layercut export runs/demo -o release                       # a run dir: its final model, card, report
    layercut export runs/demo/03-quantize/model -o dense --dequantize

Writes sharded safetensors with an index, the config, the tokenizer and a README.md
model card (plus ``recipe.yaml``/``report.json`` when MODEL is a layercut run directory),
atomically: on any error nothing is left at OUT.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compress.errors import LayercutError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a release checkpoint (safetensors + index, card); dequantize GPTQ")
    p.add_argument("model", help="checkpoint directory, layercut run directory, .gguf file or bundled:NAME")
    p.add_argument("-o", "--output", required=True, help="output checkpoint directory (must not exist)")
    p.add_argument("--dequantize", action="store_true", help="GPTQ input -> dense weights")
    p.add_argument("--dtype", help="cast dense weights: float32, float16 or bfloat16")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (default: %(default)s)")
    p.add_argument("--no-card", action="store_true", help="do not write README.md")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code (off by default)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(handler=run)


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


def run(args: argparse.Namespace) -> dict:
    from compress.models import resolve_model
    from compress.pipeline import quality_report
    from export.card import card_files
    from export.export import export_checkpoint, is_quantized

    src = Path(args.model).expanduser()
    report = run_dir_report(src) if src.is_dir() else None
    extra: dict[str, str | bytes] = {}
    if report is not None:  # a run directory: its final model, with the run's recipe and report
        run_dir, model = src, src / report["final_model"]
        extra["recipe.yaml"] = (run_dir / "recipe.yaml").read_text()
        extra["report.json"] = json.dumps(quality_report(report), indent=2) + "\n"
        source = Path(report["source"]) if Path(report["source"]).is_dir() else model
    else:
        run_dir, model = None, resolve_model(args.model)
        source = model
        report = _checkpoint_report(model) or {"model": str(args.model), "stages": []}
        for name in ("recipe.yaml", "report.json"):
            if (model / name).is_file():
                extra[name] = (model / name).read_bytes()
    if not args.no_card:  # the card also says what this export did
        step = {"stage": "export", "dir": "", "report": {"quantized": is_quantized(model),
                                                         "dequantized": args.dequantize}}
        card_report = {**report, "stages": [r for r in report["stages"] if r["stage"] != "export"] + [step]}
        extra.update(card_files(card_report, source, run_dir))
    result = export_checkpoint(
        model, args.output, dequantize=args.dequantize, dtype=args.dtype, max_shard_size=args.max_shard_size,
        trust_remote_code=args.trust_remote_code, extra_files=extra, overwrite=args.overwrite,
    )
    return result.to_dict()


def _checkpoint_report(model: Path) -> dict | None:
    """The timing-free report a layercut export put inside a checkpoint, if any."""
    try:
        report = json.loads((model / "report.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return report if isinstance(report, dict) and isinstance(report.get("stages"), list) else None
