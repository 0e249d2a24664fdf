"""``quantize_checkpoint``: one call from a model to a GPTQ checkpoint (what the CLI runs).

Usage::

    from compress.quant.run import quantize_checkpoint
    quantize_checkpoint("bundled:smollm2-135m", "out/q4", bits=4, group_size=64)
    quantize_checkpoint("bundled:smollm2-135m", "out/mix", avg_bits=3.5, candidates=(2, 3, 4, 8))

or ``layercut quantize MODEL -o OUT (--bits B | --avg-bits X) ...``.

With ``avg_bits`` the bits of each unit (decoder layer, or fused group with
``unit="group"``) are chosen by :func:`compress.quant.allocate.allocate_bits` from the
sensitivities of :mod:`compress.quant.sensitivity`, under the budget Σ C_u(b_u) ≤ X·Σ n_u
with C_u(b) = n_u·(b + (16 + b)/gs) (scales and zeros counted). ``allocation.json``
(units, Δ table, chosen bits, predicted and achieved average bits) and
``allocation.png`` are written into the checkpoint. Every input is validated before
any work; the output appears atomically.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from compress.errors import LayercutError
from compress.quant.allocate import allocate_bits, plot_allocation, uniform_avg_bits
from compress.quant.checkpoint import write_quantized_into
from compress.quant.gptq import SUPPORTED_BITS
from compress.quant.sensitivity import METHODS as SENS_METHODS
from compress.quant.sensitivity import allocation_units, expand_bits, measure_sensitivity
from compress.quant.stage import QuantConfig, check_model, quantize_model

DEFAULT_SENSITIVITY = "output"  # best per-bits rank correlation with the KL on SmolLM2: docs/results-quant.md


def _check_request(bits: int | None, avg_bits: float | None, candidates: Sequence[int], samples: int,
                   seq_len: int, sens_samples: int, sensitivity: str) -> list[int]:
    if (bits is None) == (avg_bits is None):
        raise LayercutError("quantize: pass exactly one of --bits B or --avg-bits X")
    if bits is not None and bits not in SUPPORTED_BITS:
        raise LayercutError(f"quantize: --bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {bits}")
    cands = sorted(set(candidates))
    if avg_bits is not None:
        bad = [b for b in cands if b not in SUPPORTED_BITS]
        if not cands or bad:
            raise LayercutError(f"quantize: --candidates must be among {', '.join(map(str, SUPPORTED_BITS))}, "
                                f"got {','.join(map(str, candidates))}")
        if not (avg_bits > 0 and avg_bits == avg_bits and avg_bits != float("inf")):
            raise LayercutError(f"quantize: --avg-bits must be a positive number, got {avg_bits}")
        if sensitivity not in SENS_METHODS:
            raise LayercutError(f"quantize: --sensitivity must be one of {', '.join(SENS_METHODS)}")
        if sens_samples < 1:
            raise LayercutError(f"quantize: --sensitivity-samples must be >= 1, got {sens_samples}")
    if samples < 1 or seq_len < 2:
        raise LayercutError(f"quantize: need --samples >= 1 and --seq-len >= 2 (got {samples}, {seq_len})")
    return cands


def quantize_checkpoint(
    model: str | os.PathLike,
    output: str | os.PathLike,
    bits: int | None = None,
    avg_bits: float | None = None,
    candidates: Sequence[int] = (2, 3, 4, 8),
    unit: str = "layer",
    group_size: int = 64,
    sym: bool = False,
    act_order: bool = True,
    static_groups: bool = True,
    group_aware: bool = False,
    method: str = "gptq",
    damp: float = 0.01,
    sequential: str = "block",
    calib: str = "bundled:brown-calib",
    samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    sensitivity: str = DEFAULT_SENSITIVITY,
    sensitivity_samples: int = 16,
    batch_size: int = 8,
    device: str | None = None,
    dtype: torch.dtype = torch.float16,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Quantize ``model`` (dir, .gguf or bundled:NAME) into a GPTQ v1 checkpoint at ``output``.

    Exactly one of ``bits`` (uniform) or ``avg_bits`` (allocated, overhead included) is
    given. Returns a JSON-able report (achieved average bits, per-unit bits, timings).
    """
    from calibrate.data import CalibSet, calibration_batch
    from compress.models import load_model, resolve_model
    from export.checkpoint import atomic_dir, check_output_dir
    from export.export import is_quantized

    cands = _check_request(bits, avg_bits, candidates, samples, seq_len, sensitivity_samples, sensitivity)
    cfg = QuantConfig(bits=bits or max(cands), group_size=group_size, sym=sym, act_order=act_order,
                      static_groups=static_groups, group_aware=group_aware, method=method, damp=damp, sequential=sequential)
    cfg.check()
    if cfg.damp == 0:
        raise LayercutError("quantize: damp must be > 0 (GPTQ loaders require 0 < damp_percent < 1)")
    check_output_dir(output, overwrite)
    path = resolve_model(model)
    if is_quantized(path):
        raise LayercutError(f"quantize: {path} is already quantized (config.json has a quantization_config); "
                            "quantize the dense original")
    start = time.perf_counter()
    net, tokenizer = load_model(path)
    check_model(net, cfg)
    units = allocation_units(net, unit)
    if avg_bits is not None:
        zero = {b: 0.0 for b in cands}
        table = [u.to_unit(zero, group_size) for u in units]
        floor = uniform_avg_bits(table, cands[0], group_size)
        if avg_bits < floor * (1 - 1e-12):
            raise LayercutError(f"quantize: --avg-bits {avg_bits} is below the smallest candidate: every unit at "
                                f"{cands[0]} bits with group size {group_size} already costs {floor:.4f} bits/weight")
    calib_set = calibration_batch(tokenizer, calib, samples=samples, seq_len=seq_len, seed=seed)

    report: dict = {"model": str(model), "output": str(output), "method": method, "group_size": group_size,
                    "sym": sym, "act_order": act_order,
                    "static_groups": static_groups, "group_aware": group_aware, "sequential": sequential, "damp": damp,
                    "calib": calib, "samples": samples, "seq_len": seq_len}
    extra: dict[str, str | bytes] = {}
    linear_bits: dict[str, int] = {}
    alloc = None
    if avg_bits is not None:
        sub = CalibSet(calib_set.input_ids[:sensitivity_samples], calib_set.attention_mask[:sensitivity_samples])
        sens = measure_sensitivity(net, sub, units, cands, cfg, methods=(sensitivity,), batch_size=batch_size,
                                   device=device, progress=progress)
        alloc_units = [u.to_unit(sens.delta[u.name], group_size) for u in units]
        alloc = allocate_bits(alloc_units, avg_bits, group_size=group_size, candidates=cands)
        linear_bits = expand_bits(units, alloc.bits)
        report.update(avg_bits_budget=avg_bits, candidates=cands, unit=unit, sensitivity=sensitivity,
                      sensitivity_samples=sensitivity_samples, sensitivity_seconds=sens.seconds,
                      bits_histogram=alloc.histogram(), predicted_delta=alloc.total_delta,
                      uniform_avg_bits={b: uniform_avg_bits(alloc_units, b, group_size) for b in cands})
        extra["allocation.json"] = json.dumps({
            "budget_avg_bits": avg_bits, "avg_bits": alloc.avg_bits, "method": alloc.method,
            "group_size": group_size, "candidates": cands, "unit": unit, "sensitivity": sens.to_dict(),
            "units": [{"name": u.name, "linears": list(u.linears), "n_weights": u.n_weights,
                       "bits": alloc.bits[u.name],
                       "delta": {str(b): v for b, v in sens.delta[u.name].items()}} for u in units],
        }, indent=2) + "\n"
    else:
        report["bits"] = bits

    result = quantize_model(net, calib_set if method == "gptq" else None, cfg, linear_bits,
                            batch_size=batch_size, device=device, progress=progress)
    stored_avg = result.avg_bits()
    report.update(avg_bits=stored_avg, quantize_seconds=result.seconds, solve_seconds=result.solve_seconds,
                  linears=len(result.layers), tokens=result.tokens)
    if alloc is not None:
        report["unit_bits"] = alloc.bits
    extra["quantize.json"] = json.dumps({k: v for k, v in report.items() if k != "output"}, indent=2,
                                        default=str) + "\n"
    with atomic_dir(output, overwrite) as tmp:
        write_quantized_into(net, tokenizer, result, Path(tmp), dtype=dtype, extra_files=extra)
        if alloc is not None:
            plot_allocation(alloc, Path(tmp) / "allocation.png",
                            title=f"{unit} bits, budget {avg_bits} → {alloc.avg_bits:.3f} avg bits "
                                  f"(sensitivity: {sensitivity})")
    report["seconds"] = time.perf_counter() - start
    return report
