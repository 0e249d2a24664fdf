"""How much of the 3→4-bit KL gap ``--sensitivity kl-swap`` closes at uniform-3-bit bytes, and why (issue 26 part 6).

Run (after the quant rows; no quantization here, only reading)::

    python benchmarks/quant.py --text bundled:brown-val --only mixed-3.297-klswap-layer-s8   # the rows
    python benchmarks/kl_swap.py            # -> benchmarks/results/kl_swap.json + docs/results/kl-swap.md

Reads ``benchmarks/results/quant-brown-val.json`` (validation) and ``quant.json`` (test), and each kl-swap
row's ``allocation.json`` in the benchmark's work folder (``--work``, default the temp dir
``benchmarks/quant.py`` uses) for the measured Δ table. Per seed: the fraction of the gap closed,
(KL_3 − KL) / (KL_3 − KL_4), with KL_3 / KL_4 the uniform 3g64 / 4g64 rows of the same calibration
seed (``layercut-3-asym-solve32``, ``layercut-4-asym``); the default allocator's rows
(``mixed-3.297-no3ch``) the same way. From the Δ table: the additive prediction of the chosen plan,
and the exchange rate that bounds any plan at these bytes: KL lowered per bit spent by promoting a
unit 3g64 → 4g64, and KL raised per bit saved by demoting one 3g64 → 3ch, best units first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPLITS = {"val": ROOT / "benchmarks/results/quant-brown-val.json", "test": ROOT / "benchmarks/results/quant.json"}
U3, U4, DEFAULT = "layercut-3-asym-solve32", "layercut-4-asym", "mixed-3.297-no3ch"


def _runs(path: Path) -> dict:
    return json.loads(path.read_text()).get("runs", {}) if path.is_file() else {}


def _gap(runs: dict, name: str, seed: int) -> dict | None:
    r, u3, u4 = (runs.get(f"{n}/seed{seed}") for n in (name, U3, U4))
    if not (r and u3 and u4):
        return None
    return {"seed": seed, "kl": r["kl"], "ppl": r["ppl"], "kl_3": u3["kl"], "kl_4": u4["kl"],
            "closed": (u3["kl"] - r["kl"]) / (u3["kl"] - u4["kl"]), "written": r.get("written"),
            "configs": r.get("config_histogram"), "wall_s": r.get("wall_s"), "cpu_s": r.get("cpu_s"),
            "sensitivity_s": r.get("sensitivity_s"), "fallback": r.get("fallback")}


def _in_features(name: str, cfg: dict) -> int:
    """Input size of a SmolLM2-style unit (down: intermediate size; the others: hidden size)."""
    return cfg["intermediate_size"] if name.endswith("down") else cfg["hidden_size"]


def _rates(alloc: dict, cfg: dict) -> dict:
    """Exchange rates from a kl-swap Δ table: KL change per bit, costs as the writer counts them
    (C = n·b + groups·(16 + b); 3ch has one group per output row)."""
    units = alloc["units"]
    base = alloc["baseline"]
    promo, demo = [], []
    for u in units:
        d = u["delta"]
        n = u["n_weights"]
        groups64, rows = n // 64, n // _in_features(u["name"], cfg)
        if "4g64" in d:
            promo.append((d["4g64"] - d[base]) / (n + groups64))  # one more bit per weight and per zero
        if "3ch" in d:
            demo.append((d["3ch"] - d[base]) / ((groups64 - rows) * 19))  # scale + zero per group saved
    promo.sort()
    demo.sort()
    sens = alloc["sensitivity"]
    return {"base_kl_swapset": sens.get("base_kl"), "tokens": sens.get("tokens"), "swaps": sens.get("swaps"),
            "sum_delta_4g64": sum(u["delta"].get("4g64", 0.0) for u in units),
            "sum_delta_3ch": sum(u["delta"].get("3ch", 0.0) for u in units),
            "promotions_lowering_kl": sum(1 for x in promo if x < 0), "demotions_lowering_kl": sum(1 for x in demo if x < 0),
            "best_promotion_per_Mbit": [x * 1e6 for x in promo[:5]], "median_promotion_per_Mbit": statistics.median(promo) * 1e6 if promo else None,
            "best_demotion_per_Mbit": [x * 1e6 for x in demo[:5]], "median_demotion_per_Mbit": statistics.median(demo) * 1e6 if demo else None,
            "predicted_delta_plan": sum(u["delta"][u["config"]] for u in units if u["config"] in u["delta"]),
            "plan": {c: sum(1 for u in units if u["config"] == c) for c in sorted({u["config"] for u in units})}}


EXACT = ROOT / "benchmarks/results/sensitivity_exact.json"
EXACT_LABELS = {"2b_g64": (2, 64), "3b_ch": (3, -1), "3b_g128": (3, 128), "3b_g64": (3, 64), "4b_g64": (4, 64)}
EXACT_SETS = (("3b_ch", "3b_g64", "4b_g64"), ("3b_ch", "3b_g128", "3b_g64", "4b_g64"),
              ("2b_g64", "3b_ch", "3b_g128", "3b_g64", "4b_g64"))


def exact_bound() -> dict | None:
    """What the exact per-group-unit swap table (``benchmarks/sensitivity_exact.py``: every unit moved
    alone from uniform 3g64, 2,048 held-apart tokens) promises at uniform-3g64 bytes if swaps added
    up, against what its DP plans measured when quantized; and the exchange rate between promotions
    and demotions, per Mbit (costs as the writer counts them)."""
    from layercut.compress.quant.search.allocate import Unit, allocate_bits

    if not EXACT.is_file():
        return None
    d = json.loads(EXACT.read_text())
    units, entries, base = d["units"], d["entries"], d["baseline"]["kl"]
    kl4 = d["checks"]["uniform 4b_g64: sequential"]["kl"]
    out: dict = {"baseline_kl": base, "uniform_4g64_kl": kl4, "tokens": d["settings"]["eval_windows"] * 256,
                 "dp": []}
    for cset in EXACT_SETS:
        table = [Unit(u["name"], u["n_weights"],
                      {EXACT_LABELS[c]: (0.0 if c == "3b_g64" else entries[u["name"]][c]["delta"])
                       for c in cset if c == "3b_g64" or c in entries[u["name"]]},
                      n_rows=u["n_rows"], in_features=(u["in_features"],)) for u in units]
        a = allocate_bits(table, 3 + 19 / 64)
        out["dp"].append({"candidates": list(cset), "predicted_delta": a.total_delta, "plan": a.pair_histogram(),
                          "predicted_closed": -a.total_delta / (base - kl4)})
    promo = sorted(entries[u["name"]]["4b_g64"]["delta"] / (u["n_weights"] + u["n_weights"] // 64) * 1e6
                   for u in units)
    demo = sorted(entries[u["name"]]["3b_ch"]["delta"] / ((u["n_weights"] // 64 - u["n_rows"]) * 19) * 1e6
                  for u in units)
    out.update(promotion_per_Mbit_median=statistics.median(promo), promotion_per_Mbit_best=promo[:5],
               demotion_per_Mbit_median=statistics.median(demo), demotion_per_Mbit_best=demo[:5],
               demotions_below_zero=sum(1 for x in demo if x < 0), units=len(units))
    out["measured"] = {k: {"kl": v["kl"], "fresh_kl": v.get("fresh_kl"), "predicted_kl": v.get("predicted_kl")}
                       for k, v in d["checks"].items() if k.startswith("DP 3-bit g64 bytes")}
    out["fresh_uniform_kl"] = d["fresh"]["kl"]
    return out


def collect(work: Path) -> dict:
    from layercut.compress.io.models import resolve_model

    cfg = json.loads((resolve_model("bundled:smollm2-135m") / "config.json").read_text())
    out: dict = {}
    for split, path in SPLITS.items():
        runs = _runs(path)
        names = sorted({k.split("/")[0] for k in runs if "klswap" in k} | {DEFAULT})
        for name in names:
            rows = [g for s in (0, 1, 2) if (g := _gap(runs, name, s))]
            if not rows:
                continue
            for g in rows:
                alloc = work / f"{name}-seed{g['seed']}" / "allocation.json"
                if "klswap" in name and alloc.is_file():
                    g["table"] = _rates(json.loads(alloc.read_text()), cfg)
            out.setdefault(split, {})[name] = rows
    return {"rows": out, "exact_table": exact_bound()}


def _fmt(xs: list[float], pct: bool = False) -> str:
    f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.4f}")
    return f(statistics.mean(xs)) + (f" ({f(min(xs))}–{f(max(xs))})" if len(xs) > 1 else "")


def render(data: dict) -> str:
    lines = ["# kl-swap at uniform-3-bit bytes on SmolLM2-135M (issue 26 part 6)", "",
             "`python benchmarks/kl_swap.py` from the `benchmarks/quant.py` rows (see its docstring); budget "
             "3.297 bits/weight (uniform 3g64, scales and zeros included), g64 asymmetric, 64 × 256 calibration "
             "tokens, fallback check on. Gap closed = (KL_3 − KL) / (KL_3 − KL_4) against the uniform 3g64 and "
             "4g64 rows of the same calibration seed; mean (min–max) over seeds.", ""]
    for split, rows in data["rows"].items():
        lines += [f"## {split}", "", "| row | seeds | KL | gap closed | written | sensitivity s | wall s |",
                  "|---|---:|---:|---:|---|---:|---:|"]
        for name, rs in rows.items():
            lines.append(f"| {name} | {','.join(str(r['seed']) for r in rs)} | {_fmt([r['kl'] for r in rs])} | "
                         f"{_fmt([r['closed'] for r in rs], pct=True)} | {', '.join(str(r['written']) for r in rs)} | "
                         f"{_fmt([r['sensitivity_s'] or 0 for r in rs])} | {_fmt([r['wall_s'] or 0 for r in rs])} |")
        lines.append("")
        for name, rs in rows.items():
            for r in rs:
                t = r.get("table")
                if not t:
                    continue
                fb = r.get("fallback") or {}
                lines += [f"- {name} seed {r['seed']}: plan {t['plan']}; on the {t['tokens']} swap tokens the 3g64 "
                          f"baseline has KL {t['base_kl_swapset']:.4f}, Σ Δ(4g64) over all units "
                          f"{t['sum_delta_4g64']:+.4f}, Σ Δ(3ch) {t['sum_delta_3ch']:+.4f}; the plan's additive "
                          f"prediction {t['predicted_delta_plan']:+.4f}; fallback set KL mixed "
                          f"{fb.get('kl_mixed', float('nan')):.4f} vs uniform {fb.get('kl_uniform', float('nan')):.4f}. "
                          f"Per Mbit: best promotions {', '.join(f'{x:+.4f}' for x in t['best_promotion_per_Mbit'])} "
                          f"(median {t['median_promotion_per_Mbit']:+.4f}); best demotions "
                          f"{', '.join(f'{x:+.4f}' for x in t['best_demotion_per_Mbit'])} (median "
                          f"{t['median_demotion_per_Mbit']:+.4f}); {t['promotions_lowering_kl']} promotions and "
                          f"{t['demotions_lowering_kl']} demotions measured below 0."]
        lines.append("")
    ex = data.get("exact_table")
    if ex:
        gap = ex["baseline_kl"] - ex["uniform_4g64_kl"]
        lines += ["## Why: the exact per-unit swap table (`benchmarks/sensitivity_exact.py`)", "",
                  f"Every one of {ex['units']} group units moved alone from uniform 3g64 (KL {ex['baseline_kl']:.4f} on "
                  f"{ex['tokens']} held-apart tokens; uniform 4g64 {ex['uniform_4g64_kl']:.4f}, gap {gap:.4f}). "
                  "The DP at uniform-3g64 bytes on that table, if the swaps added up:", "",
                  "| candidates | plan | predicted Σ Δ | predicted gap closed |", "|---|---|---:|---:|"]
        for r in ex["dp"]:
            lines.append(f"| {','.join(r['candidates'])} | {r['plan']} | {r['predicted_delta']:+.4f} | "
                         f"{100 * r['predicted_closed']:.1f}% |")
        lines += ["", "What the table's DP plans measured once quantized (KL on the Δ tokens / on fresh tokens; "
                  f"uniform 3g64 on fresh tokens {ex['fresh_uniform_kl']:.4f}):", ""]
        for k, v in ex["measured"].items():
            lines.append(f"- {k}: predicted {v['predicted_kl']:.4f}, measured {v['kl']:.4f}, fresh {v['fresh_kl']:.4f}")
        lines += ["", f"Exchange rate per Mbit: promoting 3g64 → 4g64 lowers KL by a median "
                  f"{-ex['promotion_per_Mbit_median']:.4f} (best {', '.join(f'{x:+.4f}' for x in ex['promotion_per_Mbit_best'])}); "
                  f"demoting 3g64 → 3ch raises it by a median {ex['demotion_per_Mbit_median']:.4f} per Mbit saved, "
                  f"and {ex['demotions_below_zero']} of {ex['units']} demotions measure *below* zero "
                  f"(best {', '.join(f'{x:+.4f}' for x in ex['demotion_per_Mbit_best'])}), which is the noise the DP "
                  "selects on.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "layercut-quant-bench"))
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks/results/kl_swap.json"))
    ap.add_argument("--md-out", default=str(ROOT / "docs/results/kl-swap.md"))
    args = ap.parse_args()
    data = collect(Path(args.work))
    Path(args.json_out).write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    Path(args.md_out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
