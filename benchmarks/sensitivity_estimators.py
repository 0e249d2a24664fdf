"""How well cheap sensitivity estimators rank units like the exact table, and how well the
exact table ranks like itself on other tokens (issue 12's acceptance figure).

Run (after ``benchmarks/sensitivity_exact.py`` and its re-measurement on other tokens)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/sensitivity_exact.py --eval-offset 90000 \\
        --candidates 4b_g64 --no-checks --json benchmarks/results/sensitivity_exact_retest.json \\
        --doc /tmp/retest.md                                     # ~20 CPU-min
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/sensitivity_estimators.py

The figure is Spearman's ρ *across units at one fixed trade* (base 3-bit g64 → candidate
c): the ranking the knapsack acts on. Across bit widths the figure would be high for any
estimator, because bits alone order the damage.

Estimators, all computable inside the streaming quantize driver at a block's turn (the
Hessian of the unit is at hand, the re-solve at c is cheap):

* ``dloss``: Δ of GPTQ's objective ½ tr(ΔW H ΔWᵀ) of the unit's linears, c minus base;
* ``drel``: ``dloss`` / ½ tr(W H Wᵀ) (HIGGS-style relative error, α = 1);
* ``dloss/R``: ``dloss`` divided by the median per-token energy ‖h‖² of the residual stream
  entering the unit's block (measured on the same evaluation windows, one fp forward):
  later blocks write into a larger stream, so the same absolute error moves the logits less.

``noise ceiling``: ρ between the exact Δ(u, 4b_g64) on the table's evaluation windows
(calibration text from token 70,000) and the same Δ re-measured on other windows (from token
90,000): no estimator can be expected to rank like the table better than the table ranks
like itself. Writes ``benchmarks/results/sensitivity_estimators.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from layercut.compress.quant.search.sensitivity import rank_correlation  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ESTIMATORS = ("dloss", "drel", "dloss/R")


@torch.no_grad()
def residual_energy(settings: dict) -> list[float]:
    """Median per-token ‖h_l‖² of the stream entering each block l (index L: after the last)."""
    import sensitivity_exact as se

    from layercut.compress.io.models import load_model

    model, tok = load_model(settings["model"])
    data = se.eval_set(tok, settings["calib"], settings["eval_windows"], settings["eval_seq_len"],
                       settings["eval_offset"])
    out = model(input_ids=data.input_ids, attention_mask=data.attention_mask, output_hidden_states=True)
    return [float(h.float().square().sum(-1).flatten().median()) for h in out.hidden_states]


def estimate(kind: str, entry: dict, base: dict, energy_in: float) -> float:
    dloss = entry["loss"] - base["loss"]
    if kind == "dloss":
        return dloss
    if kind == "drel":
        return dloss / base["energy"]
    return dloss / energy_in


def analyse(table: dict, retest: dict | None, R: list[float]) -> dict:
    base, blocks = table["baseline"]["units"], {u["name"]: u["block"] for u in table["units"]}
    out: dict = {"per_candidate": {}, "noise_ceiling": None}
    for c in table["settings"]["candidates"]:
        names = [n for n, e in table["entries"].items() if c in e]
        exact = [table["entries"][n][c]["delta"] for n in names]
        row = {"units": len(names)}
        for kind in ESTIMATORS:
            est = [estimate(kind, table["entries"][n][c], base[n], R[blocks[n]]) for n in names]
            row[kind] = rank_correlation(est, exact)
        by_kind = {}
        for k in sorted({n.rsplit(".", 1)[1] for n in names}):
            idx = [i for i, n in enumerate(names) if n.endswith("." + k)]
            if len(idx) > 3:
                est = [estimate("dloss/R", table["entries"][names[i]][c], base[names[i]], R[blocks[names[i]]])
                       for i in idx]
                by_kind[k] = rank_correlation(est, [exact[i] for i in idx])
        row["dloss/R within kind"] = by_kind
        out["per_candidate"][c] = row
    out["dp"] = dp_with_estimators(table, R)
    if retest is not None:
        common = [(c, n) for c in retest["settings"]["candidates"] for n, e in retest["entries"].items()
                  if c in e and c in table["entries"].get(n, {})]
        if len(common) > 2:
            a = [table["entries"][n][c]["delta"] for c, n in common]
            b = [retest["entries"][n][c]["delta"] for c, n in common]
            out["noise_ceiling"] = {"candidates": sorted({c for c, _ in common}), "units": len(common),
                                    "spearman": rank_correlation(a, b),
                                    "offsets": [table["settings"]["eval_offset"], retest["settings"]["eval_offset"]],
                                    "mean_delta": [sum(a) / len(a), sum(b) / len(b)]}
    return out


def dp_with_estimators(table: dict, R: list[float]) -> dict:
    """Solve the exact DP on each estimator's table (a common scale factor does not change the
    optimum, so no α is needed) and score the choice with the exact table's additive sum.
    The 4-bit g32 candidate is left out (the bundled weights come from a Q4_1 g32 GGUF)."""
    import sensitivity_exact as se

    units = table["units"]
    cands = [se.BASE] + [se.parse_key(k) for k in table["settings"]["candidates"] if k != "4b_g32"]
    exact = se.measured_table(table, units, cands)
    base = table["baseline"]["units"]
    blocks = {u["name"]: u["block"] for u in units}
    out = {}
    for label, budget in se.budgets(units).items():
        row = {}
        for kind in ("exact",) + ESTIMATORS:
            if kind == "exact":
                D = exact
            else:
                D = exact.copy()
                for i, u in enumerate(units):
                    for k, c in enumerate(cands):
                        e = table["entries"].get(u["name"], {}).get(se.ckey(c))
                        if c != se.BASE and e is not None:
                            D[i, k] = estimate(kind, e, base[u["name"]], R[blocks[u["name"]]])
            sol = se.solve_budget(units, cands, D, budget)
            if not sol["feasible"]:
                row[kind] = None
                continue
            picks = [cands.index(se.parse_key(sol["choice"][u["name"]])) if u["name"] in sol["choice"] else 0
                     for u in units]
            row[kind] = {"avg_bits": sol["avg_bits"],
                         "exact_additive_kl": table["baseline"]["kl"] + float(sum(exact[i, k] for i, k in enumerate(picks))),
                         "histogram": sol["histogram"]}
        out[label] = {"budget": budget, **row}
    return out


def render(r: dict) -> str:
    lines = ["Spearman ρ vs the exact Δ(u, c), across units at one trade (3-bit g64 → c):", "",
             "| candidate c | units | " + " | ".join(ESTIMATORS) + " | dloss/R within kind |",
             "|---|---:|" + "---:|" * len(ESTIMATORS) + "---|"]
    for c, row in r["per_candidate"].items():
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in row["dloss/R within kind"].items())
        lines.append(f"| {c} | {row['units']} | " + " | ".join(f"{row[k]:.2f}" for k in ESTIMATORS) + f" | {kinds} |")
    lines += ["", "The DP solved on each estimator's table, the choice scored by the exact table's additive sum "
                  "(uniform 3-bit g64 baseline KL + Σ exact Δ; the exact table's own additive sums are optimistic: "
                  "see docs/results/mixed.md), without 4-bit g32:", "",
              "| budget (bits/weight) | " + " | ".join(("exact",) + ESTIMATORS) + " |",
              "|---|" + "---:|" * (1 + len(ESTIMATORS))]
    for label, row in r.get("dp", {}).items():
        cells = [f"{row[k]['exact_additive_kl']:.3f}" if row.get(k) else "–" for k in ("exact",) + ESTIMATORS]
        lines.append(f"| {label} ({row['budget']:.3f}) | " + " | ".join(cells) + " |")
    nc = r.get("noise_ceiling")
    if nc:
        lines += ["", f"Noise ceiling: the exact Δ re-measured on other tokens (offsets {nc['offsets'][0]:,} vs "
                      f"{nc['offsets'][1]:,}), {', '.join(nc['candidates'])}, {nc['units']} units: ρ = "
                      f"{nc['spearman']:.2f}."]
    else:
        lines += ["", "Noise ceiling: not measured (no re-measurement JSON)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", default=str(RESULTS / "sensitivity_exact.json"))
    ap.add_argument("--retest", default=str(RESULTS / "sensitivity_exact_retest.json"))
    ap.add_argument("--json-out", default=str(RESULTS / "sensitivity_estimators.json"))
    ap.add_argument("--from-json", help="only print the table of a stored result")
    a = ap.parse_args()
    if a.from_json:
        print(render(json.loads(Path(a.from_json).read_text())))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    table = json.loads(Path(a.table).read_text())
    retest = json.loads(Path(a.retest).read_text()) if Path(a.retest).exists() else None
    R = residual_energy(table["settings"])
    r = analyse(table, retest, R)
    r.update(residual_energy_median=R, table=a.table, retest=a.retest if retest else None,
             command="OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/sensitivity_estimators.py "
                     + " ".join(sys.argv[1:]))
    from _results import write_merged  # benchmarks/_results.py (this script's folder is on sys.path)

    write_merged(a.json_out, r)
    print(render(r))


if __name__ == "__main__":
    main()
