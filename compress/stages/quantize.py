"""The quantize stage: GPTQ (or RTN) with uniform bits, or bits chosen per layer under a budget.

Run it::

    layercut quantize bundled:smollm2-135m -o q4 --bits 4 --group-size 64
    layercut quantize MODEL -o mix --avg-bits 3.5 --candidates 2,3,4,8

    from compress.stages.quantize import QuantizeConfig, quantize_model, run
    run(QuantizeConfig(bits=4), "bundled:smollm2-135m", "q4")
    model = quantize_model(model, tokenizer, QuantizeConfig(bits=4))   # in memory (weights fake-quantized)

Writes a GPTQ v1 checkpoint (:mod:`compress.quant.checkpoint`); with ``avg_bits`` the bits
of each unit (decoder layer, or fused group with ``unit="group"``) are chosen by
:func:`compress.quant.allocate.allocate_bits` from :mod:`compress.quant.sensitivity`'s
measurements under the budget Σ C_u(b_u) ≤ X·Σ n_u, C_u(b) = n_u·(b + (16 + b)/gs)
(scales and zeros counted), and ``allocation.json`` / ``allocation.png`` go into the
checkpoint. Every option is validated before any work; the output appears atomically.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from calibrate import DEFAULT_CALIB_TEXT
from compress.devices import on_device, resolve_device
from compress.stages.base import (
    STREAM_DTYPE_HELP,
    TEXT_SPEC_HELP,
    WHOLE_MODEL_HELP,
    Dtype,
    RunEnv,
    SaveDtype,
    StageConfig,
    TextOptions,
    TextSpec,
    chat_template_option,
    device_option,
    int_list,
    messages_field_option,
    strip_volatile,
    text_field_option,
)

SUPPORTED_BITS = (2, 3, 4, 8)  # compress.quant.gptq.SUPPORTED_BITS (checked equal in tests/test_recipe.py)


class QuantizeConfig(StageConfig, TextOptions):
    """Options of ``layercut quantize`` and of a recipe's ``quantize`` stage.

    >>> QuantizeConfig(avg_bits=3.5, candidates=[2, 3, 4, 8]).candidate_list()
    [2, 3, 4, 8]
    """

    help: ClassVar[str] = "GPTQ (or round-to-nearest) with uniform bits or bits chosen per layer under a budget"
    examples: ClassVar[tuple[str, ...]] = (
        "layercut quantize bundled:smollm2-135m -o q4 --bits 4 --group-size 64",
        "layercut quantize ./pruned -o mixed --avg-bits 3.5 --candidates 3,4,8",
    )

    stage: Literal["quantize"] = "quantize"
    bits: int | None = Field(None, description="uniform bits per weight: 2, 3, 4 or 8 (give this or --avg-bits)",
                             json_schema_extra={"metavar": "B"})
    avg_bits: float | None = Field(None, gt=0, description="average bits per weight to spend, scales and zeros "
                                                           "included; bits are then chosen per layer",
                                   json_schema_extra={"metavar": "X"})
    candidates: str | list[int] = Field("2,3,4,8", description="bit widths the per-layer choice picks from",
                                        json_schema_extra={"metavar": "LIST"})
    unit: Literal["layer", "group"] = Field("layer", description="what gets one bit width: a decoder layer, or "
                                                                 "each group of linears sharing an input")
    sensitivity: Literal["loss", "output", "output_rel", "kl"] = Field(
        "output", description="how much each unit suffers at each width: GPTQ's own layer loss (no extra "
                              "passes), the block output error (absolute or relative), or the model's KL "
                              "(exact, slow)")
    sensitivity_samples: int = Field(16, ge=1, description="calibration sequences used to measure sensitivity")
    group_size: int = Field(64, description="columns sharing one scale and zero point, -1 for one per row; "
                                            "must divide every layer's input size")
    sym: bool = Field(False, description="symmetric quantization (no zero point)")
    act_order: bool = Field(True, description="quantize columns in order of decreasing input energy")
    static_groups: bool = Field(True, description="fix each group's scale and zero from the original weight "
                                                  "first (then loaders need no column reordering)")
    group_aware: bool = Field(False, description="order whole groups by their largest input energy, then "
                                                 "columns within each group (GPTQModel's default)")
    method: Literal["gptq", "rtn"] = Field("gptq", description="GPTQ, or plain round-to-nearest")
    damp: float = Field(0.01, gt=0, lt=1, description="GPTQ damping, which keeps the solve stable: a fraction "
                                                         "of the layer's mean input energy")
    sequential: Literal["block", "sublayer", "linear"] = Field(
        "block", description="how often each block's inputs are re-collected: once, per sublayer (2), per "
                             "linear group (4)")
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
    whole_model: bool = Field(False, description=WHOLE_MODEL_HELP + "; RTN and --avg-bits always load it")
    save_dtype: SaveDtype = Field("fp16", description="dtype of the tensors that stay unquantized")

    @model_validator(mode="after")
    def _request(self) -> QuantizeConfig:
        if (self.bits is None) == (self.avg_bits is None):
            raise ValueError("give exactly one of bits (uniform) or avg_bits (allocated per unit)")
        if self.bits is not None and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        cands = self.candidate_list()
        if not cands or any(b not in SUPPORTED_BITS for b in cands):
            raise ValueError(f"candidates must be among {', '.join(map(str, SUPPORTED_BITS))}, got {self.candidates}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 (one group per row) or positive, got {self.group_size}")
        return self

    def candidate_list(self) -> list[int]:
        return sorted(set(int_list(self.candidates, "candidates")))

    def core(self):
        """The solver's settings (:class:`compress.quant.stage.QuantConfig`)."""
        from compress.quant.stage import QuantConfig

        return QuantConfig(bits=self.bits or max(self.candidate_list()), group_size=self.group_size, sym=self.sym,
                           act_order=self.act_order, static_groups=self.static_groups, group_aware=self.group_aware,
                           method=self.method, damp=self.damp, sequential=self.sequential)


def apply(net, tokenizer, config: QuantizeConfig, seed: int, progress: bool = True, after_block=None):
    """The shared core: allocate bits (with ``avg_bits``) and quantize ``net`` in place.

    Returns (QuantizeResult, report, allocation or None, allocation.json text or None).
    """
    from calibrate.data import CalibSet, calibration_batch
    from compress.errors import LayercutError
    from compress.quant.allocate import allocate_bits, uniform_avg_bits
    from compress.quant.sensitivity import allocation_units, expand_bits, measure_sensitivity
    from compress.quant.stage import check_model, quantize_model

    cfg, cands, gs = config.core(), config.candidate_list(), config.group_size
    cfg.check()
    check_model(net, cfg)
    units = allocation_units(net, config.unit)
    if config.avg_bits is not None:
        table = [u.to_unit({b: 0.0 for b in cands}, gs) for u in units]
        floor = uniform_avg_bits(table, cands[0], gs)
        if config.avg_bits < floor * (1 - 1e-12):
            raise LayercutError(f"quantize: --avg-bits {config.avg_bits} is below the smallest candidate: every "
                                f"unit at {cands[0]} bits with group size {gs} already costs {floor:.4f} bits/weight")
    calib = calibration_batch(tokenizer, config.text_sources(), samples=config.samples, seq_len=config.seq_len,
                              seed=seed)
    report: dict = {"method": config.method, "group_size": gs, "sym": config.sym, "act_order": config.act_order,
                    "static_groups": config.static_groups, "group_aware": config.group_aware,
                    "sequential": config.sequential, "damp": config.damp, "calib": config.text_label(),
                    "samples": config.samples, "seq_len": config.seq_len}
    linear_bits: dict[str, int] = {}
    alloc = alloc_json = None
    if config.avg_bits is not None:
        n = config.sensitivity_samples
        sub = CalibSet(calib.input_ids[:n], calib.attention_mask[:n])
        sens = measure_sensitivity(net, sub, units, cands, cfg, methods=(config.sensitivity,),
                                   batch_size=config.batch_size, device=resolve_device(config.device), progress=progress)
        alloc_units = [u.to_unit(sens.delta[u.name], gs) for u in units]
        alloc = allocate_bits(alloc_units, config.avg_bits, group_size=gs, candidates=cands)
        linear_bits = expand_bits(units, alloc.bits)
        report.update(avg_bits_budget=config.avg_bits, candidates=cands, unit=config.unit,
                      sensitivity=config.sensitivity, sensitivity_samples=n, sensitivity_seconds=sens.seconds,
                      bits_histogram=alloc.histogram(), predicted_delta=alloc.total_delta,
                      uniform_avg_bits={b: uniform_avg_bits(alloc_units, b, gs) for b in cands})
        alloc_json = json.dumps(strip_volatile({
            "budget_avg_bits": config.avg_bits, "avg_bits": alloc.avg_bits, "method": alloc.method,
            "group_size": gs, "candidates": cands, "unit": config.unit, "sensitivity": sens.to_dict(),
            "units": [{"name": u.name, "linears": list(u.linears), "n_weights": u.n_weights,
                       "bits": alloc.bits[u.name],
                       "delta": {str(b): v for b, v in sens.delta[u.name].items()}} for u in units],
        }), indent=2) + "\n"
    else:
        report["bits"] = config.bits
    result = quantize_model(net, calib if config.method == "gptq" else None, cfg, linear_bits,
                            batch_size=config.batch_size, device=resolve_device(config.device), progress=progress,
                            after_block=after_block)
    report.update(avg_bits=result.avg_bits(), quantize_seconds=result.seconds, solve_seconds=result.solve_seconds,
                  linears=len(result.layers), tokens=result.tokens)
    if alloc is not None:
        report["unit_bits"] = alloc.bits
    report["bits_per_layer"] = alloc.bits if alloc is not None else {"all linears": config.bits}
    sym = "symmetric" if config.sym else "asymmetric"
    if config.avg_bits is not None:
        report["description"] = (f"{config.method.upper()} ({sym}, group size {gs}), bits per {config.unit} from "
                                 f"{{{','.join(map(str, cands))}}} under a {config.avg_bits}-bit budget "
                                 f"(sensitivity: {config.sensitivity}),")
    else:
        report["description"] = f"{config.method.upper()} ({sym}, group size {gs}), {config.bits} bits,"
    return result, report, alloc, alloc_json


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
    from compress.errors import LayercutError
    from compress.models import load_model, resolve_model
    from compress.quant.allocate import plot_allocation
    from compress.quant.checkpoint import write_quantized_into
    from compress.stages.base import load_streamed, torch_dtype
    from export.checkpoint import atomic_dir, check_output_dir
    from export.export import is_quantized

    env = env or RunEnv()
    config.core().check()
    check_output_dir(output, env.overwrite)
    path = resolve_model(source)
    if is_quantized(path):
        raise LayercutError(f"quantize: {path} is already quantized (config.json has a quantization_config); "
                            "quantize the dense original")
    start = time.perf_counter()
    streamable = config.method == "gptq" and config.avg_bits is None
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
            plot_allocation(alloc, Path(tmp) / "allocation.png",
                            title=f"{config.unit} bits, budget {config.avg_bits} → {alloc.avg_bits:.3f} avg bits "
                                  f"(sensitivity: {config.sensitivity})")
            report["checkpoint_plot"] = "allocation.png"  # travels inside the checkpoint (export keeps it)
    return {"model": str(source), "output": str(output), **report, "seconds": time.perf_counter() - start}


def _run_streamed(lazy, path: Path, config: QuantizeConfig, folder: Path, env: RunEnv) -> dict:
    """Uniform-bit GPTQ over a lazily loaded model, written block by block into ``folder``."""
    from compress.models import load_tokenizer
    from compress.quant.stream import write_block_fn, write_rest
    from compress.stages.base import torch_dtype
    from export.shards import ShardWriter

    save_dtype = torch_dtype(config.save_dtype)
    writer = ShardWriter(folder, "2GB", always_index=True)
    tokenizer = load_tokenizer(path, env.trust_remote_code)
    result, report, _, _ = apply(lazy.model, tokenizer, config, config.seed, env.progress,
                                 after_block=write_block_fn(lazy, writer, save_dtype))
    extra = {"quantize.json": json.dumps(strip_volatile(report), indent=2, default=str) + "\n"}
    write_rest(lazy, result, writer, folder, save_dtype, extra)
    return report
