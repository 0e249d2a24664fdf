"""Exact per-unit sensitivity table Δ(u, c) at the uniform 3-bit g64 operating point (issue 12).

Run (CPU, hours; resumes from the JSON, so the same command continues an interrupted run)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 nohup nice -n 19 .venv/bin/python benchmarks/sensitivity_exact.py \\
        > /tmp/sens_exact.log 2>&1 &
    .venv/bin/python benchmarks/sensitivity_exact.py --report     # tables + DP from the JSON only
    .venv/bin/python benchmarks/sensitivity_exact.py --smoke      # 2 units × 2 candidates, tiny token counts

What it measures, on SmolLM2-135M in fp32 with one torch thread:

* **Baseline**: every linear at 3-bit g64 asymmetric with ``layercut quantize``'s defaults
  (GPTQ, act-order with static groups, damp 0.01, one Hessian pass per block), sequentially:
  each block's Hessians come from the outputs of the already-quantized previous blocks
  (calibration: ``bundled:brown-calib``, ``calibration_batch(seed=0)``, 64 × 256 tokens).
  The Hessian of each unit is kept (float32, ~13 MB per block) and the baseline itself is
  solved from that stored copy, so baseline and candidates see the same matrix.
* **Units**: qkv, o, gate_up, down per block (fused projections share one config and one
  Hessian): 120 units. **Candidates** (bits, group size): 2/g64, 2/g32, 3/ch, 3/g128, 3/g32,
  4/ch, 4/g128, 4/g64, 4/g32, 8/ch (ch = one group per row), each only where the group size
  divides the unit's in_features (g128 fits down_proj only on SmolLM2). Cost per weight
  counts the fp16 scale and the packed ``bits``-bit zero of every (group, row):
  b + (16 + b)/gs, or b + (16 + b)·rows/n per channel (``layercut.compress.quant.search.allocate.unit_cost``).
* **Δ(u, c)** = KL(fp ‖ baseline with only unit u re-solved by GPTQ at c on its stored
  Hessian) − KL(fp ‖ baseline), mean over evaluation tokens held apart from calibration:
  8 consecutive windows of 256 tokens of ``bundled:brown-calib`` starting at token 70,000 of
  its EOS-joined stream (the calibration windows all lie in the first 66,816 tokens). Never
  brown-heldout, which is for reported numbers. The baseline's stream entering every block
  is cached once, so Δ(u, c) reruns only blocks b(u)..L-1 and the head.
* Every entry also stores the unit's GPTQ objective ½ tr(ΔW H ΔWᵀ) and its value relative to
  ½ tr(W H Wᵀ), so cheap estimators can be ranked against the exact Δ from the JSON alone.

Entries are measured candidate by candidate (the order of ``CANDIDATES``), the JSON is
rewritten atomically after each one. When the table is complete, the exact DP
(``layercut.compress.quant.search.allocate``) is solved at the bytes of uniform 3-bit g64, 3.5 and 2.5
bits/weight, with and without 4-bit g32 (the bundled weights come from a Q4_1 g32 GGUF), and
the chosen allocations are quantized and measured ("checks": additivity with the same
Hessians, and a full sequential re-quantization). Writes ``benchmarks/results/
sensitivity_exact.json`` and ``docs/results/mixed.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from layercut.calibrate.capture import BlockRun, capture_inputs, first_tensor, run_blocks  # noqa: E402
from layercut.calibrate.data import CalibSet, load_texts, token_stream  # noqa: E402
from layercut.compress.core.arch import arch_for, get_submodule  # noqa: E402
from layercut.compress.core.errors import LayercutError  # noqa: E402
from layercut.compress.quant.config import QuantizeConfig  # noqa: E402
from layercut.compress.quant.plan import solver_settings  # noqa: E402
from layercut.compress.quant.search.allocate import _solve_dp, unit_cost  # noqa: E402
from layercut.compress.quant.search.sensitivity import AllocUnit, allocation_units, rank_correlation  # noqa: E402
from layercut.compress.quant.solve.driver import HessianSet, check_model, linear_weight, set_weight  # noqa: E402
from layercut.compress.quant.solve.linear import output_loss, solve_group  # noqa: E402
from layercut.compress.quant.solve.settings import SolverConfig  # noqa: E402

JSON_PATH = ROOT / "benchmarks" / "results" / "sensitivity_exact.json"
DOC_PATH = ROOT / "docs" / "results" / "mixed.md"
MODEL = "bundled:smollm2-135m"
BASE = (3, 64)
# measurement order: the candidates the 3-bit-budget trades need most come first
CANDIDATES = [(4, 64), (2, 64), (3, -1), (3, 128), (4, 128), (3, 32), (4, -1), (2, 32), (8, -1), (4, 32)]
FLATTERING = (4, 32)  # the bundled model's Q4_1 g32 source lands almost on this grid
DP_CELLS = 4_000_000


def ckey(c: tuple[int, int]) -> str:
    """'3b_g64' / '3b_ch' (per channel)."""
    return f"{c[0]}b_{'ch' if c[1] == -1 else f'g{c[1]}'}"


def parse_key(k: str) -> tuple[int, int]:
    b, g = k.split("b_")
    return int(b), (-1 if g == "ch" else int(g[1:]))


# --------------------------------------------------------------------------- units & costs


@dataclass(frozen=True)
class UnitInfo:
    name: str
    block: int
    group: int  # index into ArchSpec.groups
    linears: tuple[str, ...]
    n_weights: int
    n_rows: int
    in_features: int

    def fits(self, c: tuple[int, int]) -> bool:
        return c[1] == -1 or self.in_features % c[1] == 0

    def cost(self, c: tuple[int, int]) -> int:
        """Stored bits: n·b + (groups·rows)·(16 + b) — fp16 scales and packed zeros."""
        return unit_cost(self.n_weights, c[0], c[1], self.n_rows if c[1] == -1 else None)


def units_of(model: nn.Module) -> list[UnitInfo]:
    spec = arch_for(model)
    out = []
    for u in allocation_units(model, "group"):
        au: AllocUnit = u
        w = linear_weight(model.get_submodule(au.linears[0]), spec.conv1d)
        out.append(UnitInfo(au.name, au.block, au.groups[0], au.linears, au.n_weights, au.n_rows, int(w.shape[1])))
    return out


# ------------------------------------------------------------------------------ quantizing


def unit_config(cfg: SolverConfig, c: tuple[int, int]) -> SolverConfig:
    return replace(cfg, bits=c[0], group_size=c[1])


@torch.no_grad()
def quantize_sequential(
    model: nn.Module,
    fp_weights: dict[str, Tensor],
    calib: CalibSet,
    cfg: SolverConfig,
    units: list[UnitInfo],
    choice: dict[str, tuple[int, int]] | None = None,
    hessian_dtype: torch.dtype = torch.float32,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, Tensor]:
    """Quantize ``model`` in place block by block, as ``quantize_model(sequential="block")``
    does, with unit u at ``choice[u]`` (default: cfg's bits/group size). Solves from the
    Hessian rounded to ``hessian_dtype`` and returns those Hessians {unit name: [in, in]}.
    ``fp_weights``: {linear name: W [out, in]} of the dense model (the model's linears are
    overwritten, so they must come from outside).
    """
    spec = arch_for(model)
    check_model(model, cfg)
    by_block: dict[int, list[UnitInfo]] = {}
    for u in units:
        by_block.setdefault(u.block, []).append(u)
    hessians: dict[str, Tensor] = {}

    def on_block(run: BlockRun) -> None:
        for u in by_block.get(run.index, []):  # restore the dense block before its Hessian pass
            for n in u.linears:
                set_weight(model.get_submodule(n), fp_weights[n], spec.conv1d)
        run.invalidate()
        hs = HessianSet(run, tuple(range(len(spec.groups))))
        hs.collect()
        for u in by_block.get(run.index, []):
            H = hs.get(u.group, u.name).to(hessian_dtype)
            hessians[u.name] = H
            c = (choice or {}).get(u.name, (cfg.bits, cfg.group_size))
            parts = solve_group([fp_weights[n] for n in u.linears], H, c[0], unit_config(cfg, c))
            for n, res in zip(u.linears, parts):
                set_weight(model.get_submodule(n), res.dequant, spec.conv1d)
        run.invalidate()  # the next block sees this block's quantized outputs

    run_blocks(model, calib, [on_block], batch_size=batch_size, progress=progress, desc="sequential gptq")
    return hessians


def solve_unit(u: UnitInfo, fp_weights: dict[str, Tensor], H: Tensor, cfg: SolverConfig,
               c: tuple[int, int]) -> tuple[list[Tensor], float]:
    """Dequantized weights of u's linears at candidate c, and Σ ½ tr(ΔW H ΔWᵀ) (undamped)."""
    parts = solve_group([fp_weights[n] for n in u.linears], H, c[0], unit_config(cfg, c))
    return [p.dequant for p in parts], float(sum(p.loss for p in parts))


def energy(u: UnitInfo, fp_weights: dict[str, Tensor], H: Tensor) -> float:
    """½ tr(W H Wᵀ) over u's linears: the scale the relative GPTQ error divides by."""
    return float(sum(output_loss(fp_weights[n], torch.zeros_like(fp_weights[n]), H) for n in u.linears))


# ------------------------------------------------------------------------------ evaluation


def eval_set(tokenizer, source: str, windows: int, seq_len: int, offset: int) -> CalibSet:
    """``windows`` consecutive windows of ``seq_len`` tokens from token ``offset`` of the
    EOS-joined stream of ``source`` (the stream ``calibration_batch`` draws from)."""
    need = offset + windows * seq_len
    stream = token_stream(tokenizer, load_texts(source), max_tokens=need)
    if stream.numel() < need:
        raise LayercutError(f"{source} has {stream.numel()} tokens, fewer than offset + eval tokens = {need}")
    ids = stream[offset:need].reshape(windows, seq_len).clone()
    return CalibSet(ids, torch.ones_like(ids))


class KLProbe:
    """KL(fp ‖ model) on fixed evaluation tokens, rerunning only blocks from a given index.

    ``inputs[b][i]``: the stream entering block b for micro-batch i [B, L, D] in the model
    the probe was last ``anchor``-ed on (the baseline); the fp distribution is stored as
    probabilities [B, L, V] and Σ p log p [B, L] per micro-batch.
    """

    @torch.no_grad()
    def __init__(self, model: nn.Module, data: CalibSet, batch_size: int):
        if getattr(model.config, "final_logit_softcapping", None):
            raise LayercutError("sensitivity_exact: models with final logit softcapping are not supported")
        self.model, self.data, self.bs = model, data, batch_size
        self.spec = arch_for(model)
        self.layers = self.spec.layers_of(model)
        self.norm = get_submodule(self.spec.base_of(model), self.spec.final_norm)
        self.head = model.get_output_embeddings()
        first, self.call_args = capture_inputs(model, data, batch_size, self.spec)
        self.inputs: list[list[Tensor]] = [first] + [[] for _ in range(len(self.layers) - 1)]
        self.targets = [ids[:, 1:] for ids, _ in data.split(batch_size)]
        self.probs: list[Tensor] = []
        self.negent: list[Tensor] = []
        for h in self._stream(0, cache=False):  # the (still dense) model: reference distribution
            lp = F.log_softmax(self.head(self.norm(h)).float(), -1)  # [B, L, V]
            p = lp.exp()
            self.probs.append(p)
            self.negent.append((p * lp).sum(-1))

    def _stream(self, start: int, cache: bool):
        """Yield the last block's output per micro-batch, running blocks start..L-1."""
        for i, h in enumerate(self.inputs[start]):
            for b in range(start, len(self.layers)):
                if cache and b > start:
                    self.inputs[b].append(h)
                args, kwargs = self.call_args[b][i]
                h = first_tensor(self.layers[b](h, *args, **kwargs))
            yield h

    @torch.no_grad()
    def anchor(self) -> dict:
        """Cache the current model's stream at every block input; return its KL/NLL."""
        for b in range(1, len(self.layers)):
            self.inputs[b] = []
        return self._score(self._stream(0, cache=True))

    @torch.no_grad()
    def kl_from(self, start: int) -> dict:
        """KL / NLL of the current model, reusing the anchored stream before block ``start``."""
        return self._score(self._stream(start, cache=False))

    def _score(self, outs) -> dict:
        kl_sum, nll_sum, n_kl, n_nll = 0.0, 0.0, 0, 0
        for i, h in enumerate(outs):
            lq = F.log_softmax(self.head(self.norm(h)).float(), -1)  # [B, L, V]
            kl = self.negent[i] - (self.probs[i] * lq).sum(-1)  # [B, L]
            kl_sum += float(kl.double().sum())
            n_kl += kl.numel()
            nll = -lq[:, :-1].gather(-1, self.targets[i].unsqueeze(-1)).squeeze(-1)
            nll_sum += float(nll.double().sum())
            n_nll += nll.numel()
        return {"kl": kl_sum / n_kl, "nll": nll_sum / n_nll, "ppl": math.exp(nll_sum / n_nll)}


# -------------------------------------------------------------------------------- analysis


def measured_table(state: dict, units: list[dict], cands: list[tuple[int, int]]) -> np.ndarray:
    """Δ [U, K] with +inf where not measured / not applicable; the baseline column is 0."""
    D = np.full((len(units), len(cands)), np.inf)
    for i, u in enumerate(units):
        row = state["entries"].get(u["name"], {})
        for k, c in enumerate(cands):
            if c == BASE:
                D[i, k] = 0.0
            elif ckey(c) in row:
                D[i, k] = row[ckey(c)]["delta"]
    return D


def solve_budget(units: list[dict], cands: list[tuple[int, int]], D: np.ndarray, avg_bits: float) -> dict:
    """Exact multiple-choice knapsack (layercut.compress.quant.search.allocate's DP) over the finite entries."""
    costs = [[_cost(u, c) for c in cands] for u in units]
    n_total = sum(u["n_weights"] for u in units)
    budget = math.floor(avg_bits * n_total * (1 + 1e-12))
    big = max(max(r) for r in costs)
    # unavailable entries keep their Δ = inf, so the DP never picks them; cheapest *available* floor:
    floor = sum(min(c for c, d in zip(r, dr) if np.isfinite(d)) for r, dr in zip(costs, D))
    if budget < floor:
        return {"feasible": False}
    base = [min(r) for r in costs]
    extra = [[c - b for c in r] for r, b in zip(costs, base)]
    spare = budget - sum(base)
    picks, method = _solve_dp(D, extra, min(spare, big * len(units)), DP_CELLS)
    total = sum(costs[i][k] for i, k in enumerate(picks))
    hist: dict[str, int] = {}
    for k in picks:
        hist[ckey(cands[k])] = hist.get(ckey(cands[k]), 0) + 1
    return {"feasible": True, "avg_bits": total / n_total, "sum_delta": float(sum(D[i, k] for i, k in enumerate(picks))),
            "method": method, "histogram": dict(sorted(hist.items())),
            "choice": {u["name"]: ckey(cands[k]) for u, k in zip(units, picks) if cands[k] != BASE}}


def _cost(u: dict, c: tuple[int, int]) -> int:
    return unit_cost(u["n_weights"], c[0], c[1], u["n_rows"] if c[1] == -1 else None)


def uniform_bits(units: list[dict], c: tuple[int, int]) -> float | None:
    if any(c[1] != -1 and u["in_features"] % c[1] for u in units):
        return None
    return sum(_cost(u, c) for u in units) / sum(u["n_weights"] for u in units)


def budgets(units: list[dict]) -> dict[str, float]:
    return {"3-bit g64 bytes": uniform_bits(units, BASE), "3.5 bpw": 3.5, "2.5 bpw": 2.5}


def analyse(state: dict) -> dict:
    """Summaries, rank correlations and DP solves from the table (partial tables too)."""
    units = state["units"]
    cands = [BASE] + [parse_key(k) for k in state["settings"]["candidates"]]
    D = measured_table(state, units, cands)
    out: dict = {"baseline": {k: state["baseline"][k] for k in ("kl", "nll", "ppl")}}
    kinds = sorted({u["name"].rsplit(".", 1)[1] for u in units})
    per_cand = {}
    for k, c in enumerate(cands[1:], start=1):
        rows = [(i, u) for i, u in enumerate(units) if np.isfinite(D[i, k])]
        if not rows:
            continue
        d = np.array([D[i, k] for i, _ in rows])
        ent = [state["entries"][u["name"]][ckey(c)] for _, u in rows]
        base = [state["baseline"]["units"][u["name"]] for _, u in rows]
        dloss = [e["loss"] - b["loss"] for e, b in zip(ent, base)]
        drel = [(e["loss"] - b["loss"]) / b["energy"] for e, b in zip(ent, base)]
        rec = {"n": len(rows), "mean": float(d.mean()), "min": float(d.min()), "max": float(d.max()),
               "sum": float(d.sum()), "bpw": {u["name"].rsplit(".", 1)[1]: _cost(u, c) / u["n_weights"]
                                                for _, u in rows},
               "mean_by_kind": {kd: float(np.mean([D[i, k] for i, u in rows if u["name"].endswith("." + kd)]))
                                for kd in kinds if any(u["name"].endswith("." + kd) for _, u in rows)}}
        if len(rows) >= 3:
            rec["spearman_vs_dloss"] = rank_correlation(d.tolist(), dloss)
            rec["spearman_vs_drel"] = rank_correlation(d.tolist(), drel)
        per_cand[ckey(c)] = rec
    out["candidates"] = per_cand
    # do units rank alike across candidates? (Δ(·, c1) vs Δ(·, c2) over units measured at both)
    pairs = {}
    for a in range(1, len(cands)):
        for b in range(a + 1, len(cands)):
            m = np.isfinite(D[:, a]) & np.isfinite(D[:, b])
            if m.sum() >= 5:
                pairs[f"{ckey(cands[a])}~{ckey(cands[b])}"] = rank_correlation(D[m, a].tolist(), D[m, b].tolist())
    out["spearman_between_candidates"] = pairs
    solves = {}
    for label, avg in budgets(units).items():
        for variant, keep in (("all", cands), ("no 4b_g32", [c for c in cands if c != FLATTERING])):
            idx = [cands.index(c) for c in keep]
            r = solve_budget(units, keep, D[:, idx], avg)
            r["budget_avg_bits"] = avg
            if r["feasible"]:
                r["predicted_kl"] = state["baseline"]["kl"] + r["sum_delta"]
            solves[f"{label} | {variant}"] = r
    out["dp"] = solves
    out["uniform_bpw"] = {ckey(c): uniform_bits(units, c) for c in cands}
    # uniform configs whose bytes fit each budget: measured KL (baseline, or a sequential check)
    # and the additive prediction baseline + Σ_u Δ(u, c) once c's column is complete
    fits = {}
    for label, avg in budgets(units).items():
        rows = []
        for k, c in enumerate(cands):
            bpw = out["uniform_bpw"][ckey(c)]
            if bpw is None or bpw > avg * (1 + 1e-12):
                continue
            check = state.get("checks", {}).get(f"uniform {ckey(c)}: sequential")
            measured = state["baseline"]["kl"] if c == BASE else (check["kl"] if check else None)
            additive = state["baseline"]["kl"] + float(D[:, k].sum()) if np.isfinite(D[:, k]).all() else None
            rows.append({"candidate": ckey(c), "bpw": bpw, "measured_kl": measured, "additive_kl": additive})
        fits[label] = rows
    out["uniform_fitting"] = fits
    done = int(np.isfinite(D[:, 1:]).sum())
    todo = sum(1 for u in units for c in cands[1:] if c[1] == -1 or u["in_features"] % c[1] == 0)
    out["progress"] = {"measured": done, "total": todo}
    return out


def render(state: dict, an: dict) -> str:
    """Markdown report of the table and the DP solves."""
    s = state["settings"]
    L = ["# Mixed precision on SmolLM2-135M: the exact per-unit sensitivity table (issue 12)", "",
         "`OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sensitivity_exact.py` "
         "(`--report` re-renders this from `benchmarks/results/sensitivity_exact.json`).", "",
         f"Baseline: uniform {ckey(BASE)} asymmetric GPTQ (act-order + static groups, damp {s['damp']}), "
         f"sequential, calibration {s['calib']} {s['calib_samples']}×{s['calib_seq_len']} seed {s['seed']}. "
         f"Δ(u, c) = change of KL(fp ‖ model) when only unit u is re-solved at c on its stored Hessian, "
         f"on {s['eval_windows']}×{s['eval_seq_len']} tokens of {s['calib']} from token {s['eval_offset']} "
         f"(disjoint from the calibration windows).", "",
         f"Progress: {an['progress']['measured']} / {an['progress']['total']} entries. "
         f"Baseline KL {an['baseline']['kl']:.5f}, eval ppl {an['baseline']['ppl']:.3f}.", "",
         "## Δ per candidate (over measured units)", "",
         "| candidate | bpw (qkv/o/gate_up · down) | units | mean Δ | min Δ | max Δ | Σ Δ | ρ(Δ, Δloss) | ρ(Δ, Δrel) "
         "| mean Δ qkv / o / gate_up / down |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for k, r in an["candidates"].items():
        bpw = r["bpw"]
        bp = f"{bpw.get('qkv', float('nan')):.3f} · {bpw.get('down', float('nan')):.3f}"
        mk = " / ".join(f"{r['mean_by_kind'].get(kd, float('nan')):+.4f}" for kd in ("qkv", "o", "gate_up", "down"))
        L.append(f"| {k} | {bp} | {r['n']} | {r['mean']:+.5f} | {r['min']:+.5f} | {r['max']:+.5f} | {r['sum']:+.4f} "
                 f"| {r.get('spearman_vs_dloss', float('nan')):.3f} | {r.get('spearman_vs_drel', float('nan')):.3f} "
                 f"| {mk} |")
    L += ["", "ρ: Spearman across units at that candidate; Δloss = change of ½ tr(ΔW H ΔWᵀ), Δrel = Δloss / "
          "½ tr(W H Wᵀ) (HIGGS-style relative error without αᵤ).", "",
          "## Exact DP on the table (predicted KL = baseline KL + Σ Δ)", "",
          "| budget | candidates | achieved bpw | Σ Δ | predicted KL | solver | choices (non-baseline) |",
          "|---|---|---:|---:|---:|---|---|"]
    for name, r in an["dp"].items():
        label, variant = name.split(" | ")
        if not r["feasible"]:
            L.append(f"| {label} ({r['budget_avg_bits']:.4f}) | {variant} | – | – | – | infeasible | |")
            continue
        hist = ", ".join(f"{k}×{v}" for k, v in r["histogram"].items())
        L.append(f"| {label} ({r['budget_avg_bits']:.4f}) | {variant} | {r['avg_bits']:.4f} | {r['sum_delta']:+.5f} "
                 f"| {r['predicted_kl']:.5f} | {r['method']} | {hist} |")
    L += ["", "Δ is measured at the uniform 3-bit g64 operating point: at 2.5 bpw most units move to 2 bits, "
          "far from it, so the additive prediction there is the least trustworthy (see the checks).", "",
          "Uniform configs (bpw): " + ", ".join(f"{k} {v:.4f}" for k, v in an["uniform_bpw"].items() if v), "",
          "Uniform configs whose bytes fit each budget (KL measured / additive baseline + Σ Δ):", ""]
    for label, rows in an["uniform_fitting"].items():
        def fmt(x: float | None) -> str:
            return "–" if x is None else f"{x:.5f}"
        L.append(f"- {label}: " + ", ".join(f"{r['candidate']} ({r['bpw']:.3f} bpw) {fmt(r['measured_kl'])} / "
                                            f"{fmt(r['additive_kl'])}" for r in rows))
    L.append("")
    checks = state.get("checks", {})
    if checks:
        fr = state.get("fresh", {})
        L += ["## Checks (quantized and measured)", "",
              f"\"fresh\": {s['eval_windows']}×{s['eval_seq_len']} tokens from token {fr.get('offset')} of "
              f"{s['calib']}, used by no Δ and no DP choice; the uniform 3b_g64 baseline scores KL "
              f"{fr.get('kl', float('nan')):.5f} there (vs {state['baseline']['kl']:.5f} on the Δ tokens).", "",
              "| check | bpw | predicted KL | measured KL | eval ppl | fresh KL | fresh ppl |",
              "|---|---:|---:|---:|---:|---:|---:|"]
        for name, c in checks.items():
            pred = f"{c['predicted_kl']:.5f}" if c.get("predicted_kl") is not None else "–"
            L.append(f"| {name.replace(' | ', ' · ')} | {c.get('avg_bits', float('nan')):.4f} | {pred} | {c['kl']:.5f} | {c['ppl']:.3f} "
                     f"| {c.get('fresh_kl', float('nan')):.5f} | {c.get('fresh_ppl', float('nan')):.3f} |")
        L.append("")
    if an["spearman_between_candidates"]:
        L += ["## Do the same units matter at every candidate? (Spearman of Δ across units)", ""]
        L += [f"- {k}: {v:.3f}" for k, v in an["spearman_between_candidates"].items()]
        L.append("")
    return "\n".join(L)


# ------------------------------------------------------------------------------------ main


def atomic_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def load_state(path: Path, settings: dict) -> dict | None:
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    if state.get("settings") != settings:
        diff = {k for k in set(settings) | set(state.get("settings", {}))
                if settings.get(k) != state.get("settings", {}).get(k)}
        raise LayercutError(f"{path} was measured with other settings ({', '.join(sorted(diff))}); "
                            "pass --json elsewhere or the same options")
    return state


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--calib", default="bundled:brown-calib")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--eval-seq-len", type=int, default=256)
    p.add_argument("--eval-offset", type=int, default=70_000)
    p.add_argument("--candidates", default=",".join(ckey(c) for c in CANDIDATES))
    p.add_argument("--units", default="", help="comma-separated unit names (default: all)")
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", type=Path, default=JSON_PATH)
    p.add_argument("--doc", type=Path, default=DOC_PATH)
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("LAYERCUT_CACHE", "~/.cache/layercut")).expanduser()
                   / "sensitivity_exact", help="where the baseline's Hessians and weights are kept for resuming")
    p.add_argument("--report", action="store_true", help="only analyse the JSON")
    p.add_argument("--no-checks", action="store_true", help="skip quantizing the DP's allocations at the end")
    p.add_argument("--fresh-offset", type=int, default=90_000,
                   help="checks are also scored on windows from this token of --calib, never used for Δ or the DP")
    p.add_argument("--smoke", action="store_true", help="2 units × (8b_ch, 2b_g64), tiny token counts, /tmp output")
    a = p.parse_args(argv)
    if a.smoke:
        a.calib_samples, a.calib_seq_len, a.eval_windows, a.eval_seq_len = 8, 64, 2, 64
        a.candidates, a.units = "8b_ch,2b_g64", "model.layers.0.qkv,model.layers.29.down"
        a.json, a.doc = Path("/tmp/sens_exact_smoke.json"), Path("/tmp/sens_exact_smoke.md")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        cands = [parse_key(k) for k in a.candidates.split(",") if k]
    except ValueError:
        raise LayercutError(f"--candidates: expected keys like 4b_g64,3b_ch, got {a.candidates!r}") from None
    settings = {"model": a.model, "calib": a.calib, "calib_samples": a.calib_samples, "calib_seq_len": a.calib_seq_len,
                "seed": a.seed, "eval_windows": a.eval_windows, "eval_seq_len": a.eval_seq_len,
                "eval_offset": a.eval_offset, "candidates": [ckey(c) for c in cands], "units": a.units,
                "damp": a.damp, "base": ckey(BASE), "act_order": True, "static_groups": True, "sequential": "block"}
    if a.report:
        state = load_state(a.json, settings) if a.json.exists() else None
        if state is None:
            raise LayercutError(f"{a.json} does not exist")
        report(state, a.doc)
        return 0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run(a, cands, settings)
    return 0


def run(a: argparse.Namespace, cands: list[tuple[int, int]], settings: dict) -> None:
    from layercut.calibrate.data import calibration_batch
    from layercut.compress.io.models import load_model

    t0 = time.perf_counter()
    model, tok = load_model(a.model, dtype=torch.float32)
    spec = arch_for(model)
    all_units = units_of(model)
    wanted = [n for n in a.units.split(",") if n]
    unknown = sorted(set(wanted) - {u.name for u in all_units})
    if unknown:
        raise LayercutError(f"--units: unknown unit(s) {', '.join(unknown)}")
    units = [u for u in all_units if not wanted or u.name in wanted]
    cfg = solver_settings(QuantizeConfig(bits=BASE[0], group_size=BASE[1], sym=False, act_order=True,
                                         static_groups=True, damp=a.damp, sequential="block", scale_search="none",
                                         scale_bounds="joint"))
    calib = calibration_batch(tok, a.calib, samples=a.calib_samples, seq_len=a.calib_seq_len, seed=a.seed)
    data = eval_set(tok, a.calib, a.eval_windows, a.eval_seq_len, a.eval_offset)
    fp = {n: linear_weight(model.get_submodule(n), spec.conv1d).detach().clone() for u in all_units for n in u.linears}
    probe = KLProbe(model, data, batch_size=2)
    print(f"loaded, fp reference on {data.input_ids.numel()} eval tokens: {time.perf_counter() - t0:.0f}s", flush=True)

    key = hashlib.sha256(json.dumps({k: settings[k] for k in ("model", "calib", "calib_samples", "calib_seq_len",
                                                                "seed", "damp")}).encode()).hexdigest()[:16]
    cache = a.cache / f"{key}.pt"
    if cache.exists():
        saved = torch.load(cache, weights_only=True)
        H, base_w = saved["H"], saved["W"]
        for n, w in base_w.items():
            set_weight(model.get_submodule(n), w, spec.conv1d)
        print(f"baseline from cache {cache}", flush=True)
    else:
        t = time.perf_counter()
        H = quantize_sequential(model, fp, calib, cfg, all_units, progress=False)
        base_w = {n: linear_weight(model.get_submodule(n), spec.conv1d).detach().clone() for n in fp}
        if not a.smoke:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"H": H, "W": base_w}, cache.with_suffix(".tmp"))
            os.replace(cache.with_suffix(".tmp"), cache)
        print(f"baseline quantized sequentially: {time.perf_counter() - t:.0f}s", flush=True)
    base = probe.anchor()
    state = load_state(a.json, settings)
    if state is not None:
        drift = base["kl"] - state["baseline"]["kl"]
        if abs(drift) > 1e-4 * state["baseline"]["kl"]:
            raise LayercutError(f"baseline KL {base['kl']:.6f} differs from the JSON's {state['baseline']['kl']:.6f}: "
                                "a different machine or library; start a new --json")
        print(f"resuming {a.json}: baseline KL drift {drift:+.2e}", flush=True)
    else:
        info = {u.name: {"loss": solve_unit(u, fp, H[u.name], cfg, BASE)[1], "energy": energy(u, fp, H[u.name])}
                for u in units}
        state = {"settings": settings, "baseline": {**base, "units": info},
                 "units": [{"name": u.name, "block": u.block, "n_weights": u.n_weights, "n_rows": u.n_rows,
                            "in_features": u.in_features} for u in units],
                 "entries": {}, "checks": {}}
        atomic_json(a.json, state)
    print(f"baseline KL {base['kl']:.5f} eval ppl {base['ppl']:.3f}", flush=True)

    # ---- the table, candidate by candidate
    todo = [(c, u) for c in cands for u in units if u.fits(c) and ckey(c) not in state["entries"].get(u.name, {})]
    print(f"{len(todo)} entries to measure", flush=True)
    spent, done = 0.0, 0
    for c, u in todo:
        t = time.perf_counter()
        deq, loss = solve_unit(u, fp, H[u.name], cfg, c)
        t_solve = time.perf_counter() - t
        for n, w in zip(u.linears, deq):
            set_weight(model.get_submodule(n), w, spec.conv1d)
        r = probe.kl_from(u.block)
        for n in u.linears:
            set_weight(model.get_submodule(n), base_w[n], spec.conv1d)
        sec = time.perf_counter() - t
        state["entries"].setdefault(u.name, {})[ckey(c)] = {
            "delta": r["kl"] - base["kl"], "kl": r["kl"], "nll": r["nll"], "loss": loss,
            "rel": loss / state["baseline"]["units"][u.name]["energy"], "seconds": sec, "solve_seconds": t_solve}
        atomic_json(a.json, state)
        spent, done = spent + sec, done + 1
        print(f"[{done}/{len(todo)}] {u.name} {ckey(c)}: Δ={r['kl'] - base['kl']:+.6f} (kl {r['kl']:.5f}) "
              f"{sec:.1f}s (solve {t_solve:.1f}s), eta {(len(todo) - done) * spent / done / 3600:.2f}h", flush=True)

    if not a.no_checks:
        fresh = fresh_probe(a, tok, model, fp, base_w, state)
        run_checks(a, state, model, fp, H, base_w, calib, cfg, units, all_units, probe, fresh)
    report(state, a.doc, a.json)


def fresh_probe(a, tok, model, fp, base_w, state) -> KLProbe:
    """A second KLProbe on tokens no Δ and no DP choice has seen: the DP picks the most negative
    entries of a table measured on one token set, so its gain there is biased; this one is not."""
    spec = arch_for(model)
    data = eval_set(tok, a.calib, a.eval_windows, a.eval_seq_len, a.fresh_offset)
    for n, w in fp.items():
        set_weight(model.get_submodule(n), w, spec.conv1d)
    probe = KLProbe(model, data, batch_size=2)  # reference distribution from the dense weights
    for n, w in base_w.items():
        set_weight(model.get_submodule(n), w, spec.conv1d)
    state["fresh"] = {"offset": a.fresh_offset, **probe.anchor()}
    print(f"fresh tokens from {a.fresh_offset}: baseline KL {state['fresh']['kl']:.5f}", flush=True)
    return probe


def run_checks(a, state, model, fp, H, base_w, calib, cfg, units, all_units, probe, fresh) -> None:
    """Quantize the DP's picks: swapped in on the baseline (same Hessians: additivity) and
    re-quantized sequentially (what a mixed ``layercut quantize`` would do); plus uniform refs.
    Each is scored on the Δ tokens and on ``fresh`` tokens."""
    spec = arch_for(model)
    an = analyse(state)
    plans: list[tuple[str, dict[str, tuple[int, int]], str, float | None]] = []
    for name, r in an["dp"].items():
        if not r["feasible"] or not ("3-bit" in name or "no 4b_g32" in name):
            continue
        choice = {u: parse_key(k) for u, k in r["choice"].items()}
        plans.append((f"DP {name}: swap", choice, "swap", r["predicted_kl"]))
        plans.append((f"DP {name}: sequential", choice, "sequential", r["predicted_kl"]))
    for c in ((2, 64), (4, 64)):
        if all(u.fits(c) for u in units):
            plans.append((f"uniform {ckey(c)}: sequential", {u.name: c for u in units}, "sequential", None))
    by_name = {u.name: u for u in units}
    done: dict[tuple, dict] = {}  # the same allocation under two labels is measured once
    for label, choice, how, pred in plans:
        key = (how, tuple(sorted(choice.items())))
        if label in state["checks"] and "fresh_kl" in state["checks"][label]:
            done[key] = state["checks"][label]
            continue
        if key in done:
            state["checks"][label] = {**done[key], "predicted_kl": pred}
            atomic_json(a.json, state)
            continue
        t = time.perf_counter()
        if how == "swap":
            for un, c in choice.items():
                for n, w in zip(by_name[un].linears, solve_unit(by_name[un], fp, H[un], cfg, c)[0]):
                    set_weight(model.get_submodule(n), w, spec.conv1d)
        else:
            quantize_sequential(model, fp, calib, cfg, all_units, choice)
        r = probe.kl_from(0)
        rf = fresh.kl_from(0)
        for n, w in base_w.items():
            set_weight(model.get_submodule(n), w, spec.conv1d)
        cost = sum(by_name[u.name].cost(choice.get(u.name, BASE)) for u in units)
        state["checks"][label] = {**r, "predicted_kl": pred, "avg_bits": cost / sum(u.n_weights for u in units),
                                  "fresh_kl": rf["kl"], "fresh_ppl": rf["ppl"], "seconds": time.perf_counter() - t}
        done[key] = state["checks"][label]
        atomic_json(a.json, state)
        print(f"check {label}: kl {r['kl']:.5f} (predicted {pred}) ppl {r['ppl']:.3f}, "
              f"fresh kl {rf['kl']:.5f}", flush=True)


def report(state: dict, doc: Path, json_path: Path | None = None) -> None:
    """Print the tables, write ``doc``; with ``json_path`` also store the analysis in the JSON
    (only the measuring process writes the JSON: ``--report`` must not race it)."""
    an = analyse(state)
    text = render(state, an)
    print(text)
    if json_path is not None:
        state["analysis"] = an
        atomic_json(json_path, state)
    if doc:
        doc.parent.mkdir(parents=True, exist_ok=True)
        tmp = doc.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, doc)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LayercutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
