"""GPTQ on SmolLM2-135M at group size 64: layercut vs GPTQModel 7.6.0 at matched settings, RTN, mixed bits.

Run (CPU; hours on a loaded 2-core machine: every row is one subprocess with one intra-op
thread, ``LAYERCUT_BENCH_THREADS`` to change; rows already in the JSON are kept, so an
interrupted run resumes when the same command runs again without ``--restart``)::

    # 1. choose defaults (the column order) on the validation half of the held-out Brown files
    GPTQMODEL_CPU_WORKERS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quant.py --text bundled:brown-val --restart
    # 2. report on the test half, on which nothing is chosen
    GPTQMODEL_CPU_WORKERS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quant.py --restart
    # re-render the markdown from a stored JSON (no quantization)
    .venv/bin/python benchmarks/quant.py --from-json benchmarks/results/quant.json

Outputs: ``benchmarks/results/quant.json`` + ``docs/results/quant.md`` for the test split,
``quant-brown-val.json`` + ``docs/results/quant-brown-val.md`` for another ``--text``.

Every quantizer gets the same calibration token batches (``bundled:brown-calib``,
``calibration_batch(seed=s)``, ``--samples`` × ``--seq-len``); rows marked with seeds run
once per ``--seeds`` value (default 0,1,2: three different calibration draws) and are
reported as mean (min–max). Every checkpoint is loaded with
``layercut.compress.quant.format.loader.load_quantized`` (GPTQModel's too) and evaluated the same way: the
first ``--max-tokens`` tokens of ``--text``, ctx 512, perplexity and KL(fp ‖ quantized)
against the fp32 model's logits (computed once per text by the fp32 row).

Matched settings (rows ``layercut-B-asym`` vs ``gptqmodel-B-asym``): asymmetric, group 64,
damping ``--damp`` (0.01, layercut's default, for both; GPTQModel's own default is 0.05),
columns in act-order with static groups (layercut's defaults; GPTQModel ``desc_act=True,
static_groups=True``, which turns its group-aware reordering off), one Hessian pass per
block (layercut ``sequential="block"``; GPTQModel ``true_sequential=False``), model loaded
in float32 (GPTQModel ``dtype=torch.float32``; its CPU default is bfloat16). What cannot be
matched: layercut accumulates H in float64, GPTQModel in float32 (both factor and invert it in
float32 since layercut's ``solve_dtype`` default became float32; the stored ``layercut-B-asym``
rows were run before that, with the float64 solve, and rows ``layercut-B-asym-solve32/-solve64``
compare the two on the validation half); GPTQModel
writes the unquantized tensors (embeddings, norms) in its load dtype, layercut in float16
(column "dense dtype"; the loader computes in float32 either way). Rows
``gptqmodel-B-asym-defaults`` run GPTQModel with its own defaults (damp 0.05, group-aware
reordering, ``desc_act=False``, true-sequential, bfloat16) for reference.

Per row: "wall s" is the whole quantize call in its own process (model load, calibration,
quantization, writing the checkpoint), "CPU s" that process's CPU time up to then (all
threads; steadier than wall time on a shared machine); "peak RSS" its high-water mark before
evaluation; "calib tokens" the tokens each quantizer's Hessians actually summed (layercut's
report; GPTQModel's per-module ``samples`` log, min over modules). ``phases_s`` splits the
time: layercut's driver pass (block forwards + Hessians + solves) and its solves;
GPTQModel's own region timer (``quant_region_timer``: forwards before quantizing a block,
the solves, the replay of the quantized block, packing, offload, saving).

Rows "mixed" allocate {2,3,4,8} bits per unit at the byte budget of uniform 3-bit g64
(3 + 19/64 = 3.296875 bits/weight incl. scales and zeros). Row "sensitivity" measures, on
4 × 256 calibration tokens, the true Δ_u(b) = KL(fp ‖ only layer u at b bits) and the
cheap proxies, and reports their Spearman rank correlation; the mixed rows use the proxy
that ranks best (both on calibration tokens, not on ``--text``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
# One intra-op thread per process for every row (both tools): on the shared 2-core machine
# this was measured faster than 2 (threads stall on each other when a core is taken).
THREADS = os.environ.get("LAYERCUT_BENCH_THREADS", "1")

from layercut.calibrate import DEFAULT_CALIB_TEXT, DEFAULT_EVAL_TEXT  # noqa: E402

DEFAULT_MODEL = "bundled:smollm2-135m"
MODEL = DEFAULT_MODEL  # --model / --group-size change both (use_model)
GS = 64
BUDGET_3BIT = 3 + (16 + 3) / GS  # uniform 3-bit g64, overhead included
DRIVER = "driver pass (block forwards + Hessians + solves)"  # layercut's phases_s key
VERSION = 2  # 1: one seed, GPTQModel at its defaults only, on bundled:brown-heldout

# name -> what to run; "seeds": run once per --seeds value (else seed 0 only)
ROWS: dict[str, dict] = {
    "fp32": {"kind": "fp"},
    "rtn-4-asym": {"kind": "ours", "method": "rtn", "bits": 4, "sym": False},
    "rtn-3-asym": {"kind": "ours", "method": "rtn", "bits": 3, "sym": False},
    "rtn-4-sym": {"kind": "ours", "method": "rtn", "bits": 4, "sym": True},
    "rtn-3-sym": {"kind": "ours", "method": "rtn", "bits": 3, "sym": True},
    # the headline pairs at matched settings (see the docstring)
    "layercut-4-asym": {"kind": "ours", "method": "gptq", "bits": 4, "sym": False, "seeds": True},
    "gptqmodel-4-asym": {"kind": "gptqmodel", "bits": 4, "sym": False, "matched": True, "seeds": True},
    "layercut-3-asym": {"kind": "ours", "method": "gptq", "bits": 3, "sym": False, "seeds": True},
    "gptqmodel-3-asym": {"kind": "gptqmodel", "bits": 3, "sym": False, "matched": True, "seeds": True},
    "gptqmodel-4-asym-defaults": {"kind": "gptqmodel", "bits": 4, "sym": False, "matched": False},
    "gptqmodel-3-asym-defaults": {"kind": "gptqmodel", "bits": 3, "sym": False, "matched": False},
    # column order: the default (act-order + static groups) is chosen on --text bundled:brown-val
    "layercut-4-asym-gar": {"kind": "ours", "method": "gptq", "bits": 4, "sym": False, "act_order": False,
                            "static_groups": False, "group_aware": True, "seeds": True},
    "layercut-4-asym-natural": {"kind": "ours", "method": "gptq", "bits": 4, "sym": False, "act_order": False,
                                "static_groups": False, "seeds": True},
    # the solve's precision (issue 11: float32 halves the largest buffers), chosen on --text bundled:brown-val
    "layercut-4-asym-solve32": {"kind": "ours", "method": "gptq", "bits": 4, "sym": False, "solve_dtype": "float32",
                                "seeds": True},
    "layercut-4-asym-solve64": {"kind": "ours", "method": "gptq", "bits": 4, "sym": False, "solve_dtype": "float64",
                                "seeds": True},
    "layercut-3-asym-solve32": {"kind": "ours", "method": "gptq", "bits": 3, "sym": False, "solve_dtype": "float32",
                                "seeds": True},
    "layercut-3-asym-solve64": {"kind": "ours", "method": "gptq", "bits": 3, "sym": False, "solve_dtype": "float64",
                                "seeds": True},
    "sensitivity": {"kind": "sensitivity"},
    "mixed-layer": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": "layer", "sym": False,
                    "refine": False},
    # not run by default (--only NAME): more settings
    "mixed-group": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": "group", "sym": False,
                    "refine": False},
    # issue 12: (bits, group size) per fused unit from the default candidates, sensitivity 'loss', the
    # fallback check on, at three budgets; each against the best uniform config whose bytes fit (3-bit
    # g64 for the first two, 2-bit g64 for 2.5); without and with the refinement round
    # (compress/quant/search/refine.py), chosen on --text bundled:brown-val
    "mixed-3.297": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": "group", "sym": False,
                    "sensitivity": "loss", "refine": False, "seeds": True},
    "mixed-3.297-refine": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": "group", "sym": False,
                           "sensitivity": "loss", "refine": True, "seeds": True},
    "mixed-3.5": {"kind": "ours", "method": "gptq", "avg_bits": 3.5, "unit": "group", "sym": False,
                  "sensitivity": "loss", "refine": False, "seeds": True},
    "mixed-3.5-refine": {"kind": "ours", "method": "gptq", "avg_bits": 3.5, "unit": "group", "sym": False,
                         "sensitivity": "loss", "refine": True, "seeds": True},
    "mixed-2.5": {"kind": "ours", "method": "gptq", "avg_bits": 2.5, "unit": "group", "sym": False,
                  "sensitivity": "loss", "refine": False, "seeds": True},
    "mixed-2.5-refine": {"kind": "ours", "method": "gptq", "avg_bits": 2.5, "unit": "group", "sym": False,
                         "sensitivity": "loss", "refine": True, "seeds": True},
    # the default candidates without 3-bit per channel (which the loss measure prices cheaply and the
    # fallback's KL does not), chosen on --text bundled:brown-val
    "mixed-3.297-no3ch": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": "group", "sym": False,
                          "sensitivity": "loss", "refine": False, "seeds": True,
                          "candidates": "3g128,3g64,3g32,4ch,4g128,4g64,8ch"},
    "mixed-3.5-no3ch": {"kind": "ours", "method": "gptq", "avg_bits": 3.5, "unit": "group", "sym": False,
                        "sensitivity": "loss", "refine": False, "seeds": True,
                        "candidates": "3g128,3g64,3g32,4ch,4g128,4g64,8ch"},
    # the 3ch choice re-measured on a split no choice touched (--second-val), without the fallback
    # check, so the KL is the allocation's own, with 3ch offered and without (the default set)
    **{f"mixed-{budget}-{tag}-nofb": {"kind": "ours", "method": "gptq", "avg_bits": avg, "unit": "group", "sym": False,
                                     "sensitivity": "loss", "refine": False, "seeds": True, "fallback_check": False,
                                     "candidates": cands}
       for budget, avg in (("3.297", BUDGET_3BIT), ("3.5", 3.5))
       for tag, cands in (("3ch", "3ch,3g128,3g64,3g32,4ch,4g128,4g64,8ch"),
                          ("no3ch", "3g128,3g64,3g32,4ch,4g128,4g64,8ch"))},
    "layercut-2-asym": {"kind": "ours", "method": "gptq", "bits": 2, "sym": False, "seeds": True},
    # layercut-3-asym again, run beside the mixed rows (same code and machine); see findings
    "layercut-3-asym-rerun": {"kind": "ours", "method": "gptq", "bits": 3, "sym": False, "seeds": True},
    # the previous default proxy, for its cost and result (seed 0)
    "mixed-3.297-output": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": "group",
                           "sym": False, "sensitivity": "output", "refine": False},
    "layercut-4-sym": {"kind": "ours", "method": "gptq", "bits": 4, "sym": True},
    "gptqmodel-4-sym": {"kind": "gptqmodel", "bits": 4, "sym": True, "matched": True},
    "layercut-3-asym-linear": {"kind": "ours", "method": "gptq", "bits": 3, "sym": False, "sequential": "linear"},
    "gptqmodel-3-asym-true-sequential": {"kind": "gptqmodel", "bits": 3, "sym": False, "matched": True,
                                         "true_sequential": True},
    # issue 26: layercut's per-group scale search (gptq_quantize's scale_search; shrink factors 1, 0.95, ...,
    # 0.75 of the min/max range), float32 solve: its baselines are the -solve32 rows; chosen on brown-val
    **{f"layercut-{b}-asym-{ss}": {"kind": "ours", "method": "gptq", "bits": b, "sym": False, "solve_dtype": "float32",
                                   "scale_search": ss, "seeds": True}
       for b in (4, 3) for ss in ("hessian", "mse", "obs")},
    # least-squares scales for GPTQ's final codes (compress/quant/solve/scale_fit.py) on top of the default search
    **{f"layercut-{b}-asym-hessian-refit": {"kind": "ours", "method": "gptq", "bits": b, "sym": False,
                                            "solve_dtype": "float32", "scale_search": "hessian",
                                            "refit_scales": True, "seeds": True} for b in (4, 3)},
    # the search over a wider grid (shrink factors 1, 0.95, ..., 0.5), with and without the refit
    **{f"layercut-{b}-asym-hessian-wide{r}": {"kind": "ours", "method": "gptq", "bits": b, "sym": False,
                                             "solve_dtype": "float32", "scale_search": "hessian",
                                             "scale_min": 0.5, "scale_steps": 10, "refit_scales": bool(r),
                                             "seeds": True} for b in (4, 3) for r in ("", "-refit")},
    # the two ends of each group's range shrunk by independent factors of the default grid (25 candidates):
    # the quantize default since it won on brown-val (3 seeds, both widths)
    **{f"layercut-{b}-asym-hessian-sep": {"kind": "ours", "method": "gptq", "bits": b, "sym": False,
                                          "solve_dtype": "float32", "scale_search": "hessian",
                                          "scale_bounds": "separate", "seeds": True} for b in (4, 3)},
    # mixed bits at uniform 4-bit g64's bytes, CLI defaults (loss sensitivity, no refine, the default
    # candidates, the hessian scale search): can an allocation beat uniform 4-bit where the demo must?
    "mixed-4.3125-hessian": {"kind": "ours", "method": "gptq", "avg_bits": 4 + (16 + 4) / GS, "unit": "group",
                             "sym": False, "sensitivity": "loss", "refine": False, "scale_search": "hessian",
                             "solve_dtype": "float32", "seeds": True},
    # GPTQModel's `mse` option (its range search: p = 1, 0.99, ..., 0.21 of the min/max range per
    # group, plain |w - q|^2 error, on the original weights under static groups) at the matched settings
    "gptqmodel-4-asym-mse": {"kind": "gptqmodel", "bits": 4, "sym": False, "matched": True, "mse": 2.0,
                             "seeds": True},
    "gptqmodel-3-asym-mse": {"kind": "gptqmodel", "bits": 3, "sym": False, "matched": True, "mse": 2.0,
                             "seeds": True},
    # --- issue 26 part 6: kl-swap (compress/quant/search/swap.py) ---
    # Δ_u = the true KL change of swapping unit u alone from the uniform 3g64 quant to its 3ch / 4g64
    # quant (all three from one sequential pass at the 3g64 operating point), measured on
    # sensitivity_samples x 256 calibration tokens held apart from the Hessians' and from the fallback
    # check's; then the DP at uniform-3g64 bytes, the plan quantized sequentially, the fallback check.
    # Against mixed-3.297-no3ch (the default allocator) at the same budget; chosen on brown-val.
    **{f"mixed-3.297-klswap-{unit}-s{n}": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": unit,
                                          "sym": False, "sensitivity": "kl-swap", "refine": False, "seeds": True,
                                          "sensitivity_samples": n}
       for unit in ("layer", "group") for n in (8, 16)},
    # --- end kl-swap ---
}
# the test split reports; the column-order rows are the choice, made on the validation split
TEST_ROWS = ["fp32", "rtn-4-asym", "rtn-3-asym", "layercut-4-asym", "gptqmodel-4-asym", "layercut-3-asym",
             "gptqmodel-3-asym", "gptqmodel-4-asym-defaults", "gptqmodel-3-asym-defaults", "rtn-4-sym", "rtn-3-sym",
             "sensitivity", "mixed-layer", "layercut-2-asym", "layercut-3-asym-rerun", "mixed-3.297", "mixed-3.5",
             "mixed-2.5", "mixed-3.297-output"]
VAL_ROWS = ["fp32", "layercut-4-asym", "layercut-4-asym-gar", "layercut-4-asym-natural"]
# issue 26's scale search: chosen on the validation split, then reported on the test split beside
# GPTQModel with its `mse` option (the -solve32 rows are the matched no-search baselines)
SCALE_VAL_ROWS = ["layercut-4-asym-solve32", "layercut-3-asym-solve32", "layercut-4-asym-obs", "layercut-3-asym-obs",
                  "layercut-4-asym-hessian", "layercut-3-asym-hessian", "layercut-3-asym-mse"]
SCALE_TEST_ROWS = ["layercut-4-asym-obs", "layercut-3-asym-obs", "gptqmodel-4-asym-mse", "gptqmodel-3-asym-mse"]
TEST_ROWS += SCALE_TEST_ROWS
VAL_ROWS += SCALE_VAL_ROWS


def run_key(name: str, seed: int) -> str:
    return f"{name}/seed{seed}"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text.split(":", 1)[-1])


# ------------------------------------------------------------------ child side


class CachedReference:
    """evaluate()'s reference model, replayed from fp16 logits stored by the fp32 row."""

    def __init__(self, store: dict[str, object]):
        import torch

        self.store = store
        self._p = torch.zeros(1)

    def parameters(self):
        yield self._p

    def __call__(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.store[input_ids.cpu().numpy().tobytes().hex()].float())


def _ref_file(args, work: Path) -> Path:
    return work / f"ref_logits-{_slug(args.text)}-{args.max_tokens}.safetensors"


def use_model(model: str, group_size: int) -> None:
    """Point every row at ``model`` (bundled:NAME or a path; a .gguf is converted once by
    ``resolve_model``) with group size ``group_size``: the module globals the children read."""
    global MODEL, GS
    MODEL, GS = model, group_size


def model_tag() -> str:
    """'' for the default model and group size, else a tag that keeps another model's cached
    reference logits and checkpoints apart from the default's in the same work folder."""
    return "" if (MODEL, GS) == (DEFAULT_MODEL, 64) else f"-{_slug(Path(MODEL).stem)}-g{GS}"


def _evaluate(model, tok, args, work: Path) -> dict:
    from safetensors.torch import load_file

    from layercut.compress.eval.evaluate import evaluate

    store = load_file(_ref_file(args, work))  # keys: the window's token ids as hex
    res = evaluate(model, tok, text=args.text, ctx=512, max_tokens=args.max_tokens,
                   reference=CachedReference(store), progress=False)
    return {"ppl": res.ppl, "kl": res.kl, "eval_tokens": res.tokens}


def _load_for_eval(path: Path):
    from layercut.compress.quant.format.loader import load_quantized
    from layercut.compress.quant.format.qlinear import QuantLinear

    model = load_quantized(path)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.cache_dequantized = True  # CPU eval speed; same numbers as the op
    return model


def _weight_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def _checkpoint_stats(path: Path) -> dict:
    """Bits stored per quantized weight (qweight + qzeros + fp16 scales) and the dtypes of the other tensors."""
    from safetensors import safe_open

    n = stored = 0
    dense: set[str] = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.endswith(".qweight"):
                    _rows, out = fh.get_slice(k).get_shape()
                    n += fh.get_slice(k[: -len("qweight")] + "g_idx").get_shape()[0] * out
                if k.endswith((".qweight", ".qzeros", ".scales")):
                    t = fh.get_tensor(k)
                    stored += t.numel() * t.element_size() * 8
                elif not k.endswith(".g_idx"):
                    dense.add(fh.get_slice(k).get_dtype())
    return {"avg_bits": stored / n, "dense_dtypes": sorted(dense), "weights_mb": _weight_mb(path)}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def _cpu_s() -> float:
    """CPU seconds of this process so far, all threads (steadier than wall time on a shared machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_fp(args, work: Path) -> dict:
    import torch

    from layercut.compress.eval.evaluate import evaluate
    from layercut.compress.io.models import load_model, resolve_model, weight_bytes

    model, tok = load_model(MODEL)
    store: dict[str, torch.Tensor] = {}

    class Recorder:
        def parameters(self):
            return model.parameters()

        def modules(self):
            return model.modules()

        def __call__(self, input_ids, use_cache=False):
            out = model(input_ids=input_ids, use_cache=False)
            store[input_ids.cpu().numpy().tobytes().hex()] = out.logits.half().contiguous()
            return out

    res = evaluate(Recorder(), tok, text=args.text, ctx=512, max_tokens=args.max_tokens, progress=False)
    from safetensors.torch import save_file

    save_file(store, str(_ref_file(args, work)))
    return {"ppl": res.ppl, "kl": 0.0, "eval_tokens": res.tokens,
            "weights_mb": weight_bytes(resolve_model(MODEL)) / 2**20}


def child_ours(args, work: Path, name: str, spec: dict, seed: int) -> dict:
    from layercut.compress.io.models import load_tokenizer
    from layercut.compress.workflow.stages.quantize import quantize_checkpoint

    out = work / f"{name}-seed{seed}"
    sens = spec.get("sensitivity") or _best_proxy(args)
    t0 = time.perf_counter()
    report = quantize_checkpoint(
        MODEL, out, bits=spec.get("bits"), avg_bits=spec.get("avg_bits"), unit=spec.get("unit", "layer"),
        group_size=GS, sym=spec["sym"], method=spec["method"], sequential=spec.get("sequential", "block"),
        act_order=spec.get("act_order", True), static_groups=spec.get("static_groups", True),
        group_aware=spec.get("group_aware", False), damp=args.damp, calib=args.calib,
        solve_dtype=spec.get("solve_dtype", "float32"),
        refine=spec.get("refine", True) if spec.get("avg_bits") else False,  # uniform bits: refine is an error
        candidates=spec.get("candidates"), **({"fallback_check": spec["fallback_check"]} if "fallback_check" in spec else {}),
        scale_search=spec.get("scale_search", "none"),  # explicit: rows without it are the no-search ones
        scale_bounds=spec.get("scale_bounds", "joint"),  # explicit: rows without it predate the separate default
        **{k: spec[k] for k in ("scale_min", "scale_steps", "refit_scales") if k in spec},
        **{k: spec[k] for k in ("sensitivity_samples",) if k in spec},  # kl-swap rows
        samples=args.samples, seq_len=args.seq_len, seed=seed, sensitivity=sens, progress=False, overwrite=True,
    )
    wall = time.perf_counter() - t0
    row = {"seed": seed, "wall_s": wall, "cpu_s": _cpu_s(), "peak_rss_mb": _peak_rss_mb(), **_checkpoint_stats(out),
           "calib_tokens": report.get("tokens", 0) if spec["method"] == "gptq" else 0,
           "damp": args.damp if spec["method"] == "gptq" else None, "compute_dtype": "float32",
           "solve_dtype": spec.get("solve_dtype", "float32") if spec["method"] == "gptq" else None,
           "scale_search": report.get("scale_search"), "scale_grid": report.get("scale_grid"),
           "scale_bounds": report.get("scale_bounds"),
           "solve_s": report["solve_seconds"],
           "phases_s": {DRIVER: report["quantize_seconds"],
                        "solves": report["solve_seconds"], "load, calibration draw, write": wall - report["quantize_seconds"]}}
    if "unit_bits" in report:
        row.update(unit_bits=report["unit_bits"], bits_histogram=report["bits_histogram"], sensitivity=sens,
                   sensitivity_s=report["sensitivity_seconds"])
    if "config_histogram" in report:  # (bits, group size) allocation: what was chosen and what was written
        row.update(config_histogram=report["config_histogram"], written=report["written"],
                   fallback=report["fallback"], allocated_avg_bits=report["allocated_avg_bits"],
                   refine=report.get("refine"),
                   unit_group_size=report["unit_group_size"])
    row.update(_evaluate(_load_for_eval(out), load_tokenizer(MODEL), args, work))
    return row


def gptqmodel_setup(spec: dict, damp: float):
    """GPTQModel's QuantizeConfig and load kwargs for a row: matched to layercut, or its own defaults."""
    import torch
    from gptqmodel import QuantizeConfig

    if not spec["matched"]:
        return QuantizeConfig(bits=spec["bits"], group_size=GS, sym=spec["sym"], desc_act=False), {}
    qcfg = QuantizeConfig(bits=spec["bits"], group_size=GS, sym=spec["sym"], desc_act=True, static_groups=True,
                          act_group_aware=False, damp_percent=damp,
                          true_sequential=spec.get("true_sequential", False), mse=spec.get("mse", 0.0))
    return qcfg, {"dtype": torch.float32}


def child_gptqmodel(args, work: Path, name: str, spec: dict, seed: int) -> dict:
    from gptqmodel import GPTQModel

    from layercut.calibrate.data import calibration_batch
    from layercut.compress.io.models import load_tokenizer, resolve_model

    out = work / f"{name}-seed{seed}"
    t0 = time.perf_counter()
    tok = load_tokenizer(MODEL)
    calib = calibration_batch(tok, args.calib, samples=args.samples, seq_len=args.seq_len, seed=seed)
    data = [{"input_ids": calib.input_ids[i].tolist(), "attention_mask": calib.attention_mask[i].tolist()}
            for i in range(calib.num_samples)]
    qcfg, load_kw = gptqmodel_setup(spec, args.damp)
    t_load = time.perf_counter()
    model = GPTQModel.load(str(resolve_model(MODEL)), qcfg, **load_kw)
    load_s = time.perf_counter() - t_load
    compute_dtype = str(next(model.model.parameters()).dtype).removeprefix("torch.")
    t_q = time.perf_counter()
    log = model.quantize(data, batch_size=8)
    quantize_s = time.perf_counter() - t_q
    t_s = time.perf_counter()
    model.save(str(out))
    save_s = time.perf_counter() - t_s
    wall = time.perf_counter() - t0
    rss, cpu = _peak_rss_mb(), _cpu_s()
    timer = getattr(model, "quant_region_timer", None)
    regions = {k: v["total"] for k, v in (timer.snapshot() if timer else {}).items() if v["count"]}
    entries = [e for stats in (log or {}).values() for e in stats if isinstance(e, dict) and e.get("samples")]
    tokens = [int(float(e["samples"])) for e in entries]
    damps = [float(e["damp"]) for e in entries if e.get("damp")]
    del model
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    qc.pop("meta", None)
    row = {"seed": seed, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss, **_checkpoint_stats(out),
           "calib_tokens": min(tokens) if tokens else None, "calib_tokens_max": max(tokens) if tokens else None,
           "damp": qcfg.damp_percent, "damp_used_max": max(damps) if damps else None, "compute_dtype": compute_dtype,
           "phases_s": {"GPTQModel.load": load_s, "quantize()": quantize_s, "save()": save_s, **regions},
           "gptqmodel_config": qc}
    row.update(_evaluate(_load_for_eval(out), tok, args, work))
    return row


def child_sensitivity(args, work: Path) -> dict:
    from layercut.calibrate.data import CalibSet, calibration_batch
    from layercut.compress.io.models import load_model
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.plan import solver_settings
    from layercut.compress.quant.search.sensitivity import (
        allocation_units,
        measure_sensitivity,
        rank_correlation,
    )

    model, tok = load_model(MODEL)
    full = calibration_batch(tok, args.calib, samples=args.samples, seq_len=args.seq_len, seed=0)
    calib = CalibSet(full.input_ids[:4, :256], full.attention_mask[:4, :256])
    units = allocation_units(model, "layer")
    cands = (2, 3, 4)
    t0 = time.perf_counter()
    plain = solver_settings(QuantizeConfig(bits=4, group_size=GS, act_order=False, static_groups=False,
                                           scale_search="none", scale_bounds="joint"))  # plain GPTQ, as measured
    table = measure_sensitivity(model, calib, units, cands, plain,
                                methods=("kl", "output", "output_rel", "loss"), batch_size=4, progress=False)
    kl = table.by_method["kl"]
    corr = {}
    for proxy in ("output", "output_rel", "loss"):
        p = table.by_method[proxy]
        pairs = [(kl[u.name][b], p[u.name][b]) for u in units for b in cands]
        per_bits = {b: rank_correlation([kl[u.name][b] for u in units], [p[u.name][b] for u in units]) for b in cands}
        gains = [(kl[u.name][b] - kl[u.name][c], p[u.name][b] - p[u.name][c])
                 for u in units for b, c in zip(cands, cands[1:])]
        corr[proxy] = {"all_pairs": rank_correlation(*zip(*pairs)), "per_bits": per_bits,
                       "gains": rank_correlation(*zip(*gains))}
    return {"seed": 0, "seconds": time.perf_counter() - t0, "tokens": table.tokens, "candidates": list(cands),
            "spearman": corr, "table": table.to_dict()["by_method"]}


def _best_proxy(args) -> str:
    """The proxy whose per-bits rank correlation with the KL is best (mean over bits)."""
    runs = _load(Path(args.json_out)).get("runs", {})
    corr = runs.get(run_key("sensitivity", 0), {}).get("spearman")
    if not corr:
        return "output"
    return max(corr, key=lambda p: sum(corr[p]["per_bits"].values()) / len(corr[p]["per_bits"]))


def run_child(args) -> None:
    spec = ROWS[args.child]
    work = Path(args.work)
    kind = spec["kind"]
    if kind == "fp":
        row = child_fp(args, work)
    elif kind == "ours":
        row = child_ours(args, work, args.child, spec, args.seed)
    elif kind == "gptqmodel":
        row = child_gptqmodel(args, work, args.child, spec, args.seed)
    else:
        row = child_sensitivity(args, work)
    print("ROW " + json.dumps(row, default=str), flush=True)


# ------------------------------------------------------------------ parent side: tables


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _store_run(out: Path, setup: dict, key: str, row: dict) -> dict:
    """Add one run to ``out`` under a lock, re-reading it first: invocations with disjoint ``--only``
    sets can share one JSON (e.g. the slow GPTQModel rows on another core). Written atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _load(out)
        if data.get("setup", setup) != setup:
            sys.exit(f"{out} was rewritten with {data['setup']} while this run used {setup}")
        data = {"setup": setup, "runs": {**data.get("runs", {}), key: row}}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        tmp.replace(out)
    return data


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def runs_of(data: dict, name: str) -> list[dict]:
    """Every stored run of a row, in seed order."""
    runs = data.get("runs", {})
    return [runs[k] for k in sorted(runs, key=lambda k: int(k.rsplit("seed", 1)[1])) if k.rsplit("/", 1)[0] == name]


def spread(values: list[float], spec: str) -> str:
    """``mean`` for one value, ``mean (min–max)`` for several."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    mean = format(statistics.fmean(values), spec)
    return mean if len(values) == 1 else f"{mean} ({format(min(values), spec)}–{format(max(values), spec)})"


def mean_of(data: dict, name: str, key: str) -> float | None:
    values = [r[key] for r in runs_of(data, name) if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def table_md(data: dict) -> str:
    fp = mean_of(data, "fp32", "ppl")
    lines = ["| row | seeds | stored bits/weight | ppl | Δppl vs fp | KL to fp | calib tokens | damp | "
             "compute / dense dtype | wall s | CPU s | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, spec in ROWS.items():
        runs = runs_of(data, name)
        if not runs or spec["kind"] == "sensitivity":
            continue
        r0 = runs[0]
        bits = "fp32" if spec["kind"] == "fp" else f"{r0['avg_bits']:.3f}"
        ppl = mean_of(data, name, "ppl")
        dppl = f"{100 * (ppl / fp - 1):+.1f}%" if fp and name != "fp32" else ""
        dtypes = "" if spec["kind"] == "fp" else f"{r0.get('compute_dtype')} / {','.join(r0.get('dense_dtypes', []))}"
        lines.append(
            f"| {name} | {','.join(str(r.get('seed', 0)) for r in runs)} | {bits} | "
            f"{spread([r['ppl'] for r in runs], '.2f')} | {dppl} | {spread([r.get('kl') for r in runs], '.4f')} | "
            f"{spread([r.get('calib_tokens') for r in runs], '.0f')} | {_fmt(r0.get('damp'), 'g')} | {dtypes} | "
            f"{spread([r.get('wall_s') for r in runs], '.0f')} | {spread([r.get('cpu_s') for r in runs], '.0f')} | "
            f"{spread([r.get('peak_rss_mb') for r in runs], '.0f')} |")
    return "\n".join(lines)


def _mixed_phases(r: dict) -> dict[str, float]:
    """A mixed-bit run's wall time: sensitivity pass, refinement solves, the written result's GPTQ pass, the rest."""
    refine = r.get("refine") if isinstance(r.get("refine"), dict) and r["refine"].get("run") else {}
    out = {"sensitivity pass": r.get("sensitivity_s") or 0.0,
           "refinement's neighbour solves": refine.get("probe_seconds", 0.0),
           "GPTQ pass of the written result": r.get("phases_s", {}).get(DRIVER, 0.0)}
    out["the rest: the other GPTQ passes (first plan, the loser), fallback KL, load, write"] = (
        r["wall_s"] - sum(out.values()))
    return out


def phases_md(data: dict) -> list[str]:
    """Where each GPTQ quantizer's wall time goes (means over its runs)."""
    out = []
    for name, spec in ROWS.items():
        runs = runs_of(data, name)
        if not runs or spec["kind"] not in ("ours", "gptqmodel") or spec.get("method") == "rtn":
            continue
        wall = statistics.fmean(r["wall_s"] for r in runs)
        phases = [_mixed_phases(r) if spec.get("avg_bits") else r.get("phases_s", {}) for r in runs]
        keys = list(dict.fromkeys(k for p in phases for k in p))
        parts = [f"{k} {statistics.fmean(p.get(k, 0.0) for p in phases):.0f} s "
                 f"({100 * statistics.fmean(p.get(k, 0.0) for p in phases) / wall:.0f}%)" for k in keys]
        if parts:
            out.append(f"{name} (wall {wall:.0f} s): " + "; ".join(parts))
    return out


def findings(data: dict) -> list[str]:
    """Headline comparisons, computed from the rows present (means over seeds, min–max beside)."""
    out = []

    def rng(name, key, spec=".2f"):
        return spread([r.get(key) for r in runs_of(data, name)], spec)

    for setting in ("4-asym", "3-asym", "4-sym", "3-sym"):
        ours, gm = f"layercut-{setting}", f"gptqmodel-{setting}"
        p_ours, p_gm = mean_of(data, ours, "ppl"), mean_of(data, gm, "ppl")
        if p_ours and p_gm:
            w_ours, w_gm = mean_of(data, ours, "wall_s"), mean_of(data, gm, "wall_s")
            out.append(f"{setting}, matched settings: layercut ppl {rng(ours, 'ppl')} vs GPTQModel {rng(gm, 'ppl')} "
                       f"({100 * (p_ours / p_gm - 1):+.2f}% of the means); KL {rng(ours, 'kl', '.4f')} vs "
                       f"{rng(gm, 'kl', '.4f')}; wall {w_ours:.0f} s vs {w_gm:.0f} s (= {w_ours / w_gm:.2f}x)")
        default = f"gptqmodel-{setting}-defaults"
        if mean_of(data, default, "ppl") and p_ours:
            out.append(f"{setting}: GPTQModel at its own defaults ppl {rng(default, 'ppl')}, KL "
                       f"{rng(default, 'kl', '.4f')}, wall {mean_of(data, default, 'wall_s'):.0f} s")
        p_rtn = mean_of(data, f"rtn-{setting}", "ppl")
        if p_ours and p_rtn:
            out.append(f"{setting}: layercut GPTQ ppl {p_ours:.2f} vs RTN {p_rtn:.2f} "
                       f"({'beats' if p_ours < p_rtn else 'does NOT beat'} RTN)")
    labels = {"layercut-4-asym-natural": "natural", "layercut-4-asym-gar": "group-aware (GAR, GPTQModel's default)",
              "layercut-4-asym": "act-order + static groups (layercut's default)"}
    if sum(bool(runs_of(data, n)) for n in labels) > 1:
        out.append("column order, 4-bit asym: " + "; ".join(
            f"{label} ppl {rng(n, 'ppl')}, KL {rng(n, 'kl', '.4f')}" for n, label in labels.items() if runs_of(data, n)))
    p3, p4 = mean_of(data, "layercut-3-asym", "ppl"), mean_of(data, "layercut-4-asym", "ppl")
    for name in ("mixed-layer", "mixed-group"):
        m = (runs_of(data, name) or [None])[0]
        if m and p3 and p4:
            frac = (p3 - m["ppl"]) / (p3 - p4)
            out.append(f"{name} (seed 0): {m['avg_bits']:.4f} avg bits (uniform 3-bit: {BUDGET_3BIT:.4f}), ppl "
                       f"{m['ppl']:.2f}: closes {100 * frac:.0f}% of the 3->4-bit gap ({p3:.2f} -> {p4:.2f}); "
                       f"bits {m.get('bits_histogram')}, sensitivity '{m.get('sensitivity')}'")
    out += mixed_findings(data)
    out += scale_search_findings(data)
    lin = (runs_of(data, "layercut-3-asym-linear") or [None])[0]
    if lin and p3:
        out.append(f"sequential='linear' (4 Hessian passes/block) at 3-bit asym: ppl {lin['ppl']:.2f}, wall "
                   f"{lin['wall_s']:.0f} s vs 'block' ppl {p3:.2f}, wall {mean_of(data, 'layercut-3-asym', 'wall_s'):.0f} s")
    sens = (runs_of(data, "sensitivity") or [None])[0]
    if sens:
        for proxy, c in sens["spearman"].items():
            per = ", ".join(f"{b} bits {v:.2f}" for b, v in c["per_bits"].items())
            out.append(f"Spearman(KL, {proxy}) (4 × 256 calibration tokens, units quantized in natural column "
                       f"order): across layers at {per}; all (layer, bits) pairs {c['all_pairs']:.2f}; "
                       f"gains Δ(b)-Δ(b+1) {c['gains']:.2f}")
    return out


SCALE_LABELS = {"obs": "weights 1/[U]_jj², GPTQ's own column cost", "hessian": "weights H_jj",
                "mse": "plain squared error"}


def scale_search_findings(data: dict) -> list[str]:
    """Issue 26: each scale-search row against its no-search baseline (same seeds: paired), GPTQModel's
    ``mse`` option against GPTQModel without it, and layercut against GPTQModel's best setting."""
    out = []

    def kl_by_seed(name: str) -> dict[int, float]:
        return {r.get("seed", 0): r["kl"] for r in runs_of(data, name) if r.get("kl") is not None}

    for bits in (4, 3):
        base = f"layercut-{bits}-asym-solve32"
        for kind, label in SCALE_LABELS.items():
            name = f"layercut-{bits}-asym-{kind}"
            ours, ref = kl_by_seed(name), kl_by_seed(base)
            seeds = sorted(set(ours) & set(ref))
            if not seeds:
                continue
            rel = [100 * (ours[s] / ref[s] - 1) for s in seeds]
            solve = [statistics.fmean(r["solve_s"] for r in runs_of(data, n) if r.get("seed", 0) in seeds)
                     for n in (name, base)]
            cpu = [statistics.fmean(r["cpu_s"] for r in runs_of(data, n) if r.get("seed", 0) in seeds)
                   for n in (name, base)]
            out.append(f"{bits}-bit scale search '{kind}' ({label}; shrink 1, 0.95, ..., 0.75), seeds "
                       f"{','.join(map(str, seeds))}: KL {spread([ours[s] for s in seeds], '.4f')} vs no search "
                       f"{spread([ref[s] for s in seeds], '.4f')} ({base}); per seed {', '.join(f'{x:+.1f}%' for x in rel)} "
                       f"(mean {statistics.fmean(rel):+.1f}%); solves {solve[0]:.1f} s vs {solve[1]:.1f} s (wall; the "
                       "machine was loaded differently: benchmarks/scale_search_cost.py has the CPU cost), process "
                       f"CPU {cpu[0]:.0f} s vs {cpu[1]:.0f} s")
        gm, gm_mse = kl_by_seed(f"gptqmodel-{bits}-asym"), kl_by_seed(f"gptqmodel-{bits}-asym-mse")
        seeds = sorted(set(gm) & set(gm_mse))
        if seeds:
            out.append(f"{bits}-bit GPTQModel with mse=2 (its range search, 80 shrink steps) at matched settings, seeds "
                       f"{','.join(map(str, seeds))}: KL {spread([gm_mse[s] for s in seeds], '.4f')} vs without "
                       f"{spread([gm[s] for s in seeds], '.4f')}")
        best = {n: statistics.fmean(v.values()) for n in (f"gptqmodel-{bits}-asym", f"gptqmodel-{bits}-asym-mse",
                                                           f"gptqmodel-{bits}-asym-defaults")
                if (v := kl_by_seed(n))}
        sep, joint = kl_by_seed(f"layercut-{bits}-asym-hessian-sep"), kl_by_seed(f"layercut-{bits}-asym-hessian")
        seeds = sorted(set(sep) & set(joint))
        if seeds:
            out.append(f"{bits}-bit scale search with separate bounds (each end of the range shrunk by its own factor, "
                       f"25 candidates; the default since it won on brown-val), seeds {','.join(map(str, seeds))}: KL "
                       f"{spread([sep[s] for s in seeds], '.4f')} vs joint bounds {spread([joint[s] for s in seeds], '.4f')}; "
                       f"per seed {', '.join(f'{100 * (sep[s] / joint[s] - 1):+.1f}%' for s in seeds)}")
        mine = {n: statistics.fmean(v.values()) for n in (f"layercut-{bits}-asym-hessian-sep", f"layercut-{bits}-asym-hessian",
                                                           f"layercut-{bits}-asym-obs")
                if (v := kl_by_seed(n))}
        if best and mine:
            gname = min(best, key=best.get)
            for n, kl in mine.items():
                out.append(f"{bits}-bit: {n} KL {kl:.4f} ({len(kl_by_seed(n))} seed(s)) vs GPTQModel's best setting "
                           f"here, {gname}, {best[gname]:.4f} ({len(kl_by_seed(gname))} seed(s)): "
                           f"{100 * (kl / best[gname] - 1):+.1f}% (issue 26's bar: -5% or lower)")
    return out


# issue 12's comparisons: each mixed budget against the best uniform config whose bytes fit it
# (the 3-bit comparator is the rerun made beside them: the stored layercut-3-asym seed 0 differs, see findings)
MIXED_VS = {"mixed-3.297": "layercut-3-asym-rerun", "mixed-3.5": "layercut-3-asym-rerun",
            "mixed-2.5": "layercut-2-asym", "mixed-3.297-refine": "layercut-3-asym-rerun",
            "mixed-3.5-refine": "layercut-3-asym-rerun", "mixed-2.5-refine": "layercut-2-asym",
            # the no-3ch rows ran the float32 solve: their matched uniform row is solve32
            "mixed-3.297-no3ch": "layercut-3-asym-solve32", "mixed-3.5-no3ch": "layercut-3-asym-solve32", "mixed-3.297-output": "layercut-3-asym-rerun",
            **{f"mixed-{b}-{t}-nofb": "layercut-3-asym-solve32" for b in ("3.297", "3.5") for t in ("3ch", "no3ch")}}


def mixed_findings(data: dict) -> list[str]:
    """Mixed (bits, group size) rows vs their uniform comparator: KL, log-ppl, what was written, cost."""
    import math

    out = []
    old, new = (runs_of(data, "layercut-3-asym") or [None])[0], (runs_of(data, "layercut-3-asym-rerun") or [None])[0]
    if old and new:
        out.append(f"layercut-3-asym seed 0 run again beside the mixed rows (same command, same calibration tokens): "
                   f"KL {new['kl']:.4f}, ppl {new['ppl']:.2f} vs {old['kl']:.4f}, {old['ppl']:.2f} stored from the "
                   f"earlier run (CPU {new['cpu_s']:.0f} s vs {old['cpu_s']:.0f} s: a slower machine). Not explained "
                   "yet: the GPTQ core gives identical tensors before and after on a tiny model, the calibration "
                   "tokens are identical, and streamed equals whole-model output on SmolLM2; one guess is other "
                   "float rounding on another CPU, amplified by 30 sequential 3-bit blocks. The mixed rows are "
                   "compared with the rerun")
    for name, base in MIXED_VS.items():
        runs, ref = runs_of(data, name), runs_of(data, base)
        if not runs or not ref:
            continue
        ppl, ppl_ref = mean_of(data, name, "ppl"), mean_of(data, base, "ppl")
        dlog = (statistics.fmean(math.log(r["ppl"]) for r in runs)
                - statistics.fmean(math.log(r["ppl"]) for r in ref))  # mean log ppl over seeds
        written = ", ".join(f"seed {r.get('seed', 0)}: {r.get('written', '?')}" + (
            f" (held-apart KL mixed {r['fallback']['kl_mixed']:.4f} vs uniform {r['fallback']['kl_uniform']:.4f})"
            if isinstance(r.get("fallback"), dict) and "kl_mixed" in r["fallback"] else "") for r in runs)
        line = (f"{name} ({ROWS[name]['avg_bits']:.4g} bits/weight budget, sensitivity "
                f"'{ROWS[name].get('sensitivity')}', {len(runs)} seed(s)): KL {spread([r.get('kl') for r in runs], '.4f')} "
                f"vs {base} {spread([r.get('kl') for r in ref], '.4f')}; Δ mean log ppl {dlog:+.4f} "
                f"(ppl {ppl:.2f} vs {ppl_ref:.2f}); stored {spread([r.get('avg_bits') for r in runs], '.3f')} "
                f"bits/weight; written: {written}")
        moved = [r["refine"]["changed_units"] for r in runs if isinstance(r.get("refine"), dict)
                 and r["refine"].get("run")]
        if moved:
            line += f"; the refinement round moved {', '.join(map(str, moved))} unit(s) per seed"
        hist = runs[0].get("config_histogram")
        if hist:
            line += f"; seed-{runs[0].get('seed', 0)} allocation {hist}"
        # the cost ratio within each run: its sensitivity pass over its own GPTQ driver pass (same process,
        # same machine load; rows from different sessions ran on machines of different speed)
        ratios = [r["sensitivity_s"] / r["phases_s"][DRIVER] for r in runs
                  if r.get("sensitivity_s") is not None and r.get("phases_s", {}).get(DRIVER)]
        if ratios:
            line += (f"; sensitivity pass {spread([r.get('sensitivity_s') for r in runs], '.0f')} s = "
                     f"{spread(ratios, '.2f')}× the run's own GPTQ pass")
        out.append(line)
    return out


NOTES = """## Notes

**Loading the checkpoints** (all tested in `tests/test_quantize.py`, CPU, tiny llama):

- uniform bits — stock `AutoModelForCausalLM.from_pretrained(out)` (transformers 5.24 +
  optimum 2.3 + gptqmodel 7.6): nothing extra is needed on CPU (transformers' GPTQ quantizer
  maps the device to CPU, gptqmodel picks `TorchAtenLinear`, which computes in bfloat16);
- mixed bits — `GPTQModel.load(out, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)`
  (its torch kernel takes fp16/bf16 only). Stock transformers cannot load mixed bits: optimum
  ignores `dynamic` and builds every layer at the base width;
- both — `layercut.compress.quant.format.loader.load_quantized(out)` (what `layercut.compress.io.models.load_model` and
  `layercut eval` use); it also reads GPTQModel's own checkpoints (all rows above).

`quantization_config.meta.quantizer` lists `gptqmodel:7.6.0` beside layercut: GPTQModel refuses
asymmetric v1 checkpoints unless a `gptqmodel:>=0.9` producer vouches for the zero-point
convention, and `compress/quant/format/pack.py` is bit-exact with GPTQModel 7.6.0's packer.

**Choices.** A group size that does not divide some linear's `in_features` is refused before
any work (no silent per-layer fallback); the default group size is 128 where it divides every
quantized linear's input size, else 64, 32 or -1 (the report's `group_size_from` says so);
SmolLM2's hidden size 576 is not a multiple of 128, so it gets 64. Linears that share an input (q/k/v, gate/up) are
solved in one GPTQ call (rows are independent given H). The default column order is act-order
with static groups (`--act-order --static-groups`, both on by default): columns are taken in
descending diag(H), group scales/zeros come from the original weight, so `g_idx = i // 64` and
the checkpoint loads with `desc_act: false` everywhere. Column orders are compared on the
validation split (`--text bundled:brown-val`, docs/results/quant-brown-val.md); the test split
only reports.

**Scale search** (issue 26; `--scale-search`, `compress/quant/solve/gptq.py`): when a group's scale and
zero are fixed (up front from the original weight under static groups), each row's min/max
range is shrunk by the factor p in 1, 0.95, ..., 0.75 (`--scale-min`, `--scale-steps`) whose
rounding error over the group is least: weighted by the Hessian diagonal H_jj (`hessian`),
by GPTQ's own column cost 1/[U]_jj² (`obs`) or unweighted (`mse`). Rows `layercut-B-asym-KIND`
run it with the float32 solve; their no-search baselines are the `-solve32` rows (same seeds).
GPTQModel's `mse=2` option (rows `gptqmodel-B-asym-mse`) searches p = 1, 0.99, ..., 0.21 by
unweighted error. The `hessian` rows of the test split and the 3-bit one of the validation split
were re-run after a fix (a float32 Hessian's diagonal was read after the factorisation had
overwritten it, which weighted by [U]_jj); the validation split's 4-bit `hessian` row ran
before the bug was introduced.
"""


def write_md(data: dict, path: Path) -> None:
    s = data["setup"]
    runs = data.get("runs", {})
    other = (s.get("model", DEFAULT_MODEL), s["group_size"]) != (DEFAULT_MODEL, 64)
    wanted = TEST_ROWS if s["text"] == DEFAULT_EVAL_TEXT else VAL_ROWS
    if other:  # another model runs the rows it was asked for (--only): those stored are the wanted ones
        wanted = [n for n in ROWS if any(k.rsplit("/", 1)[0] == n for k in runs)]
    missing = [n for n in wanted if not any(k.rsplit("/", 1)[0] == n for k in runs)]
    missing += [f"{n} seed {seed}" for n in wanted if n not in missing and ROWS[n].get("seeds")
                for seed in s["seeds"] if run_key(n, seed) not in runs]
    role = ("the test split: results are reported here and nothing is chosen on it"
            if s["text"] == DEFAULT_EVAL_TEXT else "a split for choosing defaults, not for reporting")
    flags = "" if s["text"] == DEFAULT_EVAL_TEXT else f" --text {s['text']}"
    if other:
        flags += (f" --model {s['model']} --group-size {s['group_size']} --only {','.join(wanted)}"
                  " --json-out JSON --md-out MD")
    text = [
        f"# Quantization results: {'SmolLM2-135M' if not other else Path(s['model']).name}, group size "
        f"{s['group_size']}, on `{s['text']}`",
        "",
        "Reproduce (2-core shared CPU; see the script's docstring for what each column means):",
        "",
        "```",
        "GPTQMODEL_CPU_WORKERS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quant.py "
        f"--samples {s['samples']} --seq-len {s['seq_len']} --max-tokens {s['max_tokens']} --damp {s['damp']} "
        f"--seeds {','.join(map(str, s['seeds']))}{flags} --restart",
        "```",
        "",
        f"Calibration: `{s['calib']}`, {s['samples']} × {s['seq_len']} tokens per seed, the same token batches for "
        f"every quantizer. Evaluation: `{s['text']}` ({role}), first {s['max_tokens']} tokens, ctx {s['ctx']}; "
        "KL(fp ‖ quantized) per token. Every checkpoint is evaluated through layercut's loader. Rows with several "
        "seeds (calibration draws) show mean (min–max).",
        "",
        table_md(data),
        "",
        *[f"- {line}" for line in findings(data)],
        *([f"- Not run yet (the script runs them when called again): {', '.join(missing)}."] if missing else []),
        "",
        "Time split (mean over seeds; GPTQModel's regions come from its own `quant_region_timer`, "
        "run in worker threads, so they may overlap and need not sum to the wall time):",
        "",
        *[f"- {line}" for line in phases_md(data)],
        "",
        NOTES,
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))


# ------------------------------------------------------------------ parent side: driver


VAL2_EVERY, VAL2_AT = 8, 3
VAL2_DIR = Path(tempfile.gettempdir()) / "layercut-brown-val2"


def second_val_split() -> tuple[str, str]:
    """(eval text, calibration text) of ``--second-val``: brown-calib's documents (one per Brown file, in
    ``calibrate/data/brown.json``'s file-id order) with index i % VAL2_EVERY == VAL2_AT held out for
    evaluation, the rest left for calibration; exact documents, written as .jsonl (``text`` field)."""
    from layercut.calibrate.sources import TextSource, documents

    docs = list(documents(TextSource(source=DEFAULT_CALIB_TEXT)))
    ids = json.loads((ROOT / "calibrate/data/brown.json").read_text())["splits"]["calib"]["file_ids"]
    assert len(ids) == len(docs), (len(ids), len(docs))
    VAL2_DIR.mkdir(parents=True, exist_ok=True)
    val, calib = VAL2_DIR / "brown-val2.jsonl", VAL2_DIR / "brown-calib-minus-val2.jsonl"
    for path, keep in ((val, True), (calib, False)):
        rows = [json.dumps({"text": d, "file_id": f}) for i, (d, f) in enumerate(zip(docs, ids))
                if (i % VAL2_EVERY == VAL2_AT) == keep]
        text = "\n".join(rows) + "\n"
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    return str(val), str(calib)


def default_outputs(text: str) -> tuple[str, str]:
    if text.endswith("brown-val2.jsonl"):
        return str(ROOT / "benchmarks/results/quant-brown-val2.json"), str(ROOT / "docs/results/quant-brown-val2.md")
    if text in (DEFAULT_EVAL_TEXT, "bundled:brown-heldout"):  # heldout: results from before the val/test split
        return str(ROOT / "benchmarks/results/quant.json"), str(ROOT / "docs/results/quant.md")
    slug = _slug(text)
    return str(ROOT / f"benchmarks/results/quant-{slug}.json"), str(ROOT / f"docs/results/quant-{slug}.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--text", default=DEFAULT_EVAL_TEXT,
                    help="evaluation text (default %(default)s; bundled:brown-val to choose defaults)")
    ap.add_argument("--calib", default=DEFAULT_CALIB_TEXT, help="calibration text of every row (default %(default)s)")
    ap.add_argument("--second-val", action="store_true",
                    help="a second validation split carved out of the calibration files: evaluate on brown-calib's "
                         f"files i %% {VAL2_EVERY} == {VAL2_AT} (in file-id order, 50 of 400, every genre) and calibrate on the "
                         "other 350 (both written as .jsonl under the temp dir); overrides --text and --calib")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="bundled:NAME or a model path (a .gguf is converted once); default %(default)s. Another "
                         "model needs its own --json-out and --md-out and runs the uniform-bits rows only")
    ap.add_argument("--group-size", type=int, default=64, help="group size of every row (default %(default)s)")
    ap.add_argument("--damp", type=float, default=0.01, help="damping for every matched row (default %(default)s)")
    ap.add_argument("--seeds", default="0,1,2", help="calibration seeds for the rows marked 'seeds'")
    ap.add_argument("--run-seeds", help="run only these of --seeds now (e.g. 0 first for every row, the "
                                        "other seeds in a later call); the setup keeps --seeds")
    ap.add_argument("--only", help="comma-separated row names (default: the split's row set, in order)")
    ap.add_argument("--redo", action="store_true", help="re-run rows already in the JSON")
    ap.add_argument("--restart", action="store_true", help="discard the JSON's rows and setup; start afresh")
    ap.add_argument("--json-out", help="default: benchmarks/results/quant.json for the test split, "
                    "quant-<text>.json otherwise")
    ap.add_argument("--md-out", help="default: docs/results/quant.md (test) or results-quant-<text>.md")
    ap.add_argument("--from-json", help="only re-render the markdown (to --md-out) from this JSON")
    ap.add_argument("--forget", help="comma-separated stored runs (NAME/seedN) to remove from the JSON, e.g. runs "
                                     "made by a build later found wrong; then re-render and exit")
    ap.add_argument("--work", help="folder for checkpoints and cached logits (default: a temp dir)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_model(args.model, args.group_size)
    if model_tag() and not args.child and not args.from_json and not (args.json_out and args.md_out):
        sys.exit("--model/--group-size other than the default: give --json-out and --md-out of their own")
    if args.second_val:
        args.text, args.calib = second_val_split()
    json_default, md_default = default_outputs(args.text)
    args.json_out = args.json_out or json_default
    if args.child:
        return run_child(args)
    if args.forget:
        with open(Path(args.json_out).with_name(Path(args.json_out).name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _load(Path(args.json_out))
            for key in args.forget.split(","):
                print(f"forget {key}: {'removed' if data['runs'].pop(key, None) is not None else 'not stored'}")
            tmp = Path(args.json_out).with_name(Path(args.json_out).name + ".tmp")
            tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
            tmp.replace(Path(args.json_out))
        write_md(data, Path(args.md_out or md_default))
        return
    if args.from_json:
        data = _load(Path(args.from_json))
        write_md(data, Path(args.md_out or default_outputs(data["setup"]["text"])[1]))
        return
    args.md_out = args.md_out or md_default

    out = Path(args.json_out)
    if args.restart:
        out.unlink(missing_ok=True)
    data = _load(out)
    seeds = [int(s) for s in args.seeds.split(",")]
    setup = {"version": VERSION, "threads": int(THREADS), "samples": args.samples, "seq_len": args.seq_len,
             "max_tokens": args.max_tokens, "group_size": GS, "model": MODEL, "calib": args.calib,
             "text": args.text, "ctx": 512, "damp": args.damp, "seeds": seeds}
    if data.get("setup") and data["setup"] != setup:
        sys.exit(f"{out} was made with {data['setup']}; pass --restart to start afresh, or --json-out elsewhere")
    data = {"setup": setup, "runs": data.get("runs", {})}
    work = Path(args.work or Path(tempfile.gettempdir()) / f"layercut-quant-bench{model_tag()}")
    work.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else (TEST_ROWS if args.text == DEFAULT_EVAL_TEXT else VAL_ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if model_tag():
        odd = [n for n in names if ROWS[n]["kind"] == "sensitivity" or ROWS[n].get("avg_bits")]
        if odd:
            sys.exit(f"rows {odd} are made for SmolLM2 at group 64 (their budgets and proxies); --model runs "
                     "the uniform-bits rows only")
    if "fp32" not in names and not _ref_file(args, work).is_file():
        names = ["fp32", *names]
    for name in names:
        now = [int(s) for s in args.run_seeds.split(",")] if args.run_seeds else seeds
        ref_missing = name == "fp32" and not _ref_file(args, work).is_file()  # the others' reference logits
        for seed in ([s for s in seeds if s in now] if ROWS[name].get("seeds") else
                     [0] if 0 in now or ref_missing else []):
            key = run_key(name, seed)
            if key in data["runs"] and not args.redo and not ref_missing:
                continue
            env = dict(os.environ, OMP_NUM_THREADS=THREADS, MKL_NUM_THREADS=THREADS)
            cmd = [sys.executable, __file__, "--child", name, "--seed", str(seed), "--work", str(work),
                   "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--max-tokens", str(args.max_tokens),
                   "--text", args.text, "--calib", args.calib, "--damp", str(args.damp), "--json-out", str(out),
                   "--model", MODEL, "--group-size", str(GS)]
            print(f"== {key}", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
            if proc.returncode != 0 or not rows:
                log = work / f"{name}-seed{seed}.log"
                log.write_text(proc.stdout + "\n" + proc.stderr)
                print(f"   FAILED (exit {proc.returncode}); log: {log}", flush=True)
                continue
            data = _store_run(out, setup, key, {**json.loads(rows[-1]), "process_s": time.perf_counter() - t0})
            r = data["runs"][key]
            print("   " + ", ".join(f"{k} {v:.4g}" for k, v in r.items() if isinstance(v, float)), flush=True)
    print(table_md(data))
    for line in findings(data) + phases_md(data):
        print("- " + line)
    write_md(data, Path(args.md_out))


if __name__ == "__main__":
    main()
