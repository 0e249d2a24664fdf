"""``layercut score MODEL --method M [--span N] [--drop N] [--calib SRC] [--json] [--plot F.png] [-o F.json]``.

Examples::

    layercut score bundled:smollm2-135m --method all --span 8 --json
    layercut score ./model --method gate-norm --drop 8 -o plan.json     # no data, no model built
    layercut score ./model --method block-influence --drop 8 --plot bi.png

Methods: angular, angular-all, block-influence, attn-cosine, mlp-cosine, gate-norm,
swap-kl, all (every method but swap-kl, which is slow: name it to add it). Every data-driven score comes from one capture-driver pass. ``--drop N``
(default: ``--span``) adds the selected layers per method; ``--span`` defaults to
``--drop``. Everything is validated before any work; outputs are written only at the end,
atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from compress.errors import LayercutError

METHODS = ("angular", "angular-all", "block-influence", "attn-cosine", "mlp-cosine", "gate-norm", "swap-kl")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="per-layer importance scores and a drop plan")
    p.add_argument("model", help="HF model directory, .gguf file, or bundled:NAME")
    p.add_argument("--method", default="all", help=f"{', '.join(METHODS)} or all (comma-separate several)")
    p.add_argument("--span", type=int, help="n of the angular span distance d(l, n) (default: --drop, else 1)")
    p.add_argument("--drop", type=int, help="also select this many layers per method (default: --span)")
    p.add_argument("--calib", default="bundled:brown-calib", help="calibration text (default: %(default)s)")
    p.add_argument("--samples", type=int, default=64, help="calibration sequences (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--swap-samples", type=int, default=4, help="sequences for swap-kl (default: %(default)s)")
    p.add_argument("--plot", help="write a PNG of the per-layer scores")
    p.add_argument("-o", "--output", help="write the scores and plan as JSON")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code (off by default)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(handler=run)


def parse_methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if "all" in names:
        # swap-kl needs full-model forwards per adjacent pair (tens of CPU-minutes on a
        # 135M model): a diagnostic you ask for by name, not part of "all".
        return [m for m in METHODS if m != "swap-kl"] + [m for m in names if m == "swap-kl"]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise LayercutError(f"unknown score method '{text}' (choose from {', '.join(METHODS)}, all)")
    return list(dict.fromkeys(names))


def num_layers_of(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    raise LayercutError("config.json has no num_hidden_layers")


def _check_out(path: str | None, suffix: str) -> Path | None:
    if path is None:
        return None
    target = Path(path).expanduser()
    if target.suffix.lower() != suffix:
        raise LayercutError(f"{target} must end in {suffix}")
    if target.is_dir():
        raise LayercutError(f"{target} is a directory")
    parent = target.parent
    probe = parent if parent.exists() else next((p for p in parent.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK):
        raise LayercutError(f"output location {probe} is not writable")
    return target


def _temp_beside(target: Path, suffix: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    return Path(tmp)


def selections(scores, methods: list[str], n: int) -> dict:
    """Layers each method would drop at count n (swap-kl is a diagnostic: no selection)."""
    from compress.select import select_blocks, select_sublayers
    from compress.select.cores import lowest

    out: dict = {}
    for m in methods:
        if m in ("angular", "angular-all", "block-influence"):
            out[m] = select_blocks(scores, n, m)
        elif m in ("attn-cosine", "mlp-cosine"):
            out[m] = select_sublayers(scores, n, m, "attention" if m == "attn-cosine" else "mlp")
        elif m == "gate-norm":
            out[m] = lowest(scores.gate_norm, n)
    if "attn-cosine" in methods and "mlp-cosine" in methods:
        out["joint"] = [list(t) for t in select_sublayers(scores, n, "joint")]
    return out


def run(args: argparse.Namespace) -> dict:
    from compress.models import resolve_model
    from compress.select.stage import DATA_METHODS, LayerScores, _check_count, check_span, rankings

    start = time.perf_counter()
    methods = parse_methods(args.method)
    for name in ("span", "drop"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise LayercutError(f"--{name} must be >= 1 (got {value})")
    if args.samples < 1 or args.seq_len < 2 or args.batch_size < 1 or args.swap_samples < 1:
        raise LayercutError("--samples, --batch-size and --swap-samples must be >= 1, --seq-len >= 2")
    json_out, plot_out = _check_out(args.output, ".json"), _check_out(args.plot, ".png")
    path = resolve_model(args.model)
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise LayercutError(f"{path}/config.json: invalid JSON ({exc})") from exc
    layers = num_layers_of(config)
    span = args.span or args.drop or 1
    drop = args.drop or args.span
    if args.span is not None:
        check_span(args.span, layers)
    if drop is not None:
        _check_count(drop, layers, "layers")
    check_span(span, layers)
    if drop is not None:
        if "angular-all" in methods and drop != span:
            raise LayercutError(f"angular-all selects a span of --drop {drop} blocks: pass --span {drop}")

    data = [m for m in methods if m in DATA_METHODS]
    scores = LayerScores(num_layers=layers, span=span)
    model = calib = None
    if data or "swap-kl" in methods:
        from calibrate.data import calibration_batch
        from compress.models import load_model

        model, tokenizer = load_model(path, trust_remote_code=args.trust_remote_code)
        calib = calibration_batch(tokenizer, args.calib, samples=args.samples, seq_len=args.seq_len, seed=0)
    timings = {}
    if data:
        from compress.select import compute_scores

        t0 = time.perf_counter()
        scores = compute_scores(model, calib, span=span, methods=data, batch_size=args.batch_size,
                                progress=not args.json)
        timings["capture_s"] = time.perf_counter() - t0
    if "gate-norm" in methods:
        from compress.select import gate_norm_scores

        t0 = time.perf_counter()
        scores.gate_norm = gate_norm_scores(path)  # from the files: no data, no model
        timings["gate_norm_s"] = time.perf_counter() - t0
        if len(scores.gate_norm) != layers:
            raise LayercutError(f"{path}: {len(scores.gate_norm)} attention layers in the files, config says {layers}")
    if "swap-kl" in methods:
        from compress.select import swap_kl_scores

        t0 = time.perf_counter()
        scores.swap_kl = swap_kl_scores(model, calib, samples=args.swap_samples, progress=not args.json)
        timings["swap_kl_s"] = time.perf_counter() - t0
    scores.meta.update(model=str(args.model), methods=methods, calib=args.calib if model is not None else None,
                       seq_len=args.seq_len if model is not None else None)

    chosen = selections(scores, methods, drop) if drop is not None else {}
    result = {
        "model": str(args.model),
        "methods": methods,
        "num_layers": layers,
        "span": span,
        "drop": drop,
        "selection": chosen,
        "ranking": rankings(scores),
        "scores": scores.to_dict(),
    }
    result["timings"] = timings
    pending: list[tuple[Path, Path]] = []
    try:
        if plot_out is not None:
            from compress.select import plot_scores

            highlight = {
                "block_influence": chosen.get("block-influence", []),
                "attn_importance": chosen.get("attn-cosine", []),
                "mlp_importance": chosen.get("mlp-cosine", []),
                "angular": chosen.get("angular", [])[:1],  # the angular panel's x axis is the span start
                "angular_all": chosen.get("angular-all", [])[:1],
                "gate_norm": chosen.get("gate-norm", []),
            }
            tmp = _temp_beside(plot_out, ".png")
            pending.append((tmp, plot_out))
            plot_scores(scores, tmp, highlight=highlight, title=f"{args.model}: {layers} layers")
            result["plot"] = str(plot_out)
        if json_out is not None:
            result["output"] = str(json_out)
            tmp = _temp_beside(json_out, ".json")
            pending.append((tmp, json_out))
            tmp.write_text(json.dumps(result, indent=1))
        for tmp, target in pending:
            os.replace(tmp, target)
    finally:
        for tmp, _ in pending:
            if tmp.exists():
                tmp.unlink()
    timings["wall_s"] = time.perf_counter() - start
    return result
