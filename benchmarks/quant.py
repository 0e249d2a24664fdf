"""GPTQ on SmolLM2-135M at group size 64: layercut vs GPTQModel 7.6.0 vs RTN, plus mixed bits.

Rows named ``layercut-*`` use ``layercut quantize``'s defaults (GPTQ, act-order with static
groups, damp 0.01, one Hessian pass per block) unless the row says otherwise.

Run (CPU; hours on a loaded 2-core machine — every row is one subprocess, rows already in
the JSON are kept, so an interrupted run resumes; each row runs with one intra-op thread,
``LAYERCUT_BENCH_THREADS`` to change)::

    GPTQMODEL_CPU_WORKERS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quant.py \\
        --samples 64 --seq-len 256 --max-tokens 4096

Every quantizer gets the same calibration token batches (``bundled:brown-calib``,
``calibration_batch(seed=0)``, ``--samples`` × ``--seq-len``). Every checkpoint is then
loaded with ``compress.quant.loader.load_quantized`` (GPTQModel's too) and evaluated the
same way: held-out ``bundled:brown-heldout``, ctx 512, the first ``--max-tokens`` tokens,
perplexity and KL(fp ‖ quantized) against the fp32 model's logits (computed once).
"wall s" is the whole quantize call in its own process: model load, calibration,
quantization and writing the checkpoint; "peak RSS" is that process's high-water mark
before evaluation. GPTQModel runs with its own defaults (damp 0.05, act_group_aware,
true_sequential, CPU dtype bfloat16) except bits / group size / sym / desc_act=False;
layercut with its defaults (damp 0.01, asym unless "sym", sequential="block", fp32).

Rows "mixed" allocate {2,3,4,8} bits per unit at the byte budget of uniform 3-bit g64
(3 + 19/64 = 3.296875 bits/weight incl. scales and zeros). Row "sensitivity" measures, on
4 × 256 calibration tokens, the true Δ_u(b) = KL(fp ‖ only layer u at b bits) and the
cheap proxies, and reports their Spearman rank correlation; the mixed rows use the proxy
that ranks best. Writes ``benchmarks/results/quant.json`` and ``docs/results-quant.md``
(the table and the issue's targets: ppl vs GPTQModel within 1%, GPTQ beats RTN, wall
≤ 0.5× GPTQModel's, mixed bits closing ≥ 30% of the 3→4-bit gap).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

MODEL = "bundled:smollm2-135m"
GS = 64
BUDGET_3BIT = 3 + (16 + 3) / GS  # uniform 3-bit g64, overhead included

# name -> what to run; order = run order (cheap and headline rows first)
ROWS: dict[str, dict] = {
    "fp32": {"kind": "fp"},
    "rtn-4-asym": {"kind": "ours", "method": "rtn", "bits": 4, "sym": False},
    "rtn-3-asym": {"kind": "ours", "method": "rtn", "bits": 3, "sym": False},
    "rtn-4-sym": {"kind": "ours", "method": "rtn", "bits": 4, "sym": True},
    "rtn-3-sym": {"kind": "ours", "method": "rtn", "bits": 3, "sym": True},
    # layercut rows use the command's defaults (act-order with static groups) unless they say otherwise
    "layercut-4-asym": {"kind": "ours", "method": "gptq", "bits": 4, "sym": False},
    "gptqmodel-4-asym": {"kind": "gptqmodel", "bits": 4, "sym": False},
    "layercut-4-asym-gar": {"kind": "ours", "method": "gptq", "bits": 4, "sym": False, "act_order": False,
                            "static_groups": False, "group_aware": True},
    "layercut-4-asym-natural": {"kind": "ours", "method": "gptq", "bits": 4, "sym": False, "act_order": False,
                                "static_groups": False},
    "layercut-3-asym": {"kind": "ours", "method": "gptq", "bits": 3, "sym": False},
    "gptqmodel-3-asym": {"kind": "gptqmodel", "bits": 3, "sym": False},
    "sensitivity": {"kind": "sensitivity"},
    "mixed-layer": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": "layer", "sym": False},
    "mixed-group": {"kind": "ours", "method": "gptq", "avg_bits": BUDGET_3BIT, "unit": "group", "sym": False},
    "layercut-4-sym": {"kind": "ours", "method": "gptq", "bits": 4, "sym": True},
    "gptqmodel-4-sym": {"kind": "gptqmodel", "bits": 4, "sym": True},
    "layercut-3-sym": {"kind": "ours", "method": "gptq", "bits": 3, "sym": True},
    "gptqmodel-3-sym": {"kind": "gptqmodel", "bits": 3, "sym": True},
    "layercut-3-asym-linear": {"kind": "ours", "method": "gptq", "bits": 3, "sym": False, "sequential": "linear"},
}


# ------------------------------------------------------------------ child side


class CachedReference:
    """evaluate()'s reference model, replayed from fp16 logits stored by the fp32 row."""

    def __init__(self, store: dict[bytes, object]):
        import torch

        self.store = store
        self._p = torch.zeros(1)

    def parameters(self):
        yield self._p

    def __call__(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.store[input_ids.cpu().numpy().tobytes()].float())


def _evaluate(model, tok, args, ref_file: Path) -> dict:
    import torch

    from compress.evaluate import evaluate

    store = torch.load(ref_file, weights_only=False)
    res = evaluate(model, tok, ctx=512, max_tokens=args.max_tokens, reference=CachedReference(store),
                   progress=False)
    return {"ppl": res.ppl, "kl": res.kl, "eval_tokens": res.tokens}


def _load_for_eval(path: Path):
    from compress.quant.loader import load_quantized
    from compress.quant.qlinear import QuantLinear

    model = load_quantized(path)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.cache_dequantized = True  # CPU eval speed; same numbers as the op
    return model


def _weight_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def _stored_bits(path: Path) -> float:
    """Bits stored per quantized weight (qweight + qzeros + fp16 scales), read from the files."""
    from safetensors import safe_open

    n = stored = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.endswith(".qweight"):
                    rows, out = fh.get_slice(k).get_shape()
                    n += fh.get_slice(k[: -len("qweight")] + "g_idx").get_shape()[0] * out
                if k.endswith((".qweight", ".qzeros", ".scales")):
                    t = fh.get_tensor(k)
                    stored += t.numel() * t.element_size() * 8
    return stored / n


def child_fp(args, work: Path) -> dict:
    import torch

    from compress.evaluate import evaluate
    from compress.models import load_model

    model, tok = load_model(MODEL)
    store: dict[bytes, torch.Tensor] = {}

    class Recorder:
        def parameters(self):
            return model.parameters()

        def modules(self):
            return model.modules()

        def __call__(self, input_ids, use_cache=False):
            out = model(input_ids=input_ids, use_cache=False)
            store[input_ids.cpu().numpy().tobytes()] = out.logits.half()
            return out

    res = evaluate(Recorder(), tok, ctx=512, max_tokens=args.max_tokens, progress=False)
    torch.save(store, work / "ref_logits.pt")
    from compress.models import resolve_model, weight_bytes

    return {"ppl": res.ppl, "kl": 0.0, "eval_tokens": res.tokens, "weights_mb": weight_bytes(resolve_model(MODEL)) / 2**20}


def child_ours(args, work: Path, name: str, spec: dict) -> dict:
    from compress.models import load_tokenizer
    from compress.quant.run import quantize_checkpoint

    out = work / name
    sens = spec.get("sensitivity") or _best_proxy(args)
    t0 = time.perf_counter()
    report = quantize_checkpoint(
        MODEL, out, bits=spec.get("bits"), avg_bits=spec.get("avg_bits"), unit=spec.get("unit", "layer"),
        group_size=GS, sym=spec["sym"], method=spec["method"], sequential=spec.get("sequential", "block"),
        act_order=spec.get("act_order", True), static_groups=spec.get("static_groups", True),
        group_aware=spec.get("group_aware", False), damp=spec.get("damp", 0.01),
        samples=args.samples, seq_len=args.seq_len, sensitivity=sens, progress=False, overwrite=True,
    )
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    row = {"wall_s": wall, "peak_rss_mb": rss, "avg_bits": _stored_bits(out), "weights_mb": _weight_mb(out),
           "solve_s": report["solve_seconds"]}
    if "unit_bits" in report:
        row.update(unit_bits=report["unit_bits"], bits_histogram=report["bits_histogram"], sensitivity=sens,
                   sensitivity_s=report["sensitivity_seconds"])
    row.update(_evaluate(_load_for_eval(out), load_tokenizer(MODEL), args, work / "ref_logits.pt"))
    return row


def child_gptqmodel(args, work: Path, name: str, spec: dict) -> dict:
    from gptqmodel import GPTQModel, QuantizeConfig

    from calibrate.data import calibration_batch
    from compress.models import load_tokenizer, resolve_model

    out = work / name
    t0 = time.perf_counter()
    tok = load_tokenizer(MODEL)
    calib = calibration_batch(tok, "bundled:brown-calib", samples=args.samples, seq_len=args.seq_len, seed=0)
    data = [{"input_ids": calib.input_ids[i].tolist(), "attention_mask": calib.attention_mask[i].tolist()}
            for i in range(calib.num_samples)]
    qcfg = QuantizeConfig(bits=spec["bits"], group_size=GS, sym=spec["sym"], desc_act=False)
    model = GPTQModel.load(str(resolve_model(MODEL)), qcfg)
    model.quantize(data, batch_size=8)
    model.save(str(out))
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    del model
    row = {"wall_s": wall, "peak_rss_mb": rss, "avg_bits": _stored_bits(out), "weights_mb": _weight_mb(out),
           "gptqmodel_config": json.loads((out / "config.json").read_text())["quantization_config"]}
    row["gptqmodel_config"].pop("meta", None)
    row.update(_evaluate(_load_for_eval(out), tok, args, work / "ref_logits.pt"))
    return row


def child_sensitivity(args, work: Path) -> dict:
    from calibrate.data import CalibSet, calibration_batch
    from compress.models import load_model
    from compress.quant.sensitivity import allocation_units, measure_sensitivity, rank_correlation
    from compress.quant.stage import QuantConfig

    model, tok = load_model(MODEL)
    full = calibration_batch(tok, "bundled:brown-calib", samples=args.samples, seq_len=args.seq_len, seed=0)
    calib = CalibSet(full.input_ids[:4, :256], full.attention_mask[:4, :256])
    units = allocation_units(model, "layer")
    cands = (2, 3, 4)
    t0 = time.perf_counter()
    table = measure_sensitivity(model, calib, units, cands, QuantConfig(group_size=GS),
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
    return {"seconds": time.perf_counter() - t0, "tokens": table.tokens, "candidates": list(cands),
            "spearman": corr, "table": table.to_dict()["by_method"]}


def _best_proxy(args) -> str:
    """The proxy whose per-bits rank correlation with the KL is best (mean over bits)."""
    rows = _load(Path(args.json_out)).get("rows", {})
    corr = rows.get("sensitivity", {}).get("spearman")
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
        row = child_ours(args, work, args.child, spec)
    elif kind == "gptqmodel":
        row = child_gptqmodel(args, work, args.child, spec)
    else:
        row = child_sensitivity(args, work)
    print("ROW " + json.dumps(row, default=str), flush=True)


# ------------------------------------------------------------------ parent side


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table_md(data: dict) -> str:
    rows = data.get("rows", {})
    fp = rows.get("fp32", {}).get("ppl")
    lines = ["| row | stored bits/weight | ppl | Δppl vs fp | KL to fp | wall s | peak RSS MB | weights MB |",
             "|---|---|---|---|---|---|---|---|"]
    for name, spec in ROWS.items():
        r = rows.get(name)
        if not r or spec["kind"] == "sensitivity":
            continue
        bits = "fp32" if spec["kind"] == "fp" else f"{r['avg_bits']:.3f}"
        dppl = f"{100 * (r['ppl'] / fp - 1):+.1f}%" if fp and name != "fp32" else ""
        lines.append(f"| {name} | {bits} | {r['ppl']:.2f} | {dppl} | {_fmt(r.get('kl'), '.4f')} | "
                     f"{_fmt(r.get('wall_s'), '.0f')} | {_fmt(r.get('peak_rss_mb'), '.0f')} | "
                     f"{_fmt(r.get('weights_mb'), '.1f')} |")
    return "\n".join(lines)


def findings(data: dict) -> list[str]:
    """The issue's targets, computed from the rows present."""
    rows, out = data.get("rows", {}), []

    def ppl(name):
        return rows.get(name, {}).get("ppl")

    for setting in ("4-asym", "3-asym", "4-sym", "3-sym"):
        ours, gm, rtn = rows.get(f"layercut-{setting}"), rows.get(f"gptqmodel-{setting}"), rows.get(f"rtn-{setting}")
        if ours and gm:
            out.append(f"{setting}: layercut ppl {ours['ppl']:.2f} vs GPTQModel {gm['ppl']:.2f} "
                       f"({100 * (ours['ppl'] / gm['ppl'] - 1):+.2f}%, target: at most +1%); KL {ours['kl']:.4f} vs "
                       f"{gm['kl']:.4f}; wall {ours['wall_s']:.0f} s vs {gm['wall_s']:.0f} s "
                       f"(= {ours['wall_s'] / gm['wall_s']:.2f}x, target <= 0.5x)")
        if ours and rtn:
            out.append(f"{setting}: layercut GPTQ ppl {ours['ppl']:.2f} vs RTN {rtn['ppl']:.2f} "
                       f"({'beats' if ours['ppl'] < rtn['ppl'] else 'does NOT beat'} RTN)")
    labels = {"layercut-4-asym-natural": "natural", "layercut-4-asym-gar": "group-aware (GAR, GPTQModel's default)",
              "layercut-4-asym": "act-order + static groups (layercut's default)"}
    if sum(n in rows for n in labels) > 1:
        out.append("column order, 4-bit asym: " + "; ".join(
            f"{label} ppl {rows[n]['ppl']:.2f}, KL {rows[n]['kl']:.4f}" for n, label in labels.items() if n in rows))
    p3, p4 = ppl("layercut-3-asym"), ppl("layercut-4-asym")
    for name in ("mixed-layer", "mixed-group"):
        m = rows.get(name)
        if m and p3 and p4:
            frac = (p3 - m["ppl"]) / (p3 - p4)
            out.append(f"{name}: {m['avg_bits']:.4f} avg bits (uniform 3-bit: {BUDGET_3BIT:.4f}), ppl {m['ppl']:.2f}: "
                       f"closes {100 * frac:.0f}% of the 3->4-bit gap ({p3:.2f} -> {p4:.2f}; target >= 30%); "
                       f"bits {m.get('bits_histogram')}, sensitivity '{m.get('sensitivity')}'")
    if ppl("layercut-3-asym-linear") and p3:
        lin = rows["layercut-3-asym-linear"]
        out.append(f"sequential='linear' (4 Hessian passes/block) at 3-bit asym: ppl {lin['ppl']:.2f}, wall "
                   f"{lin['wall_s']:.0f} s vs 'block' ppl {p3:.2f}, wall {rows['layercut-3-asym']['wall_s']:.0f} s")
    sens = rows.get("sensitivity")
    if sens:
        for proxy, c in sens["spearman"].items():
            per = ", ".join(f"{b} bits {v:.2f}" for b, v in c["per_bits"].items())
            out.append(f"Spearman(KL, {proxy}) (4 × 256 tokens, units quantized in natural column order): across layers at {per}; all (layer, bits) pairs {c['all_pairs']:.2f}; "
                       f"gains Δ(b)-Δ(b+1) {c['gains']:.2f}")
    return out


NOTES = """## Notes

**Loading the checkpoints** (all tested in `tests/test_quantize.py`, CPU, tiny llama):

- uniform bits — stock `AutoModelForCausalLM.from_pretrained(out)` (transformers 5.24 +
  optimum 2.3 + gptqmodel 7.6): nothing extra is needed on CPU (transformers' GPTQ quantizer
  maps the device to CPU, gptqmodel picks `TorchAtenLinear`, which computes in bfloat16);
- mixed bits — `GPTQModel.load(out, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)`
  (its torch kernel takes fp16/bf16 only). Stock transformers cannot load mixed bits: optimum
  ignores `dynamic` and builds every layer at the base width;
- both — `compress.quant.loader.load_quantized(out)` (what `compress.models.load_model` and
  `layercut eval` use); it also reads GPTQModel's own checkpoints (all rows above).

`quantization_config.meta.quantizer` lists `gptqmodel:7.6.0` beside layercut: GPTQModel refuses
asymmetric v1 checkpoints unless a `gptqmodel:>=0.9` producer vouches for the zero-point
convention, and `compress/quant/pack.py` is bit-exact with GPTQModel 7.6.0's packer.

**Choices.** A group size that does not divide some linear's `in_features` is refused before
any work (no silent per-layer fallback); the default group size is 64 because SmolLM2's
hidden size 576 is not a multiple of 128. Linears that share an input (q/k/v, gate/up) are
solved in one GPTQ call (rows are independent given H). The default column order is act-order
with static groups (`--act-order --static-groups`, both on by default): columns are taken in
descending diag(H), group scales/zeros come from the original weight, so `g_idx = i // 64` and
the checkpoint loads with `desc_act: false` everywhere; it measured better than GAR (GPTQModel's
default) and than the natural order (rows `layercut-4-asym-*`). The allocator's default sensitivity
is the block-output error (`output`): of the cheap proxies it ranks layers most like the true KL
at each width (row "sensitivity" above), although all of them do so only weakly on this model.
"""


def write_md(data: dict, path: Path) -> None:
    s = data["setup"]
    missing = [n for n in ROWS if n not in data.get("rows", {})]
    text = [
        "# Quantization results: SmolLM2-135M, group size 64",
        "",
        "Reproduce (2-core shared CPU, fp32; see the script's docstring for what each column means):",
        "",
        "```",
        "GPTQMODEL_CPU_WORKERS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quant.py "
        f"--samples {s['samples']} --seq-len {s['seq_len']} --max-tokens {s['max_tokens']}",
        "```",
        "",
        f"Calibration: `{s['calib']}`, {s['samples']} × {s['seq_len']} tokens, the same token batches for every "
        f"quantizer. Held-out: `{s['text']}`, first {s['max_tokens']} tokens, ctx {s['ctx']}; KL(fp ‖ quantized) "
        "per token. Every checkpoint is evaluated through layercut's loader.",
        "",
        table_md(data),
        "",
        *[f"- {line}" for line in findings(data)],
        *([f"- Not run yet (the script runs them when called again): {', '.join(missing)}."] if missing else []),
        "",
        NOTES,
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--only", help="comma-separated row names (default: all, in order)")
    ap.add_argument("--redo", action="store_true", help="re-run rows already in the JSON")
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks/results/quant.json"))
    ap.add_argument("--md-out", default=str(ROOT / "docs/results-quant.md"))
    ap.add_argument("--work", help="folder for checkpoints and cached logits (default: a temp dir)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args)

    out = Path(args.json_out)
    data = _load(out)
    setup = {"threads": int(THREADS), "samples": args.samples, "seq_len": args.seq_len, "max_tokens": args.max_tokens, "group_size": GS,
             "model": MODEL, "calib": "bundled:brown-calib", "text": "bundled:brown-heldout", "ctx": 512}
    if data.get("setup") and data["setup"] != setup:
        sys.exit(f"{out} was made with {data['setup']}; pass --json-out elsewhere or delete it")
    data["setup"] = setup
    data.setdefault("rows", {})
    work = Path(args.work or Path(tempfile.gettempdir()) / "layercut-quant-bench")
    work.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(ROWS)
    if "fp32" not in names and not (work / "ref_logits.pt").is_file():
        names = ["fp32", *names]
    for name in names:
        if name in data["rows"] and not args.redo and not (name == "fp32" and not (work / "ref_logits.pt").is_file()):
            continue
        env = dict(os.environ, OMP_NUM_THREADS=THREADS, MKL_NUM_THREADS=THREADS)
        cmd = [sys.executable, __file__, "--child", name, "--work", str(work), "--samples", str(args.samples),
               "--seq-len", str(args.seq_len), "--max-tokens", str(args.max_tokens), "--json-out", str(out)]
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode != 0 or not rows:
            (work / f"{name}.log").write_text(proc.stdout + "\n" + proc.stderr)
            print(f"   FAILED (exit {proc.returncode}); log: {work / name}.log", flush=True)
            continue
        data["rows"][name] = json.loads(rows[-1])
        data["rows"][name]["process_s"] = time.perf_counter() - t0
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2, default=str) + "\n")
        r = data["rows"][name]
        print("   " + ", ".join(f"{k} {v:.4g}" for k, v in r.items() if isinstance(v, float)), flush=True)
    print(table_md(data))
    for line in findings(data):
        print("- " + line)
    write_md(data, Path(args.md_out))


if __name__ == "__main__":
    main()
