"""Depth compression on SmolLM2-135M: drop, linear replace (ReplaceMe), one-shot merge, attention drop.

Run (CPU, ~25–60 min on a loaded 2-core machine)::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/depth.py --samples 32 --seq-len 256 --max-tokens 4096
    # the same rows on the validation split, where choices (e.g. lstsq over cosine) are made
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/depth.py --samples 32 --seq-len 256 --max-tokens 4096 \
        --text bundled:brown-val
    # re-render the markdown (and the stored row labels) from a stored JSON, no model runs
    .venv/bin/python benchmarks/depth.py --from-json benchmarks/results/depth.json

Prints a table, writes ``benchmarks/results/depth.json`` and ``docs/results/depth.md``
(``depth-brown-val.json`` / ``docs/results/depth-brown-val.md`` for ``--text bundled:brown-val``).
Evaluation text: ``--text`` (default ``bundled:brown-test``), ctx 512, the first
``--max-tokens`` tokens. Calibration: ``bundled:brown-calib``, ``--samples`` × ``--seq-len`` tokens.

The "one-shot merge" rows apply LaCo's merge rule θ_l + Σ_k c (θ_k − θ_l) to every block of
the span at once; they do not run LaCo's schedule (merge a few adjacent layers at a time and
keep a merge only while the merged model's outputs stay above a cosine-similarity
threshold), so they say nothing about LaCo as published.

Passes of the capture driver are shared where the API allows it: one scoring pass
(angular, block influence, attention cosine), one fitting pass for every map / coefficient
fitted on the original stream (several callbacks in one ``run_blocks``), one pass for the
sequential-stream maps. "step s" is the transform's own time (fits inside the callbacks +
merge + removal); the shared pass times are listed separately. KL(original ‖ pruned) is
computed against cached float16 logits of the original model (same windows).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from layercut.calibrate import DEFAULT_EVAL_TEXT  # noqa: E402
from layercut.calibrate.capture import run_blocks  # noqa: E402
from layercut.calibrate.data import calibration_batch  # noqa: E402
from layercut.compress.core.arch import (
    arch_for,  # noqa: E402
    count_params,
)
from layercut.compress.depth.blocks import drop_blocks  # noqa: E402
from layercut.compress.depth.cores import runs_of  # noqa: E402
from layercut.compress.depth.fuse import CoeffFitter, apply_fuse, plan_groups  # noqa: E402
from layercut.compress.depth.replace import SpanFitter, merge_maps, plan_spans  # noqa: E402
from layercut.compress.depth.sublayers import drop_sublayers  # noqa: E402
from layercut.compress.eval.evaluate import evaluate
from layercut.compress.io.models import load_model, resolve_model  # noqa: E402
from layercut.compress.select import compute_scores, gate_norm_scores, select_blocks, select_sublayers  # noqa: E402
from layercut.compress.select.cores import lowest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MERGE_ROW = "one-shot merge (LaCo rule, c=1, no threshold schedule), angular span"
MERGE_CAL_ROW = "one-shot merge (calibrated c, no threshold schedule), angular span"
# row labels of results written before the rename -> current labels (applied by --from-json)
RENAMED = {"fuse (LaCo, c=1), angular span": MERGE_ROW, "fuse (calibrated c), angular span": MERGE_CAL_ROW}


def default_outputs(text: str) -> tuple[str, str]:
    if text in (DEFAULT_EVAL_TEXT, "bundled:brown-heldout"):  # heldout: results from before the val/test split
        return str(ROOT / "benchmarks/results/depth.json"), str(ROOT / "docs/results/depth.md")
    slug = text.split(":", 1)[-1]
    return str(ROOT / f"benchmarks/results/depth-{slug}.json"), str(ROOT / f"docs/results/depth-{slug}.md")


class CachedLogits(nn.Module):
    """Stands in for the original model as evaluate()'s reference: logits computed once, kept in fp16."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)  # evaluate() asks for a device
        self.store: dict[bytes, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False):
        key = input_ids.cpu().numpy().tobytes()
        if key not in self.store:
            self.store[key] = self.model(input_ids=input_ids, use_cache=False).logits.half()
        return SimpleNamespace(logits=self.store[key].float())


def span_text(layers: list[int]) -> str:
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs_of(layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:smollm2-135m")
    ap.add_argument("--drop", type=int, default=8)
    ap.add_argument("--attn-drops", default="8,15")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--text", default=DEFAULT_EVAL_TEXT, help="evaluation text (default %(default)s)")
    ap.add_argument("--json-out", help="default: benchmarks/results/depth.json (test split) or depth-<text>.json")
    ap.add_argument("--md-out", help="default: docs/results/depth.md (test split) or results-depth-<text>.md")
    ap.add_argument("--from-json", help="only re-render: apply the row renames to this JSON (in place) and "
                    "rewrite the markdown")
    args = ap.parse_args()
    if args.from_json:
        src = Path(args.from_json)
        result = json.loads(src.read_text())
        for row in result["rows"]:
            row["row"] = RENAMED.get(row["row"], row["row"])
        result["passes_s"] = {k.replace("LaCo coefficients", "merge coefficients"): v
                              for k, v in result["passes_s"].items()}
        src.write_text(json.dumps(result, indent=2, default=str))
        Path(args.md_out or default_outputs(result["text"])[1]).write_text(markdown(result))
        return
    json_default, md_default = default_outputs(args.text)
    args.json_out, args.md_out = args.json_out or json_default, args.md_out or md_default
    torch.manual_seed(0)
    wall0 = time.perf_counter()
    model_dir = resolve_model(args.model)
    orig, tok = load_model(model_dir)
    calib = calibration_batch(tok, "bundled:brown-calib", samples=args.samples, seq_len=args.seq_len)
    n = args.drop
    passes: dict[str, float] = {}
    rows: list[dict] = []

    ref = CachedLogits(orig)
    base = evaluate(ref, tok, text=args.text, ctx=args.ctx, max_tokens=args.max_tokens, progress=False)
    base.params = count_params(orig)
    rows.append({"row": "original", "removed": "", "ppl": base.ppl, "kl": 0.0, "params": base.params,
                 "tokens_per_s": base.tokens_per_s, "step_s": 0.0})
    print(f"original ppl {base.ppl:.2f} ({base.tokens} tokens)", flush=True)

    # 1. scores: one driver pass
    t0 = time.perf_counter()
    scores = compute_scores(orig, calib, span=n, methods=["angular", "block-influence", "attn-cosine"], progress=False)
    passes["scores (angular, BI, attn-cosine)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    gate = gate_norm_scores(model_dir)
    passes["gate-norm (from safetensors)"] = time.perf_counter() - t0
    angular = select_blocks(scores, n, "angular")
    bi = select_blocks(scores, n, "block-influence")
    bi_repl = lowest([float("inf")] + scores.block_influence[1:], n)  # replace needs block 0 kept
    print(f"angular span {span_text(angular)}; BI {span_text(bi)}", flush=True)

    # 2. every original-stream fit in ONE driver pass
    total = int(calib.attention_mask.sum())
    spec_blocks = arch_for(orig).layers_of(orig)
    L = len(spec_blocks)
    fitters = {
        "angular+lstsq": SpanFitter(plan_spans(angular, L), "lstsq", stream="original", total_tokens=total),
        "angular+cosine": SpanFitter(plan_spans(angular, L), "cosine", stream="original", total_tokens=total),
        "angular+cosine (paper's simplified objective)": SpanFitter(
            plan_spans(angular, L), "cosine", stream="original", total_tokens=total, cosine_target="residual"),
        "BI+lstsq (original stream)": SpanFitter(plan_spans(bi_repl, L), "lstsq", stream="original",
                                                 total_tokens=total),
        "BI+cosine (original stream)": SpanFitter(plan_spans(bi_repl, L), "cosine", stream="original",
                                                  total_tokens=total),
    }
    fuse_groups = plan_groups(angular, L)
    coeff = CoeffFitter(fuse_groups, spec_blocks, arch_for(orig), fit_samples=8, steps=25, lr=0.05)
    t0 = time.perf_counter()
    run_blocks(orig, calib, [*fitters.values(), coeff], progress=False, desc="fit")
    passes["fit pass (5 span fitters + merge coefficients)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    seq = SpanFitter(plan_spans(bi_repl, L), "lstsq", stream="sequential", total_tokens=total)
    run_blocks(orig, calib, [seq], progress=False, desc="fit-seq")
    passes["fit pass (sequential stream, lstsq)"] = time.perf_counter() - t0
    fitters["BI+lstsq (sequential stream)"] = seq
    t0 = time.perf_counter()
    seq_cos = SpanFitter(plan_spans(bi_repl, L), "cosine", stream="sequential", total_tokens=total)
    run_blocks(orig, calib, [seq_cos], progress=False, desc="fit-seq-cos")
    passes["fit pass (sequential stream, cosine)"] = time.perf_counter() - t0
    fitters["BI+cosine (sequential stream)"] = seq_cos

    def add(name: str, layers: list[int], transform, extra: dict | None = None) -> None:
        model = copy.deepcopy(orig)
        t = time.perf_counter()
        model = transform(model)
        step = time.perf_counter() - t + (extra or {}).pop("fit_s", 0.0)
        res = evaluate(model, tok, text=args.text, ctx=args.ctx, max_tokens=args.max_tokens, reference=ref,
                       progress=False)
        rows.append({"row": name, "removed": span_text(layers), "ppl": res.ppl, "kl": res.kl, "params": res.params,
                     "tokens_per_s": res.tokens_per_s, "step_s": step, **(extra or {})})
        print(f"{name:<32} {span_text(layers):<14} ppl {res.ppl:9.2f}  kl {res.kl:.4f}  step {step:.1f}s", flush=True)
        del model

    def replaced(fits):
        def run(model):
            merge_maps(model, fits)
            return drop_blocks(model, [k for f in fits for k in range(f.first, f.last + 1)])
        return run

    add(f"angular drop (UIDL), {n}/{L}", angular, lambda m: drop_blocks(m, angular))
    add(f"block-influence drop, {n}/{L}", bi, lambda m: drop_blocks(m, bi))
    if bi_repl != bi:
        add(f"BI drop, block 0 kept, {n}/{L}", bi_repl, lambda m: drop_blocks(m, bi_repl))
    for name, fitter in fitters.items():
        fits = fitter.results()
        layers = [k for f in fits for k in range(f.first, f.last + 1)]
        add(name, layers, replaced(fits), {"fit_s": sum(f.seconds for f in fits),
                                           "spans": [f.to_dict() for f in fits]})
    laco = [copy.deepcopy(g) for g in fuse_groups]
    for g in laco:
        g.coeffs = {}
    def fused(groups):
        def run(model):
            apply_fuse(model, copy.deepcopy(groups))
            return model
        return run

    add(MERGE_ROW, angular, fused(laco))
    add(MERGE_CAL_ROW, angular, fused(fuse_groups),
        {"fit_s": sum(g.seconds for g in fuse_groups), "groups": [g.to_dict() for g in fuse_groups]})
    for k in (int(x) for x in args.attn_drops.split(",")):
        by_gate = select_sublayers(model_dir, k, "gate-norm", "attention")
        by_cos = select_sublayers(scores, k, "attn-cosine", "attention")
        add(f"attention drop {k}, gate-norm", by_gate, lambda m, s=by_gate: drop_sublayers(m, s, "attention"))
        add(f"attention drop {k}, attn-cosine", by_cos, lambda m, s=by_cos: drop_sublayers(m, s, "attention"))

    wall = time.perf_counter() - wall0
    result = {
        "model": args.model, "text": args.text, "ctx": args.ctx, "eval_tokens": base.tokens,
        "calibration": {"source": "bundled:brown-calib", "samples": args.samples, "seq_len": args.seq_len},
        "machine": f"CPU, {torch.get_num_threads()} threads (shared, loaded)", "passes_s": passes,
        "wall_s": wall, "scores": {"block_influence": scores.block_influence, "angular": scores.angular,
                                   "attn_importance": scores.attn_importance, "gate_norm": gate},
        "rows": rows,
        "command": f"HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/depth.py --samples {args.samples} "
                   f"--seq-len {args.seq_len} --max-tokens {args.max_tokens}"
                   + ("" if args.text == DEFAULT_EVAL_TEXT else f" --text {args.text}"),
    }
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    result = write_merged(args.json_out, result, indent=2, default=str)
    table = markdown(result)
    Path(args.md_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md_out).write_text(table)
    print(table)


def markdown(result: dict) -> str:
    rows = {r["row"]: r for r in result["rows"]}

    def ppl(prefix: str) -> str:
        hit = next((r for name, r in rows.items() if name.startswith(prefix)), None)
        return f"{hit['ppl']:.1f}" if hit else "n/a"

    def than(a: str, b: str, better: str = "beats", worse: str = "does not beat") -> str:
        """``better`` if row ``a`` has the lower perplexity than row ``b`` (prefixes), else ``worse``."""
        ra = next((r for name, r in rows.items() if name.startswith(a)), None)
        rb = next((r for name, r in rows.items() if name.startswith(b)), None)
        return "(not run)" if ra is None or rb is None else better if ra["ppl"] < rb["ppl"] else worse

    cal = next((r for name, r in rows.items() if name.startswith("one-shot merge (calibrated")), None)
    cs = [c for g in (cal or {}).get("groups", []) for c in g.get("coeffs", {}).values()]
    coeffs = f"{min(cs):.3f}–{max(cs):.3f}" if cs else "n/a"
    cut = [r for r in result["rows"] if r["row"] != "original" and not r["row"].startswith("attention")]
    best = min(cut, key=lambda r: r["ppl"])
    bi = next(r for r in cut if r["row"].startswith("block-influence drop"))
    lines = [
        "# Depth compression results (SmolLM2-135M)",
        "",
        f"Model `{result['model']}` (30 blocks), evaluated on `{result['text']}`"
        + (" (measured before the held-out files were split into val and test, on their union)"
           if result["text"] == "bundled:brown-heldout" else "") + f", ctx {result['ctx']}, "
        f"{result['eval_tokens']} scored tokens (`evaluate(max_tokens=...)`, cut to fit a loaded CPU); "
        f"calibration {result['calibration']['samples']} × {result['calibration']['seq_len']} tokens of "
        f"`bundled:brown-calib`; {result['machine']}. No healing. KL = KL(original ‖ pruned) per token. "
        "\"step s\" is the transform's own time (fits + merge + removal); the calibration passes that feed "
        "the fits are shared between rows and listed below the table. tokens/s is noisy on a shared machine.",
        "",
        "| row | removed blocks | ppl | KL | params (M) | tokens/s | step s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['row']} | {r['removed']} | {r['ppl']:.2f} | {r['kl']:.4f} | {r['params'] / 1e6:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['step_s']:.1f} |")
    lines += [
        "",
        "Shared driver passes (wall s): " + "; ".join(f"{k}: {v:.0f}" for k, v in result["passes_s"].items())
        + f". Whole benchmark: {result['wall_s'] / 60:.0f} min.",
        "",
        "## Reading it",
        "",
        f"- Best no-heal row at 8/30: **{best['row']}** (ppl {best['ppl']:.1f}) = "
        f"{best['ppl'] / bi['ppl']:.2f} × the block-influence drop row ({bi['ppl']:.1f}); target ≤ 0.8.",
        f"- Linear replacement with lstsq {than('angular+lstsq', 'angular drop')} plain drop on the angular span, "
        f"and {than('BI+lstsq', 'block-influence drop')} it on block influence's spans: angular span "
        f"{ppl('angular drop')} → {ppl('angular+lstsq')}; block influence's spans {ppl('block-influence drop')} → "
        f"{ppl('BI+lstsq')}. Several non-contiguous spans get one map each, fitted in one driver pass.",
        f"- Stream positions: fitting later spans on the already-replaced stream (sequential, the CLI default) "
        f"vs the original model's activations: {ppl('BI+lstsq (sequential')} vs {ppl('BI+lstsq (original')}.",
        "- Massive activations: the first token of every sequence builds up ‖L − Y‖ ≈ 24 000 across blocks "
        "11–18 (≈ 110 for other tokens). The paper's simplified cosine objective cos(M T, L − Y) is scale-free per token and "
        f"cannot rebuild it ({ppl('angular+cosine (paper')}); the unsimplified cos(Y + M T, L) used by "
        f"`--replace cosine` does ({ppl('angular+cosine')} on the angular span) but only ties plain drop on block "
        f"influence's spans ({ppl('BI+cosine')}), where it disturbs that token's magnitudes. Prefer lstsq.",
        f"- One-shot merge: LaCo's merge rule θ_l + Σ_k (θ_k − θ_l), applied to all 8 blocks of the angular span "
        f"at once, gives ppl {ppl('one-shot merge (LaCo')}. LaCo itself merges a few adjacent layers at a time "
        "and keeps a merge only while the merged model's outputs stay above a cosine-similarity threshold; that "
        "schedule is not implemented, so this row is no measurement of LaCo as published. With a calibrated "
        f"per-matrix coefficient c (fitted c: {coeffs}) the result "
        f"{than('one-shot merge (calibrated', 'angular drop', 'beats', 'is still worse than')} dropping "
        f"({ppl('one-shot merge (calibrated')} vs {ppl('angular drop')}).",
        f"- Attention-only drop: LLM-Drop's attention cosine "
        f"{than('attention drop 8, attn', 'attention drop 8, gate', 'picks better', 'does not pick better')} "
        "layers than Gate-Norm on this model "
        f"(8 layers: {ppl('attention drop 8, attn')} vs {ppl('attention drop 8, gate')}; 15 layers: "
        f"{ppl('attention drop 15, attn')} vs {ppl('attention drop 15, gate')}). Attention-only outputs need "
        "`trust_remote_code=True` (see the README written into them).",
        "",
        "Regenerate with:",
        "",
        f"    {result['command']}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
