"""Mixed precision around the allocator: candidate sets, the uniform baseline, the fallback check.

Run it (what ``layercut quantize --avg-bits X`` does between sensitivity and writing)::

    from layercut.compress.quant.search.mixed import resolve_candidates, fallback_check
    units = allocation_units(model, "group")
    cands, baseline = resolve_candidates(units, 3.5, None)          # default set; baseline (3, 64)
    ...                                                               # sensitivity, allocate_bits
    verdict = fallback_check(model, calib, check, cfg, mixed_plan, baseline_plan, mixed_result)

**Candidates** are (bits, group size) pairs (group size -1: one group per output row).
The default set is :data:`DEFAULT_CANDIDATES`. 3-bit per channel (:data:`LOW_BUDGET_CANDIDATES`)
joins it only when no other default pair fits the budget uniformly (on SmolLM2: below uniform
3g64's 3.297 bits/weight), so that a uniform baseline exists: the loss measure prices 3ch
cheaply and the model's KL does not (chosen on the validation text, ``benchmarks/quant.py``
rows ``mixed-*-no3ch``). The 2-bit pairs :data:`TWO_BIT_CANDIDATES` join only when the budget
is below the cost of uniform 3-bit per channel (so always below 3.0 bits/weight), or when the
user lists them. Pairs whose group size divides no
unit's in_features are dropped from the default set, and refused when listed.

**Baseline**: the most expensive candidate whose *uniform* cost fits the budget (every
unit must be able to take it). With the default set one always exists once the budget
covers the cheapest allocation; with a user's list it may not, which is an error while
the fallback check is on.

**Fallback check** (fall back to uniform when the mixed plan does not win on calibration
KL): the mixed plan and the uniform baseline are both quantized, and the
mean KL(p_fp ‖ p_q) over the non-pad tokens of a held-apart set of calibration sequences
decides which is written. Only the target linears change between the three models, so
one model is kept and its linear weights are swapped per micro-batch (float copy kept,
quantized ones decoded from their packed tensors): memory is one extra copy of the
linear weights, and the forwards run on the model's own device. A streamed model (one block in
memory) runs the same check in :mod:`layercut.compress.quant.search.mixed_stream` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from layercut.calibrate.data import CalibSet, calibration_batch
from layercut.compress.core.arch import arch_for, target_linears
from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.format.pack import dequantize_gptq
from layercut.compress.quant.format.result import QuantizeResult
from layercut.compress.quant.search.allocate import (
    DEFAULT_CANDIDATES,
    LOW_BUDGET_CANDIDATES,
    TWO_BIT_CANDIDATES,
    Candidate,
    Unit,
    budget_bits,
    candidate_label,
    candidate_order,
)
from layercut.compress.quant.solve.driver import linear_weight, quantize_model, set_weight
from layercut.compress.quant.solve.settings import SolverConfig


def _fits_all(units: Sequence[Unit], c: Candidate) -> bool:
    return all(u.fits(c[1]) for u in units)


def _total(units: Sequence[Unit], c: Candidate) -> int:
    return sum(u.cost(c) for u in units)


def resolve_candidates(
    units: Sequence[Unit], avg_bits: float, explicit: Sequence[Candidate] | None, need_baseline: bool = True
) -> tuple[list[Candidate], Candidate | None]:
    """(candidates in ascending order, the uniform baseline or None) for a budget.

    ``units``: the allocator's units (their ``in_features`` and ``n_rows`` are what count;
    ``delta`` is not read). ``explicit``: the user's pairs, or None for the default set.
    Raises :class:`LayercutError`: a listed pair whose group size divides no unit; a budget
    below the cheapest allocation; with ``need_baseline``, no candidate whose uniform cost
    fits the budget.
    """
    n_total = sum(u.n_weights for u in units)
    budget = budget_bits(avg_bits, n_total)
    ins = sorted({k for u in units for k in u.in_features})
    if explicit is None:
        cands = [c for c in DEFAULT_CANDIDATES if any(u.fits(c[1]) for u in units)]
        if not any(_fits_all(units, c) and _total(units, c) <= budget for c in cands):  # no uniform baseline
            cands += list(LOW_BUDGET_CANDIDATES)
        if budget < _total(units, (3, -1)):
            cands += [c for c in TWO_BIT_CANDIDATES if any(u.fits(c[1]) for u in units)]
    else:
        cands = list(dict.fromkeys(explicit))
        for c in cands:
            if not any(u.fits(c[1]) for u in units):
                raise LayercutError(f"quantize: candidate {candidate_label(c)}: group size {c[1]} divides the input "
                                    f"size of no unit (in_features: {', '.join(map(str, ins))})")
    cands.sort(key=candidate_order)
    floor = sum(min(u.cost(c) for c in cands if u.fits(c[1])) for u in units)
    if budget < floor:
        raise LayercutError(f"quantize: --avg-bits {avg_bits} is below the smallest candidate allocation: every unit "
                            f"at its cheapest of {','.join(map(candidate_label, cands))} already costs "
                            f"{floor / n_total:.4f} bits/weight")
    fitting = [c for c in cands if _fits_all(units, c) and _total(units, c) <= budget]
    if fitting:
        return cands, max(fitting, key=lambda c: (_total(units, c), candidate_order(c)))
    if need_baseline:
        raise LayercutError(f"quantize: no candidate in --candidates {','.join(map(candidate_label, cands))} fits the "
                            f"--avg-bits {avg_bits} budget uniformly, so there is no uniform baseline for the fallback "
                            "check: add one (e.g. 3g64 or 3ch) or pass --no-fallback-check")
    return cands, None


# ------------------------------------------------------------------ fallback check


def held_apart(tokenizer, sources, samples: int, seq_len: int, seed: int, calib_samples: int,
               part: int = 0) -> tuple[CalibSet, str]:
    """``samples`` sequences that share no token with ``calibration_batch(sources, calib_samples,
    seq_len, seed)``; (the set, how it was drawn).

    Calibration windows all lie in the first max((N + 1)·L·4 + L, 2¹⁶) tokens of each
    source's stream (:func:`layercut.calibrate.data.calibration_batch`), so these are drawn after that
    offset. ``part`` k > 0 skips k further such spans of ``samples`` windows, so part 0 (the
    fallback check) and part 1 (kl-swap's measurement) share no token either. A text too short
    for it gets windows re-drawn with ``seed + 1 + part`` instead (they may overlap calibration
    windows; the report says so).
    """
    offset = max((calib_samples + 1) * seq_len * 4 + seq_len, 1 << 16)
    offset += part * max((samples + 1) * seq_len * 4 + seq_len, 1 << 16)
    try:
        got = calibration_batch(tokenizer, sources, samples=samples, seq_len=seq_len, seed=seed, offset=offset)
        if bool(got.attention_mask.all()):
            return got, f"{samples} windows after token {offset} of the calibration text (disjoint)"
    except LayercutError:
        pass
    got = calibration_batch(tokenizer, sources, samples=samples, seq_len=seq_len, seed=seed + 1 + part)
    return got, (f"{samples} windows drawn with seed {seed + 1 + part} (text too short to hold them apart; "
                 "may overlap)")


@dataclass
class FallbackVerdict:
    """Both KLs on the held-apart sequences and which plan was kept."""

    kl_mixed: float
    kl_uniform: float
    keep: str  # "mixed" or "uniform"
    samples: int
    tokens: int
    data: str = ""  # how the held-apart sequences were drawn

    def to_dict(self) -> dict:
        return {"kl_mixed": self.kl_mixed, "kl_uniform": self.kl_uniform, "kept": self.keep,
                "samples": self.samples, "tokens": self.tokens, "data": self.data}


def load_weights(model: nn.Module, weights: Mapping[str, Tensor] | QuantizeResult) -> None:
    """Set the target linears of ``model`` to float ``weights`` or to a result's decoded weights."""
    spec = arch_for(model)
    for _, _, name, module in target_linears(model, spec):
        if isinstance(weights, QuantizeResult):
            t = weights.layers[name].tensors
            W = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], weights.layers[name].bits)
        else:
            W = weights[name]
        set_weight(module, W.to(module.weight.device), spec.conv1d)


def float_weights(model: nn.Module) -> dict[str, Tensor]:
    """A copy of the target linears' weights W [out, in] (what the fallback check restores)."""
    spec = arch_for(model)
    return {name: linear_weight(m, spec.conv1d).detach().clone() for _, _, name, m in target_linears(model, spec)}


@torch.no_grad()
def compare_kl(
    model: nn.Module, check: CalibSet, fp: Mapping[str, Tensor], variants: Mapping[str, QuantizeResult],
    batch_size: int = 8,
) -> tuple[dict[str, float], int]:
    """Mean over non-pad tokens of KL(p_fp ‖ p_v) for each variant; (kls, tokens).

    Per micro-batch the model runs with the float weights, then with each variant's; the
    model is left holding the last variant's weights.
    """
    dev = next(model.parameters()).device
    total = {k: 0.0 for k in variants}
    count = 0
    for ids, mask in check.split(batch_size):
        ids, m = ids.to(dev), mask.to(dev)
        load_weights(model, fp)
        ref = F.log_softmax(model(input_ids=ids, attention_mask=m, use_cache=False).logits.float(), -1)  # [B, L, V]
        keep = m.bool()
        for name, res in variants.items():
            load_weights(model, res)
            lp = F.log_softmax(model(input_ids=ids, attention_mask=m, use_cache=False).logits.float(), -1)
            kl = (ref.exp() * (ref - lp)).sum(-1)  # [B, L]
            total[name] += float(kl[keep].sum())
        count += int(keep.sum())
    return {k: v / max(count, 1) for k, v in total.items()}, count


def fallback_check(
    model: nn.Module,
    calib: CalibSet | None,
    check: CalibSet,
    cfg: SolverConfig,
    fp: Mapping[str, Tensor],
    mixed: QuantizeResult,
    uniform_plan: Mapping[str, Candidate],
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    uniform: QuantizeResult | None = None,
) -> tuple[FallbackVerdict, QuantizeResult]:
    """Quantize the uniform baseline from the float weights ``fp`` (or take ``uniform``, already
    quantized) and keep whichever of ``mixed`` / uniform has the lower KL on ``check``; returns
    (verdict, kept result).

    ``model`` holds ``mixed``'s weights on entry and the kept result's on return. Ties
    keep the uniform baseline (the simpler checkpoint).
    """
    load_weights(model, fp)
    if uniform is None:
        uniform = quantize_model(model, calib, cfg, dict(uniform_plan), batch_size=batch_size, device=device,
                                 progress=progress)
    kls, tokens = compare_kl(model, check, fp, {"mixed": mixed, "uniform": uniform}, batch_size)
    keep = "mixed" if kls["mixed"] < kls["uniform"] else "uniform"
    kept = mixed if keep == "mixed" else uniform
    load_weights(model, kept)
    return FallbackVerdict(kls["mixed"], kls["uniform"], keep, check.num_samples, tokens), kept
