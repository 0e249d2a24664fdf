"""Does untying SmolLM2-135M's head and quantizing it pay? Bytes on disk and KL, with and without the head.

Run (CPU, one intra-op thread, ~4 min per seed and body width on a quiet core; rows already in
the JSON are kept, so an interrupted run resumes)::

    # the decision (offer untying or not) on the validation split
    nice -n 5 .venv/bin/python benchmarks/head.py --text bundled:brown-val
    # the same rows on the test split, on which nothing is chosen
    nice -n 5 .venv/bin/python benchmarks/head.py
    .venv/bin/python benchmarks/head.py --from-json benchmarks/results/head-brown-val.json   # table only

Outputs ``benchmarks/results/head.json`` for the test split, ``head-<text>.json`` otherwise.

There is no untied real model offline, so the untied model is the bundled one made untied: the
embedding stays dense (fp16 on disk, as in every layercut checkpoint) and the head starts as a
copy of it (``tie_word_embeddings`` false), i.e. the checkpoint stores the vocabulary twice.
That is what "untie, then quantize the head" costs on a tied model; on a natively untied model
the dense-head row is the baseline and only the head rows' difference to it applies.

Per seed s (calibration draw ``calibration_batch(seed=s)``, ``--samples`` x ``--seq-len`` of
``bundled:brown-calib``, as benchmarks/quant.py) and body width B, the decoder blocks are
GPTQ-quantized once (B bits, group 64, asymmetric, layercut's defaults otherwise) on the untied
model; the blocks do not see the head, so every row of (s, B) has the same blocks:

* ``tied``: the bundled tied model with those blocks (the head is the fp16 embedding);
* ``untied-dense``: untied, the head dense (fp16);
* ``untied-8g64`` / ``untied-4g64``: untied, the head GPTQ-quantized on the final-norm outputs
  of the quantized blocks (:func:`layercut.compress.quant.solve.head.quantize_head`).

Each checkpoint is written by :func:`~layercut.compress.quant.format.checkpoint.save_quantized`, read
back by ``load_quantized`` and scored on the first ``--max-tokens`` tokens of ``--text`` (ctx
512): perplexity and KL(fp32 tied model ‖ checkpoint). "MB" is the safetensors files' size.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
THREADS = int(os.environ.get("LAYERCUT_BENCH_THREADS", "1"))

from benchmarks._results import write_merged  # noqa: E402
from layercut.calibrate import DEFAULT_CALIB_TEXT, DEFAULT_EVAL_TEXT  # noqa: E402

MODEL = "bundled:smollm2-135m"
GS = 64
VARIANTS = ("tied", "untied-dense", "untied-8g64", "untied-4g64")
HEADS = {"untied-8g64": (8, GS), "untied-4g64": (4, GS)}


class CachedReference:
    """The fp32 model's log-probs per window, computed once (evaluate() calls it per window)."""

    def __init__(self, model):
        self.model, self.store = model, {}

    def parameters(self):
        return self.model.parameters()

    def __call__(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        key = input_ids.cpu().numpy().tobytes()
        if key not in self.store:
            self.store[key] = self.model(input_ids=input_ids, use_cache=False).logits.half()
        return SimpleNamespace(logits=self.store[key].float())


def _cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6


def untied_copy(model):
    """The model with its head a separate copy of the embedding (``tie_word_embeddings`` false)."""
    import torch

    out = copy.deepcopy(model)
    out.config.tie_word_embeddings = False
    head = out.get_output_embeddings()
    head.weight = torch.nn.Parameter(out.get_input_embeddings().weight.detach().clone())
    assert head.weight is not out.get_input_embeddings().weight
    return out


def run_seed(args, seed: int, bits: int, fp, tok, ref, work: Path) -> dict:
    import torch

    from layercut.calibrate.data import calibration_batch
    from layercut.compress.eval.evaluate import evaluate
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.format.checkpoint import save_quantized
    from layercut.compress.quant.format.loader import load_quantized
    from layercut.compress.quant.format.qlinear import QuantLinear
    from layercut.compress.quant.format.result import QuantizeResult
    from layercut.compress.quant.plan import solver_settings
    from layercut.compress.quant.search.mixed import load_weights
    from layercut.compress.quant.solve.driver import quantize_model
    from layercut.compress.quant.solve.head import head_hessian, quantize_head

    calib = calibration_batch(tok, args.calib, samples=args.samples, seq_len=args.seq_len, seed=seed)
    cfg = solver_settings(QuantizeConfig(bits=bits, group_size=GS, act_order=True, static_groups=True,
                                         scale_search="none", scale_bounds="joint"))  # the measured settings
    model = untied_copy(fp)
    last: dict = {}

    def grab(run, _result):  # the quantized last block's raw outputs h_L (one more block forward)
        if run.is_last:
            last["h"] = run.outputs()

    t0, c0 = time.perf_counter(), _cpu_s()
    body = quantize_model(model, calib, cfg, batch_size=8, progress=False, after_block=grab)
    body_s, body_cpu = time.perf_counter() - t0, _cpu_s() - c0
    H, n = head_hessian(model, last.pop("h"), [m.bool() for _, m in calib.split(8)])
    head_fp = model.get_output_embeddings().weight.detach().clone()
    rows = {}
    for variant in VARIANTS:
        path = work / f"{variant}-b{bits}-s{seed}"
        head_s = 0.0
        if variant == "tied":
            tied = copy.deepcopy(fp)
            load_weights(tied, body)  # the same quantized blocks
            save_quantized(tied, tok, body, path, overwrite=True)
            del tied
        elif variant == "untied-dense":
            save_quantized(model, tok, body, path, overwrite=True)
        else:
            res = QuantizeResult(config=cfg, layers=dict(body.layers), tokens=body.tokens)
            model.get_output_embeddings().weight.data.copy_(head_fp)
            t1 = time.perf_counter()
            quantize_head(model, H, *HEADS[variant], cfg, res)
            head_s = time.perf_counter() - t1
            save_quantized(model, tok, res, path, overwrite=True)
        q = load_quantized(path)
        for m in q.modules():
            if isinstance(m, QuantLinear):
                m.cache_dequantized = True  # CPU eval speed; same numbers as the op
        with torch.no_grad():
            ev = evaluate(q, tok, text=args.text, ctx=512, max_tokens=args.max_tokens, reference=ref, progress=False)
        rows[variant] = {"mb": _mb(path), "kl": ev.kl, "ppl": ev.ppl, "eval_tokens": ev.tokens, "head_solve_s": head_s}
        del q
    return {"seed": seed, "bits": bits, "group_size": GS, "body_wall_s": body_s, "body_cpu_s": body_cpu,
            "head_tokens": n, "rows": rows}


def table(result: dict) -> str:
    runs = result.get("runs", {})
    lines = [f"{MODEL}, blocks GPTQ g{GS} asym, text {result.get('text')}, {result.get('max_tokens')} tokens, "
             f"ctx 512; KL(fp32 ‖ q) mean (min–max) over seeds",
             "| body | head | MB on disk | KL | ppl | seeds |", "|---|---|---|---|---|---|"]
    for bits in sorted({r["bits"] for r in runs.values()}, reverse=True):
        for variant in VARIANTS:
            rs = [r["rows"][variant] for r in runs.values() if r["bits"] == bits]
            kl = [r["kl"] for r in rs]
            lines.append(f"| {bits}-bit | {variant} | {statistics.mean(r['mb'] for r in rs):.1f} | "
                         f"{statistics.mean(kl):.4f} ({min(kl):.4f}–{max(kl):.4f}) | "
                         f"{statistics.mean(r['ppl'] for r in rs):.2f} | {len(rs)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--text", default=DEFAULT_EVAL_TEXT)
    ap.add_argument("--calib", default=DEFAULT_CALIB_TEXT)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--bits", default="4,3", help="body widths (default %(default)s)")
    ap.add_argument("--redo", action="store_true", help="re-run rows already in the JSON")
    ap.add_argument("--json-out")
    ap.add_argument("--from-json", help="only print the table of this JSON")
    args = ap.parse_args()
    if args.from_json:
        import json

        print(table(json.loads(Path(args.from_json).read_text())))
        return
    import json

    import torch

    from layercut.compress.io.models import load_model

    torch.set_num_threads(THREADS)
    slug = args.text.split(":", 1)[-1]
    out = Path(args.json_out or ROOT / "benchmarks" / "results" /
               ("head.json" if args.text == DEFAULT_EVAL_TEXT else f"head-{slug}.json"))
    stored = json.loads(out.read_text()) if out.is_file() else {}
    setup = {"model": MODEL, "text": args.text, "calib": args.calib, "samples": args.samples, "seq_len": args.seq_len,
             "max_tokens": args.max_tokens, "threads": THREADS,
             "note": "untied = the bundled tied model with its head a separate copy of the embedding "
                     "(no untied real model offline); embedding fp16 on disk in every row"}
    if any(stored.get(k) != v for k, v in setup.items() if k in ("samples", "seq_len", "max_tokens", "text")):
        stored = {}  # other settings: start afresh
    runs = dict(stored.get("runs", {}))
    fp, tok = load_model(MODEL)
    ref = CachedReference(fp)
    with tempfile.TemporaryDirectory() as tmp:
        for bits in map(int, args.bits.split(",")):
            for seed in map(int, args.seeds.split(",")):
                key = f"b{bits}/seed{seed}"
                if key in runs and not args.redo:
                    continue
                runs[key] = run_seed(args, seed, bits, fp, tok, ref, Path(tmp))
                write_merged(out, {**setup, "runs": runs})
                print(f"{key}: " + ", ".join(f"{v} {r['mb']:.1f} MB KL {r['kl']:.4f}"
                                             for v, r in runs[key]["rows"].items()), flush=True)
    result = write_merged(out, {**setup, "runs": runs})
    print(table(result))


if __name__ == "__main__":
    main()
