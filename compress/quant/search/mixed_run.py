"""Mixed precision end to end: the sensitivity pass, the allocation under the budget, the
optional refinement round, the quantize passes and the fallback check; what ``layercut quantize
--avg-bits X`` runs between loading the model and writing it.

Usage::

    from layercut.compress.quant.search.mixed_run import quantize_mixed
    plan = build_plan(config, net)     # compress/quant/plan.py: the solver, the resolved group size, the candidates
    run = quantize_mixed(net, tokenizer, config, plan, seed=0, device=device)
    run.result                         # the QuantizeResult that is written (mixed, or the uniform baseline)
    run.alloc                          # the Allocation when the mixed result is written, else None
    run.report, run.allocation         # the report's mixed-precision fields; allocation.json's content

``config`` is the stage's :class:`~layercut.compress.quant.config.QuantizeConfig` with ``avg_bits`` set;
``plan`` its :class:`~layercut.compress.quant.plan.QuantPlan` before the allocation (the solver's
settings, the group size resolved for this model, the listed candidates at it). With ``stream`` (a
:class:`layercut.compress.quant.search.mixed_stream.StreamedOutputs`, for a lazily loaded model) the mixed
and uniform checkpoints are written block by block there and the fallback check streams;
``stream.keep`` is left to the caller. The stage (``compress/workflow/stages/quantize.py``) scrubs and
writes the report and ``allocation.json``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from layercut.calibrate.data import CalibSet, calibration_batch
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.quant.format.result import QuantizeResult
from layercut.compress.quant.plan import QuantPlan
from layercut.compress.quant.search import sensitivity
from layercut.compress.quant.search.allocate import (
    Allocation,
    allocate_bits,
    candidate_label,
    uniform_candidates,
)
from layercut.compress.quant.search.mixed import (
    fallback_check,
    float_weights,
    held_apart,
    load_weights,
    resolve_candidates,
)
from layercut.compress.quant.search.refine import Refiner
from layercut.compress.quant.search.sensitivity import allocation_units, expand_bits
from layercut.compress.quant.search.swap import kl_swap_table, swap_candidates
from layercut.compress.quant.solve.driver import quantize_model

MAX_DP_CELLS = 2_000_000  # exact DP up to this many budget cells (int8 choices: 2 MB per unit)


@dataclass
class MixedRun:
    """What :func:`quantize_mixed` decided and quantized."""

    result: QuantizeResult  # what is written: the mixed allocation, or the uniform baseline
    alloc: Allocation | None  # None when the fallback check kept the uniform baseline
    report: dict  # the report's mixed-precision fields, in report order
    allocation: dict  # allocation.json's content, before scrubbing


def quantize_mixed(net, tokenizer, config: QuantizeConfig, plan: QuantPlan, seed: int, device,
                   progress: bool = True, stream=None) -> MixedRun:
    """Choose (bits, group size) per unit under ``config.avg_bits`` and quantize ``net`` in place."""
    cfg, listed = plan.solver, None if plan.candidates is None else list(plan.candidates)
    sym = "symmetric" if config.sym else "asymmetric"
    report: dict = {}
    units = allocation_units(net, config.unit)
    table = [u.to_unit({}) for u in units]  # costs and fits only
    swap = config.sensitivity == "kl-swap"  # kl-swap: full quants + measured swaps (compress/quant/search/swap.py)
    cands, baseline = resolve_candidates(table, config.avg_bits, listed, config.fallback_check or swap)
    if swap:
        cands = swap_candidates(table, baseline, listed)
    n = config.sensitivity_samples
    calib = calibration_batch(tokenizer, config.text_sources(), samples=config.samples, seq_len=config.seq_len,
                              seed=seed)  # Hessians
    sub = CalibSet(calib.input_ids[:n], calib.attention_mask[:n])  # sensitivities
    swap_base = None  # kl-swap: the uniform baseline, already quantized
    if swap:
        held_swap, how_swap = held_apart(tokenizer, config.text_sources(), n, config.seq_len, seed, config.samples, part=1)
        sens, swap_base = kl_swap_table(net, calib, held_swap, units, cands, baseline, cfg,
                                        batch_size=config.batch_size, device=device, progress=progress, stream=stream)
        sens.data = how_swap
    else:
        # looked up on its module at call time (tests replace it there)
        sens = sensitivity.measure_sensitivity(net, sub, units, cands, cfg, methods=(config.sensitivity,),
                                               batch_size=config.batch_size, device=device, progress=progress)
    alloc_units = [u.to_unit(sens.delta[u.name]) for u in units]
    alloc = allocate_bits(alloc_units, config.avg_bits, candidates=cands, max_cells=MAX_DP_CELLS)
    refiner = Refiner(units, alloc_units, alloc, cands, cfg) if config.refine else None  # GPTQ + loss (checked)
    gptq_calib = calib if config.method == "gptq" else None
    need_fp = refiner is not None or (config.fallback_check and set(alloc.choice.values()) != {baseline})
    fp = float_weights(net) if need_fp and stream is None else None  # restored for the uniform pass / round

    def quantize(choice, probe=None):
        return quantize_model(net, gptq_calib, cfg, expand_bits(units, choice), batch_size=config.batch_size,
                              device=device, progress=progress, probe=probe,
                              after_block=stream.block_writer("mixed") if stream is not None else None)

    result = quantize(alloc.choice, refiner.probe if refiner is not None else None)
    refined = None
    if refiner is not None:  # solve again on the losses at the operating point; quantize again if it moved
        alloc, result, refined, refine_info = refiner.round(
            result, config.avg_bits, quantize, (lambda: load_weights(net, fp)) if stream is None else
            (lambda: stream.discard("mixed")), max_cells=MAX_DP_CELLS)
    else:
        refine_info = {"run": False, "why": "switched off"}
    check = config.fallback_check and set(alloc.choice.values()) != {baseline}
    verdict = None
    if check:
        held, how = held_apart(tokenizer, config.text_sources(), n, config.seq_len, seed, config.samples)
        uniform_plan = {name: baseline for name in expand_bits(units, alloc.choice)}
        if stream is None:
            verdict, result = fallback_check(net, gptq_calib, held, cfg, fp, result, uniform_plan,
                                             batch_size=config.batch_size, device=device, progress=progress,
                                             uniform=swap_base)
        else:
            verdict, result = stream.fallback_check(gptq_calib, held, cfg, result, uniform_plan,
                                                    batch_size=config.batch_size, device=device,
                                                    progress=progress)
        verdict.data = how
    elif stream is not None:
        stream.finish("mixed", result)
    fp = None  # frees the float copy
    kept = "uniform" if verdict is not None and verdict.keep == "uniform" else "mixed"
    base_label = candidate_label(baseline) if baseline is not None else None
    labels = ",".join(map(candidate_label, cands))
    if kept == "uniform":
        print(f"quantize: the mixed allocation did not beat uniform {base_label} on {verdict.samples} held-apart "
              f"sequences (KL {verdict.kl_mixed:.4g} vs {verdict.kl_uniform:.4g}): writing the uniform baseline",
              file=sys.stderr)
    fallback = verdict.to_dict() if verdict is not None else {
        "checked": False, "why": "switched off" if not config.fallback_check else "the allocation is the baseline"}
    report.update(avg_bits_budget=config.avg_bits, candidates=[candidate_label(c) for c in cands],
                  baseline=base_label, unit=config.unit, sensitivity=config.sensitivity, sensitivity_samples=n,
                  sensitivity_seconds=sens.seconds, bits_histogram=alloc.histogram(),
                  config_histogram=alloc.pair_histogram(), predicted_delta=alloc.total_delta,
                  allocated_avg_bits=alloc.avg_bits, fallback=fallback, refine=refine_info, written=kept,
                  uniform_avg_bits={candidate_label(c): v for c, v in uniform_candidates(alloc_units, cands).items()})
    allocation = {
        "budget_avg_bits": config.avg_bits, "avg_bits": alloc.avg_bits, "method": alloc.method,
        "candidates": report["candidates"], "baseline": base_label, "unit": config.unit, "written": kept,
        "fallback": fallback, "refine": refine_info, "sensitivity": sens.to_dict(),
        "units": [{"name": u.name, "linears": list(u.linears), "n_weights": u.n_weights,
                   "bits": alloc.bits[u.name], "group_size": alloc.group_size[u.name],
                   "config": candidate_label(alloc.choice[u.name]),
                   "delta": {candidate_label(c): v for c, v in sens.delta[u.name].items()},
                   **({"delta_refined": {candidate_label(c): v for c, v in r.delta.items()}} if refined else {})}
                  for u, r in zip(units, refined or units)],
    }
    report.update(avg_bits=result.avg_bits(), quantize_seconds=result.seconds, solve_seconds=result.solve_seconds,
                  linears=len(result.layers), tokens=result.tokens)
    if kept == "mixed":
        report.update(unit_bits=alloc.bits, unit_group_size=alloc.group_size, bits_per_layer=alloc.labels())
    else:
        report.update(unit_bits={u.name: baseline[0] for u in units},
                      unit_group_size={u.name: baseline[1] for u in units},
                      bits_per_layer={"all linears": base_label})
    report["description"] = (
        f"{config.method.upper()}{' + block tuning' if cfg.tune is not None else ''} ({sym}), bits and group size "
        f"per {config.unit} from {{{labels}}} under a "
        f"{config.avg_bits}-bit budget (sensitivity: {config.sensitivity})"
        + (f", uniform {base_label} written as it won the fallback check," if kept == "uniform" else ",")
    )
    return MixedRun(result, alloc if kept == "mixed" else None, report, allocation)
