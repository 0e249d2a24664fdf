"""The quantize stage: GPTQ (or RTN) with uniform bits, or (bits, group size) chosen per unit under a budget.

Run it::

    layercut quantize bundled:smollm2-135m -o q4 --bits 4 --group-size 64
    layercut quantize MODEL -o mix --avg-bits 3.5                       # default candidate pairs
    layercut quantize MODEL -o mix --avg-bits 3.5 --candidates 3g64,3g128,4g64,4ch,8ch
    layercut quantize UNTIED -o q4h8 --bits 4 --quantize-head 8g128       # + the untied head (quant/head.py)

    from layercut.compress.stages.quantize import QuantizeConfig, quantize_model, run
    run(QuantizeConfig(bits=4), "bundled:smollm2-135m", "q4")
    model = quantize_model(model, tokenizer, QuantizeConfig(bits=4))   # in memory (weights fake-quantized)

Writes a GPTQ v1 checkpoint (:mod:`layercut.compress.quant.checkpoint`). With ``avg_bits`` each unit
(a fused group qkv / o / gate_up / down with ``unit="group"``, the default, or a decoder
layer) gets one (bits, group size) candidate, chosen by
:func:`layercut.compress.quant.allocate.allocate_bits` from :mod:`layercut.compress.quant.sensitivity`'s
measurements under the budget Σ C_u(c_u) ≤ X·Σ n_u, C_u(b, gs) = n_u·b + groups·(16 + b)
(scales and zeros counted); candidates, the uniform baseline and the fallback check are
:mod:`layercut.compress.quant.mixed`'s. The first ``sensitivity_samples`` calibration sequences
measure the sensitivities. With ``refine`` (GPTQ, ``sensitivity="loss"``) the quantize pass
of the chosen allocation also re-solves each unit's neighbouring candidates on the Hessian of
the quantized prefix (:mod:`layercut.compress.quant.refine`), the allocation is solved again on those
losses, and quantized again if it moved. The fallback check then quantizes the uniform baseline too and
writes it instead when the mixed model's KL to the float model is not lower on
``sensitivity_samples`` further sequences drawn after the calibration windows' part of the
text (disjoint from every sequence behind the Hessians and sensitivities); one line on
stderr says when the baseline wins. ``allocation.json`` (and ``allocation.png`` when the
mixed result is written) go into the checkpoint. Every option is validated before any
work; the output appears atomically. A checkpoint input streams (one decoder block in memory)
for uniform bits, RTN and ``avg_bits`` alike (:mod:`layercut.compress.quant.mixed_stream`), except with
``sensitivity="kl"``, whose per-unit KL needs the whole model. ``sensitivity="kl-swap"``
(:mod:`layercut.compress.quant.swap`) replaces the sensitivity pass by full quantizations and
measured swaps; its baseline pass is the fallback check's uniform baseline.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from layercut.calibrate import DEFAULT_CALIB_TEXT
from layercut.compress.devices import on_device, resolve_device
from layercut.compress.errors import LayercutError
from layercut.compress.options import (
    STREAM_DTYPE_HELP,
    TEXT_SPEC_HELP,
    WHOLE_MODEL_HELP,
    Dtype,
    SaveDtype,
    StageConfig,
    TextOptions,
    TextSpec,
    chat_template_option,
    device_option,
    messages_field_option,
    text_field_option,
)
from layercut.compress.quant.result import SUPPORTED_BITS
from layercut.compress.stages.base import RunEnv, strip_volatile

MAX_DP_CELLS = 2_000_000  # exact DP up to this many budget cells (int8 choices: 2 MB per unit)


def parse_candidates(value: str | list, group_size: int) -> list[tuple[int, int]]:
    """``"3g64,4ch,8"`` or ``[4, "3g64"]`` -> (bits, group size) pairs; bare bits take ``group_size``.

    >>> parse_candidates("3g64, 4ch,8", 64)
    [(3, 64), (4, -1), (8, 64)]
    """
    from layercut.compress.quant.allocate import parse_candidate

    items = value if isinstance(value, list) else [x for x in str(value).split(",") if x.strip()]
    return list(dict.fromkeys(parse_candidate(x, group_size) for x in items))


class QuantizeConfig(StageConfig, TextOptions):
    """Options of ``layercut quantize`` and of a recipe's ``quantize`` stage.

    >>> QuantizeConfig(avg_bits=3.5, candidates="3g64,4ch,8", group_size=64).candidate_pairs()
    [(3, 64), (4, -1), (8, 64)]
    """

    help: ClassVar[str] = ("GPTQ (or round-to-nearest) with uniform bits, or bits and group size chosen per unit "
                           "under a budget")
    examples: ClassVar[tuple[str, ...]] = (
        "layercut quantize bundled:smollm2-135m -o q4 --bits 4 --group-size 64",
        "layercut quantize ./pruned -o mixed --avg-bits 3.5 --candidates 3g64,3g128,4g64,4ch,8ch",
    )

    stage: Literal["quantize"] = "quantize"
    bits: int | None = Field(None, description="uniform bits per weight: 2, 3, 4 or 8 (give this or --avg-bits)",
                             json_schema_extra={"metavar": "B"})
    avg_bits: float | None = Field(None, gt=0, description="average bits per weight to spend, scales and zeros "
                                                           "included; bits and group size are then chosen per unit",
                                   json_schema_extra={"metavar": "X"})
    candidates: str | list[int | str] | None = Field(
        None, description="(bits, group size) pairs the per-unit choice picks from: 3g64 = 3 bits in groups of 64 "
                          "columns, 4ch = 4 bits with one group per row, a bare 4 = 4 bits at --group-size; "
                          "none = 3g128,3g64,3g32,4ch,4g128,4g64,8ch, plus 3ch when no other pair fits the "
                          "budget uniformly, and 2g64,2g32 when it is below uniform 3ch", json_schema_extra={"metavar": "LIST"})
    unit: Literal["layer", "group"] = Field("group", description="what gets one configuration: each group of "
                                                                 "linears sharing an input (fused by servers), or "
                                                                 "a whole decoder layer")
    sensitivity: Literal["loss", "output", "output_rel", "kl", "kl-swap"] = Field(
        "loss", description="how much each unit suffers at each candidate: GPTQ's own layer loss (no extra "
                            "forwards; the default: it scored best of the cheap measures against the exact "
                            "table and costs least), the block output error (absolute or relative; one block "
                            "forward per unit and candidate), the model's KL (exact, slow), or kl-swap: full "
                            "quantizations at the uniform baseline and at each candidate (default: the "
                            "baseline's bits per channel and the next width up), then the true KL change of "
                            "swapping each unit alone on --sensitivity-samples held-apart sequences (a forward "
                            "from the unit's block onward per swap; streams)")
    sensitivity_samples: int = Field(16, ge=1, description="calibration sequences used to measure sensitivity "
                                                           "(kl-swap: as many held apart); as many more, held "
                                                           "apart, judge the fallback check")
    refine: bool = Field(False, description="one refinement round (GPTQ with --sensitivity loss): while the "
                                            "chosen allocation is quantized, re-solve each unit's neighbouring "
                                            "candidates on the Hessian of the quantized prefix, solve the "
                                            "allocation again, and quantize again if it moved (off: on the "
                                            "validation text it moved 4-10 units and did not lower the KL)")
    fallback_check: bool = Field(True, description="also quantize the uniform baseline (the costliest candidate "
                                                   "that fits the budget uniformly) and write it instead when the "
                                                   "mixed result's KL to the float model is not lower on held-apart "
                                                   "calibration sequences (about doubles the run time)")
    group_size: int | None = Field(None, description="columns sharing one scale and zero point, -1 for one per "
                                                     "row; must divide every layer's input size (with "
                                                     "--avg-bits: the group size of bare candidate bits); none "
                                                     "= 128 where it divides every quantized layer's input "
                                                     "size, else 64, else 32, else -1 (the report says which)")
    sym: bool = Field(False, description="symmetric quantization (no zero point)")
    act_order: bool = Field(True, description="quantize columns in order of decreasing input energy")
    static_groups: bool = Field(True, description="fix each group's scale and zero from the original weight "
                                                  "first (then loaders need no column reordering)")
    group_aware: bool = Field(False, description="order whole groups by their largest input energy, then "
                                                 "columns within each group (GPTQModel's default)")
    method: Literal["gptq", "rtn"] = Field("gptq", description="GPTQ, or plain round-to-nearest")
    damp: float = Field(0.01, gt=0, lt=1, description="GPTQ damping, which keeps the solve stable: a fraction "
                                                         "of the layer's mean input energy")
    solve_dtype: Literal["float32", "float64"] = Field(
        "float32", description="precision of the damped Hessian's factorization and inverse (the Hessian is "
                               "summed in float64 either way); float32 halves the solve's largest buffers")
    sequential: Literal["block", "sublayer", "linear"] = Field(
        "block", description="how often each block's inputs are re-collected: once, per sublayer (2), per "
                             "linear group (4)")
    # --- scale search (compress/quant/gptq.py) ---
    scale_search: Literal["none", "mse", "hessian", "obs"] = Field(
        "hessian", description="GPTQ only: per group and row, shrink the min/max range by the factor (1 down to "
                               "--scale-min) whose rounding error is least when the group's scale is fixed, the "
                               "error weighted by each input's energy, the Hessian diagonal (hessian; the default, "
                               "chosen on brown-val), unweighted (mse, as GPTQModel's mse option) or by what GPTQ's "
                               "own loss charges a column, 1/[chol(H^-1)]_jj^2 (obs); none = plain min/max")
    scale_min: float = Field(0.75, gt=0, le=1, description="smallest shrink factor the scale search tries")
    scale_steps: int = Field(5, ge=0, le=100, description="steps from 1 down to --scale-min (5: 1, 0.95, ..., "
                                                           "0.75)")
    # --- end scale search ---
    # --- head quantization (compress/quant/head.py) ---
    quantize_head: int | str | None = Field(
        None, description="also GPTQ the untied output head (lm_head) at these bits and group size: 8g128, "
                          "4g64, 8ch (one group per row) or bare bits at --group-size; uniform --bits only; "
                          "a tied head is refused", json_schema_extra={"metavar": "SPEC"})
    # --- end head quantization ---
    calib: TextSpec = Field(DEFAULT_CALIB_TEXT, description="calibration text: " + TEXT_SPEC_HELP)
    text_field: str | None = text_field_option()
    messages_field: str | None = messages_field_option()
    chat_template: bool = chat_template_option()
    samples: int = Field(128, ge=1, description="calibration sequences")
    seq_len: int = Field(512, ge=2, description="tokens per calibration sequence")
    seed: int = Field(0, description="calibration sampling seed (in a recipe: the recipe's seed unless given)")
    batch_size: int = Field(8, ge=1, description="sequences per forward pass")
    device: str = device_option()
    dtype: Dtype = Field("auto", description=STREAM_DTYPE_HELP)
    whole_model: bool = Field(False, description=WHOLE_MODEL_HELP + "; --avg-bits with --sensitivity kl always loads it")
    save_dtype: SaveDtype = Field("fp16", description="dtype of the tensors that stay unquantized")

    @model_validator(mode="after")
    def _request(self) -> QuantizeConfig:
        if (self.bits is None) == (self.avg_bits is None):
            raise ValueError("give exactly one of bits (uniform) or avg_bits (allocated per unit)")
        if self.bits is not None and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        if self.group_size is not None and self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 (one group per row) or positive, got {self.group_size}")
        if self.method != "gptq" and self.scale_search != "none" and "scale_search" in self.model_fields_set:
            raise ValueError(f"scale_search {self.scale_search} works with method gptq, not {self.method}")
        if self.sensitivity == "kl-swap" and self.method != "gptq":  # kl-swap
            raise ValueError(f"sensitivity kl-swap solves GPTQ at each candidate: it needs method gptq, not "
                             f"{self.method}")
        if self.refine and (self.avg_bits is None or self.method != "gptq" or self.sensitivity != "loss"):
            raise ValueError("refine re-solves GPTQ's loss per unit: it needs avg_bits with method gptq and "
                             f"sensitivity loss (got avg_bits {self.avg_bits}, method {self.method}, "
                             f"sensitivity {self.sensitivity})")
        cands = self.candidate_pairs()
        if cands is not None and (not cands or any(b not in SUPPORTED_BITS for b, _ in cands)):
            raise ValueError(f"candidates must be among {', '.join(map(str, SUPPORTED_BITS))} bits, got "
                             f"{self.candidates}")
        if cands is not None and any(g != -1 and g <= 0 for _, g in cands):
            raise ValueError(f"candidates: group sizes must be -1 (ch) or positive, got {self.candidates}")
        if self.quantize_head is not None:
            try:
                hb, hg = self.head_pair()
            except ValueError:
                raise ValueError(f"quantize_head: expected e.g. 8g128, 4g64, 8ch or 8, got {self.quantize_head!r}") \
                    from None
            if hb not in SUPPORTED_BITS:
                raise ValueError(f"quantize_head: bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, "
                                 f"got {hb} ({self.quantize_head!r})")
            if hg != -1 and hg <= 0:
                raise ValueError(f"quantize_head: group size must be -1 (ch) or positive, got {self.quantize_head!r}")
            if self.avg_bits is not None:
                raise ValueError("quantize_head works with uniform bits; with avg_bits it is not supported yet")
        return self

    def head_pair(self) -> tuple[int, int] | None:
        """The head's (bits, group size) from ``quantize_head``; bare bits take the group size
        (an unresolved default reads as 128 here, as in :meth:`core`)."""
        from layercut.compress.quant.allocate import parse_candidate

        if self.quantize_head is None:
            return None
        return parse_candidate(self.quantize_head, 128 if self.group_size is None else self.group_size)

    def candidate_list(self) -> list[int]:
        """The candidate bit widths (of the listed pairs, or of the default set); kept for callers of
        the bits-only form — the allocation works on :meth:`candidate_pairs`."""
        from layercut.compress.quant.allocate import DEFAULT_CANDIDATES

        return sorted({b for b, _ in (self.candidate_pairs() or DEFAULT_CANDIDATES)})

    def candidate_pairs(self) -> list[tuple[int, int]] | None:
        """The listed (bits, group size) pairs; None = the default set (resolved per model)."""
        gs = 128 if self.group_size is None else self.group_size  # (bare widths are re-read once resolved)
        return None if self.candidates is None else parse_candidates(self.candidates, gs)

    def core(self):
        """The solver's settings (:class:`layercut.compress.quant.driver.QuantConfig`); an unresolved
        default group size reads as 128 here, which :func:`apply` replaces by the model's own."""
        from layercut.compress.quant.driver import QuantConfig

        gs = 128 if self.group_size is None else self.group_size
        return QuantConfig(bits=self.bits or 4, group_size=gs, sym=self.sym,
                           act_order=self.act_order, static_groups=self.static_groups, group_aware=self.group_aware,
                           method=self.method, damp=self.damp, sequential=self.sequential,
                           solve_dtype=self.solve_dtype,
                           scale_search=self.scale_search if self.method == "gptq" else "none",
                           scale_min=self.scale_min, scale_steps=self.scale_steps)


def apply(net, tokenizer, config: QuantizeConfig, seed: int, progress: bool = True, after_block=None,
          stream=None):
    """The shared core: choose (bits, group size) per unit (with ``avg_bits``) and quantize ``net`` in place.

    Returns (QuantizeResult, report, allocation or None, allocation.json text or None); the
    allocation is None for uniform bits and when the fallback check kept the uniform baseline.
    ``stream``: a :class:`layercut.compress.quant.mixed_stream.StreamedOutputs` when ``net`` is a lazily
    loaded model and ``avg_bits`` is set: the mixed (and uniform) checkpoints are written block
    by block there and the fallback check streams; ``stream.keep`` is left to the caller.
    """
    import sys
    from dataclasses import replace

    from layercut.calibrate.data import CalibSet, calibration_batch
    from layercut.compress.quant.allocate import allocate_bits, candidate_label, uniform_candidates
    from layercut.compress.quant.driver import check_model, quantize_model
    from layercut.compress.quant.mixed import (
        fallback_check,
        float_weights,
        held_apart,
        load_weights,
        resolve_candidates,
    )
    from layercut.compress.quant.refine import Refiner
    from layercut.compress.quant.sensitivity import allocation_units, expand_bits, measure_sensitivity

    auto_gs = config.group_size is None
    if auto_gs:  # the default: resolved from this model's input sizes
        from layercut.compress.quant.driver import auto_group_size

        config = config.model_copy(update={"group_size": auto_group_size(net)})
    cfg, gs = config.core(), config.group_size
    cfg.check()
    mixed = config.avg_bits is not None
    check_model(net, replace(cfg, group_size=-1) if mixed else cfg)  # mixed: group sizes are checked per unit
    head = config.head_pair()
    if head is not None:
        from layercut.compress.quant.head import check_head

        report_head = {"module": check_head(net, *head), "bits": head[0], "group_size": head[1]}
    device = resolve_device(config.device)
    sym = "symmetric" if config.sym else "asymmetric"
    report: dict = {"method": config.method, "group_size": gs, "group_size_from": "default" if auto_gs else "given",
                    "sym": config.sym, "act_order": config.act_order,
                    "static_groups": config.static_groups, "group_aware": config.group_aware,
                    "sequential": config.sequential, "damp": config.damp, "solve_dtype": config.solve_dtype,
                    "scale_search": cfg.scale_search,
                    **({"scale_grid": [cfg.scale_min, cfg.scale_steps]} if cfg.scale_search != "none" else {}),
                    "calib": config.text_label(),
                    "samples": config.samples, "seq_len": config.seq_len}
    if not mixed:
        calib = calibration_batch(tokenizer, config.text_sources(), samples=config.samples, seq_len=config.seq_len,
                                  seed=seed)
        result = quantize_model(net, calib if config.method == "gptq" else None, cfg, batch_size=config.batch_size,
                                device=device, progress=progress, after_block=after_block, head=head)
        report.update(bits=config.bits, avg_bits=result.avg_bits(), quantize_seconds=result.seconds,
                      solve_seconds=result.solve_seconds, linears=len(result.body()), tokens=result.tokens,
                      bits_per_layer={"all linears": config.bits},
                      description=f"{config.method.upper()} ({sym}, group size {gs}), {config.bits} bits,")
        if head is not None:  # the report and the card say the head is quantized, and how
            from layercut.compress.quant.allocate import candidate_label

            q = result.layers[result.head]
            report_head["avg_bits"] = q.stored_bits / (q.in_features * q.out_features)
            label = candidate_label(head)
            report.update(head=report_head, bits_per_layer={"all linears": config.bits, result.head: label},
                          description=f"{config.method.upper()} ({sym}, group size {gs}), {config.bits} bits; "
                                      f"output head {result.head} {label} ({report_head['avg_bits']:.2f} bits per "
                                      "weight); decoder blocks:")
        return result, report, None, None

    units = allocation_units(net, config.unit)
    table = [u.to_unit({}) for u in units]  # costs and fits only
    swap = config.sensitivity == "kl-swap"  # kl-swap: full quants + measured swaps (compress/quant/swap.py)
    cands, baseline = resolve_candidates(table, config.avg_bits, config.candidate_pairs(),
                                         config.fallback_check or swap)
    if swap:
        from layercut.compress.quant.swap import kl_swap_table, swap_candidates

        cands = swap_candidates(table, baseline, config.candidate_pairs())
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
        sens = measure_sensitivity(net, sub, units, cands, cfg, methods=(config.sensitivity,),
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
    alloc_json = json.dumps(strip_volatile({
        "budget_avg_bits": config.avg_bits, "avg_bits": alloc.avg_bits, "method": alloc.method,
        "candidates": report["candidates"], "baseline": base_label, "unit": config.unit, "written": kept,
        "fallback": fallback, "refine": refine_info, "sensitivity": sens.to_dict(),
        "units": [{"name": u.name, "linears": list(u.linears), "n_weights": u.n_weights,
                   "bits": alloc.bits[u.name], "group_size": alloc.group_size[u.name],
                   "config": candidate_label(alloc.choice[u.name]),
                   "delta": {candidate_label(c): v for c, v in sens.delta[u.name].items()},
                   **({"delta_refined": {candidate_label(c): v for c, v in r.delta.items()}} if refined else {})}
                  for u, r in zip(units, refined or units)],
    }), indent=2) + "\n"
    report.update(avg_bits=result.avg_bits(), quantize_seconds=result.seconds, solve_seconds=result.solve_seconds,
                  linears=len(result.layers), tokens=result.tokens)
    if kept == "mixed":
        report.update(unit_bits=alloc.bits, unit_group_size=alloc.group_size, bits_per_layer=alloc.labels())
    else:
        report.update(unit_bits={u.name: baseline[0] for u in units},
                      unit_group_size={u.name: baseline[1] for u in units},
                      bits_per_layer={"all linears": base_label})
    report["description"] = (
        f"{config.method.upper()} ({sym}), bits and group size per {config.unit} from {{{labels}}} under a "
        f"{config.avg_bits}-bit budget (sensitivity: {config.sensitivity})"
        + (f", uniform {base_label} written as it won the fallback check," if kept == "uniform" else ",")
    )
    return result, report, (alloc if kept == "mixed" else None), alloc_json


def quantize_model(model, tokenizer, config: QuantizeConfig, progress: bool = True):
    """Quantize an in-memory model: each linear's weight becomes its dequantized GPTQ weight (in place).

    The model stays a plain model whose forward is what the checkpoint would decode to;
    :func:`run` writes the packed checkpoint instead.
    """
    apply(model, tokenizer, config, config.seed, progress)
    return model


@on_device
def run(config: QuantizeConfig, source: str | Path, output: str | Path, env: RunEnv | None = None) -> dict:
    """Quantize ``source`` into a GPTQ v1 checkpoint at ``output``; returns the report.

    Report: achieved average bits, per-unit bits, timings; ``quantize.json`` in the
    checkpoint holds the same minus timings and paths.
    """
    from layercut.compress.errors import LayercutError
    from layercut.compress.models import load_model, resolve_model
    from layercut.compress.options import torch_dtype
    from layercut.compress.quant.checkpoint import write_quantized_into
    from layercut.compress.stages.base import load_streamed
    from layercut.export.checkpoint import atomic_dir, check_output_dir
    from layercut.export.export import is_quantized

    env = env or RunEnv()
    config.core().check()
    check_output_dir(output, env.overwrite)
    path = resolve_model(source)
    if is_quantized(path):
        raise LayercutError(f"quantize: {path} is already quantized (config.json has a quantization_config); "
                            "quantize the dense original")
    start = time.perf_counter()
    streamable = config.avg_bits is None or config.sensitivity != "kl"  # the exact KL needs the whole model
    lazy = load_streamed(path, config.dtype, env, config.whole_model or not streamable, "quantize")
    if lazy is not None:  # one block in memory: quantized, written and freed at its turn
        with atomic_dir(output, env.overwrite) as tmp:
            report = _run_streamed(lazy, path, config, Path(tmp), env)
        return {"model": str(source), "output": str(output), **report, "seconds": time.perf_counter() - start}
    net, tokenizer = load_model(path, dtype=torch_dtype(config.dtype, path), trust_remote_code=env.trust_remote_code)
    result, report, alloc, alloc_json = apply(net, tokenizer, config, config.seed, env.progress)
    extra: dict[str, str | bytes] = {"quantize.json": json.dumps(strip_volatile(report), indent=2, default=str) + "\n"}
    if alloc_json is not None:
        extra["allocation.json"] = alloc_json
    with atomic_dir(output, env.overwrite) as tmp:
        write_quantized_into(net, tokenizer, result, Path(tmp), dtype=torch_dtype(config.save_dtype),
                             extra_files=extra)
        if alloc is not None:
            _plot(alloc, Path(tmp), config, report)
    return {"model": str(source), "output": str(output), **report, "seconds": time.perf_counter() - start}


def _run_streamed(lazy, path: Path, config: QuantizeConfig, folder: Path, env: RunEnv) -> dict:
    """GPTQ or RTN over a lazily loaded model, written block by block into ``folder``: uniform
    bits, or bits per unit (the mixed and uniform candidates each written as they go)."""
    from layercut.compress.models import load_tokenizer
    from layercut.compress.options import torch_dtype
    from layercut.compress.quant.mixed_stream import StreamedOutputs
    from layercut.compress.quant.stream import write_block_fn, write_rest
    from layercut.export.shards import ShardWriter

    save_dtype = torch_dtype(config.save_dtype)
    tokenizer = load_tokenizer(path, env.trust_remote_code)
    if config.avg_bits is not None:
        outputs = StreamedOutputs(lazy, folder, save_dtype)
        _, report, alloc, alloc_json = apply(lazy.model, tokenizer, config, config.seed, env.progress, stream=outputs)
        outputs.keep(report["written"])
        (folder / "quantize.json").write_text(json.dumps(strip_volatile(report), indent=2, default=str) + "\n")
        (folder / "allocation.json").write_text(alloc_json)
        if alloc is not None:
            _plot(alloc, folder, config, report)
        return report
    writer = ShardWriter(folder, "2GB", always_index=True)
    result, report, _, _ = apply(lazy.model, tokenizer, config, config.seed, env.progress,
                                 after_block=write_block_fn(lazy, writer, save_dtype))
    extra = {"quantize.json": json.dumps(strip_volatile(report), indent=2, default=str) + "\n"}
    write_rest(lazy, result, writer, folder, save_dtype, extra)
    return report


def _plot(alloc, folder: Path, config: QuantizeConfig, report: dict) -> None:
    from layercut.compress.quant.allocate import plot_allocation

    plot_allocation(alloc, folder / "allocation.png",
                    title=f"{config.unit} bits (colour: group size), budget {config.avg_bits} → {alloc.avg_bits:.3f} "
                          f"avg bits (sensitivity: {config.sensitivity})")
    report["checkpoint_plot"] = "allocation.png"  # travels inside the checkpoint (export keeps it)


def quantize_checkpoint(model: str | os.PathLike, output: str | os.PathLike, *, overwrite: bool = False,
                        progress: bool = True, **options) -> dict:
    """Quantize ``model`` (dir, .gguf or bundled:NAME) into a GPTQ v1 checkpoint at ``output``.

    ``options`` are :class:`QuantizeConfig`'s: exactly one of
    ``bits`` (uniform) or ``avg_bits`` (allocated, overhead included), ``group_size``, ...
    Returns a JSON-able report (achieved average bits, per-unit bits, timings).
    """
    from pydantic import ValidationError

    from layercut.compress.errors import format_error

    if isinstance(options.get("candidates"), tuple):
        options["candidates"] = list(options["candidates"])
    try:
        config = QuantizeConfig(**options)
    except ValidationError as exc:
        raise LayercutError(f"quantize: {format_error(exc)}") from None
    return run(config, model, output, RunEnv(overwrite=overwrite, progress=progress))
