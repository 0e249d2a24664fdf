"""How much each allocation unit suffers at each candidate: the Δ_u(c) of the bit allocator.

Run it::

    from layercut.compress.quant.search.sensitivity import allocation_units, measure_sensitivity
    units = allocation_units(model, "group")                 # qkv / o / gate_up / down; or "layer"
    cfg = solver_settings(QuantizeConfig(avg_bits=3.5, group_size=64))   # compress/quant/plan.py
    table = measure_sensitivity(model, calib, units, [(3, 64), (4, -1), (8, -1)], cfg)
    table.delta["model.layers.3.down"][(3, 64)]              # Δ of layer 3's down_proj at 3-bit g64
    measure_sensitivity(model, calib, units, (2, 3, 4, 8), cfg)   # bare bits: at cfg.group_size

A candidate c is a (bits, group size) pair (group size -1 = one group per row), or bare
bits, which mean ``cfg.group_size`` and key the table by bits as before. A unit is only
measured at the pairs whose group size divides the in_features of all its linears.
Each Δ_u(c) is measured on the float model with *only unit u* quantized (GPTQ at c,
re-solved on the same Hessian for every c, Hessians from the float inputs), by one of
(``methods``; the first is ``table.delta``):

* ``"kl"`` — the definition: mean over calibration tokens of KL(p_fp ‖ p_{u@c}); one
  full-model forward per (unit, candidate), so |U|·|C| forwards. Exact, and expensive.
* ``"output"`` — error of the block output: mean over calibration tokens of
  ‖h'_{l+1} − h_{l+1}‖², h the residual stream after the block holding u. One *block*
  forward per (unit, candidate). ``"output_rel"`` divides by Σ_t ‖h_{l+1}‖².
* ``"loss"`` — Σ over u's linears of ½ tr(ΔW H ΔWᵀ) (GPTQ's objective, undamped); free.

``"kl-swap"`` (the stage's ``--sensitivity kl-swap``) is not measured here but in
:mod:`layercut.compress.quant.search.swap`: full quantizations at the uniform baseline and at each
candidate, then the true KL change of swapping one unit at a time, at the baseline's operating
point and with one block in memory.

How well the cheap measures rank like the exact KL table on SmolLM2 is measured in
benchmarks/sensitivity_estimators.py against benchmarks/sensitivity_exact.py's table and
reported in docs/results/mixed.md: across units at one fixed trade, Spearman 0.1–0.5 (the
exact table agrees with itself on other tokens at only 0.48). Scored by the exact table,
the DP run on ``"loss"`` comes closest to the exact DP, and ``"loss"`` costs no forwards, so it
is the command's default; ``"output"`` costs one block forward per unit and candidate. Use
``"kl"`` when the forwards are affordable.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from layercut.calibrate.capture import BlockRun, run_blocks
from layercut.calibrate.data import CalibSet
from layercut.compress.core.arch import arch_for, target_linears
from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.format.result import SUPPORTED_BITS
from layercut.compress.quant.search.allocate import Unit, candidate_label, require_fitting
from layercut.compress.quant.solve.driver import (
    GROUP_LABELS,
    HessianSet,
    check_model,
    linear_weight,
    set_weight,
)
from layercut.compress.quant.solve.linear import solve_group
from layercut.compress.quant.solve.settings import SolverConfig

METHODS = ("kl", "output", "output_rel", "loss")
T = TypeVar("T")


@dataclass(frozen=True)
class AllocUnit:
    """What gets one bit width: a decoder layer, or one fused group of a layer."""

    name: str  # "model.layers.3" or "model.layers.3.qkv"
    block: int
    groups: tuple[int, ...]  # indices into ArchSpec.groups
    linears: tuple[str, ...]  # full linear names
    n_weights: int
    n_rows: int  # Σ out_features: the (group, row) pairs when group_size = -1
    in_features: tuple[int, ...] = ()  # of each linear: the group sizes that fit divide all

    def fits(self, group_size: int) -> bool:
        return group_size == -1 or all(k % group_size == 0 for k in self.in_features)

    def to_unit(self, delta: dict, group_size: int = -1) -> Unit:
        """The allocator's :class:`~layercut.compress.quant.search.allocate.Unit` with sensitivities ``delta``
        (keyed by (bits, group size), or by bits at ``group_size``)."""
        return Unit(self.name, self.n_weights, delta, n_groups=self.n_rows if group_size == -1 else None,
                    n_rows=self.n_rows, in_features=self.in_features)


def allocation_units(model: nn.Module, unit: str = "layer") -> list[AllocUnit]:
    """The allocation units of ``model`` in forward order: ``"layer"`` or ``"group"``."""
    if unit not in ("layer", "group"):
        raise LayercutError(f"quantize: --unit must be 'layer' or 'group', got {unit!r}")
    spec = arch_for(model)
    conv1d = spec.conv1d
    per_group: dict[tuple[int, int], list[tuple[str, nn.Module]]] = {}
    for i, g, name, module in target_linears(model, spec):
        per_group.setdefault((i, g), []).append((name, module))
    units: list[AllocUnit] = []
    n_groups = len(spec.groups)
    for i in range(len(spec.layers_of(model))):
        sets = [tuple(range(n_groups))] if unit == "layer" else [(g,) for g in range(n_groups)]
        for gs in sets:
            items = [it for g in gs for it in per_group[(i, g)]]
            shapes = [tuple(linear_weight(m, conv1d).shape) for _, m in items]
            label = f"{spec.layers_path()}.{i}"
            if unit == "group":
                label += "." + (GROUP_LABELS[gs[0]] if n_groups == len(GROUP_LABELS) else f"g{gs[0]}")
            units.append(AllocUnit(label, i, gs, tuple(n for n, _ in items),
                                   sum(o * k for o, k in shapes), sum(o for o, _ in shapes),
                                   tuple(k for _, k in shapes)))
    return units


def expand_bits(units: Sequence[AllocUnit], unit_bits: Mapping[str, T]) -> dict[str, T]:
    """Per-unit bits (or (bits, group size) pairs) -> per-linear (full linear names)."""
    return {name: unit_bits[u.name] for u in units for name in u.linears}


def _key(c) -> str:
    return candidate_label(c) if isinstance(c, tuple) else str(c)


@dataclass
class SensitivityTable:
    """Δ_u(c) per unit and candidate for the primary method, and every other method computed.

    Keys are (bits, group size) pairs, or bits when the candidates were given as bits."""

    method: str
    delta: dict[str, dict]
    by_method: dict[str, dict[str, dict]] = field(default_factory=dict)
    seconds: float = 0.0
    tokens: int = 0

    def to_dict(self) -> dict:
        """JSON-ready: candidates as ``"3g64"`` / ``"4ch"`` (or ``"3"`` for bare bits)."""
        return {"method": self.method, "seconds": self.seconds, "tokens": self.tokens,
                "by_method": {m: {u: {_key(c): v for c, v in d.items()} for u, d in t.items()}
                              for m, t in self.by_method.items()}}


@torch.no_grad()
def _logprobs(model: nn.Module, calib: CalibSet, batch_size: int) -> list[Tensor]:
    """log p for every position, per micro-batch: [B, L, V] float32."""
    dev = next(model.parameters()).device
    return [F.log_softmax(model(input_ids=ids.to(dev), attention_mask=m.to(dev), use_cache=False).logits.float(), -1)
            for ids, m in calib.split(batch_size)]


@torch.no_grad()
def _mean_kl(model: nn.Module, calib: CalibSet, ref: list[Tensor], batch_size: int) -> float:
    """Mean over non-pad tokens of KL(p_ref ‖ p_model)."""
    total, count = 0.0, 0
    for (_, m), lp, rlp in zip(calib.split(batch_size), _logprobs(model, calib, batch_size), ref):
        kl = (rlp.exp() * (rlp - lp)).sum(-1)  # [B, L]
        mask = m.bool().to(kl.device)
        total += float(kl[mask].sum())
        count += int(mask.sum())
    return total / max(count, 1)


def _masked_sq(a: Tensor, b: Tensor | None, mask: Tensor) -> float:
    """Σ over non-pad tokens of ‖a − b‖² (or ‖a‖² when b is None); a, b [B, L, D], mask [B, L]."""
    d = a if b is None else a - b
    return float(d.float().square().sum(-1)[mask].sum())


@torch.no_grad()
def measure_sensitivity(
    model: nn.Module,
    calib: CalibSet,
    units: Sequence[AllocUnit],
    candidates: Sequence[int] | Sequence[tuple[int, int]],
    cfg: SolverConfig,
    methods: Sequence[str] = ("loss",),
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> SensitivityTable:
    """Δ_u(c) for every unit and candidate (see module doc for ``candidates`` and ``methods``).

    The model is left unchanged. ``calib`` [N, L] should be small (a few dozen
    sequences): the "output" proxy costs |C|·(units per layer) block forwards per layer,
    "kl" one full-model forward per (unit, candidate).
    """
    methods = list(dict.fromkeys(methods))
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        raise LayercutError(f"sensitivity: methods must be among {METHODS}, got {methods}")
    bare = all(isinstance(c, int) and not isinstance(c, bool) for c in candidates)
    pairs = sorted({(int(c), cfg.group_size) if bare else (int(c[0]), int(c[1])) for c in candidates})
    if not pairs or any(b not in SUPPORTED_BITS or (gs != -1 and gs <= 0) for b, gs in pairs):
        raise LayercutError(f"quantize: candidate bits must be among {SUPPORTED_BITS} (group size -1 or positive), "
                            f"got {list(candidates)}")
    require_fitting(pairs, units, "quantize")
    key = (lambda c: c[0]) if bare else (lambda c: c)  # how the table is keyed
    check_model(model, replace(cfg, group_size=-1))  # group sizes are checked per unit above
    spec = arch_for(model)
    by_block: dict[int, list[AllocUnit]] = {}
    for u in units:
        by_block.setdefault(u.block, []).append(u)
    modules = {name: module for _, _, name, module in target_linears(model, spec)}
    group_of = {name: g for _, g, name, _ in target_linears(model, spec)}
    table = {m: {u.name: {} for u in units} for m in methods}
    ref = _logprobs(model, calib, batch_size) if "kl" in methods else None
    forward_methods = [m for m in methods if m in ("output", "output_rel")]
    start = time.perf_counter()
    tokens = {"n": 0}

    def on_block(run: BlockRun) -> None:
        block_units = by_block.get(run.index, [])
        if not block_units:
            return
        hs = HessianSet(run, tuple(range(len(spec.groups))))
        hs.collect()  # also caches the float outputs h_{l+1}
        fp_out = run.outputs()
        masks = run.masks
        n_tok = sum(int(m.sum()) for m in masks)
        tokens["n"] = n_tok
        fp_energy = sum(_masked_sq(o, None, m) for o, m in zip(fp_out, masks)) / n_tok
        names = [n for u in block_units for n in u.linears]
        if not (forward_methods or "kl" in methods):  # losses only: no weight changes, no decoded copies
            _losses_only(hs, block_units, names)
            return
        original = {n: linear_weight(modules[n], spec.conv1d).detach().clone() for n in names}
        perturbed = False
        for c in pairs:
            fitting = [u for u in block_units if u.fits(c[1])]
            if not fitting:
                continue
            ccfg = replace(cfg, group_size=c[1])
            deq, loss = {}, {}
            fit_names = [n for u in fitting for n in u.linears]
            for g in sorted({group_of[n] for n in fit_names}):  # one solve per fused group (shared H)
                members = [n for n in fit_names if group_of[n] == g]
                H = hs.get(g, ", ".join(members)).to(original[members[0]].device)
                for n, res in zip(members, solve_group([original[n] for n in members], H, c[0], ccfg)):
                    deq[n], loss[n] = res.dequant, res.loss
            k = key(c)
            for u in fitting:
                if "loss" in methods:
                    table["loss"][u.name][k] = float(sum(loss[n] for n in u.linears))
                if not (forward_methods or "kl" in methods):
                    continue
                for n in u.linears:
                    set_weight(modules[n], deq[n], spec.conv1d)
                perturbed = True
                if forward_methods:
                    outs = run.forward()
                    err = sum(_masked_sq(o, f, m) for o, f, m in zip(outs, fp_out, masks)) / n_tok
                    if "output" in methods:
                        table["output"][u.name][k] = err
                    if "output_rel" in methods:
                        table["output_rel"][u.name][k] = err / fp_energy
                if "kl" in methods:
                    table["kl"][u.name][k] = _mean_kl(model, calib, ref, batch_size)
                for n in u.linears:
                    set_weight(modules[n], original[n], spec.conv1d)
        if perturbed:
            run.invalidate()  # weights are restored: recompute the float outputs for the next block

    def _losses_only(hs: HessianSet, block_units: list[AllocUnit], names: list[str]) -> None:
        """The ``loss`` table of one block, one fused group at a time: each group's Hessian is freed
        once its candidates are solved, and only the losses are kept (the same values as the loop
        below, which also keeps the decoded weights for the forward measures)."""
        for g in sorted({group_of[n] for n in names}):
            members = [n for n in names if group_of[n] == g]
            H = hs.get(g, ", ".join(members))
            Ws = [linear_weight(modules[n], spec.conv1d).detach() for n in members]
            H = H.to(Ws[0].device)
            for c in pairs:
                fit = [n for u in block_units if u.fits(c[1]) for n in u.linears if n in members]
                if not fit:
                    continue
                for n, res in zip(fit, solve_group([Ws[members.index(n)] for n in fit], H, c[0],
                                                   replace(cfg, group_size=c[1]))):
                    loss_of[(n, c)] = res.loss
            hs.H[g] = None
            del H
        for c in pairs:
            for u in block_units:
                if u.fits(c[1]):
                    table["loss"][u.name][key(c)] = float(sum(loss_of.pop((n, c)) for n in u.linears))

    loss_of: dict[tuple[str, tuple[int, int]], float] = {}
    run_blocks(model, calib, [on_block], batch_size=batch_size, device=device, progress=progress, desc="sensitivity")
    return SensitivityTable(methods[0], table[methods[0]], table, time.perf_counter() - start, tokens["n"])


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's ρ (Pearson correlation of average ranks, so ties are handled)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.size < 2:
        raise ValueError("rank_correlation: need two equal-length sequences of at least 2 values")

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="mergesort")
        r = np.empty_like(v)
        r[order] = np.arange(v.size, dtype=np.float64)
        for val in np.unique(v):  # average ranks over ties
            tie = v == val
            r[tie] = r[tie].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denom) if denom > 0 else float("nan")
