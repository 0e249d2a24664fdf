"""The quantize stage: GPTQ (or RTN) with uniform bits, or (bits, group size) chosen per unit under a budget.

Run it::

    layercut quantize bundled:smollm2-135m -o q4 --bits 4 --group-size 64
    layercut quantize MODEL -o mix --avg-bits 3.5                       # default candidate pairs
    layercut quantize MODEL -o mix --avg-bits 3.5 --candidates 3g64,3g128,4g64,4ch,8ch
    layercut quantize UNTIED -o q4h8 --bits 4 --quantize-head 8g128       # + the untied head (quant/solve/head.py)

    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.stages.quantize import quantize_model, run
    run(QuantizeConfig(bits=4), "bundled:smollm2-135m", "q4")
    model = quantize_model(model, tokenizer, QuantizeConfig(bits=4))   # in memory (weights fake-quantized)

Writes a GPTQ v1 checkpoint (:mod:`layercut.compress.quant.format.checkpoint`). With ``avg_bits`` each unit
(a fused group qkv / o / gate_up / down with ``unit="group"``, the default, or a decoder
layer) gets one (bits, group size) candidate, chosen by
:func:`layercut.compress.quant.search.allocate.allocate_bits` from :mod:`layercut.compress.quant.search.sensitivity`'s
measurements under the budget Σ C_u(c_u) ≤ X·Σ n_u, C_u(b, gs) = n_u·b + groups·(16 + b)
(scales and zeros counted); candidates, the uniform baseline and the fallback check are
:mod:`layercut.compress.quant.search.mixed`'s, and the whole mixed-precision run (sensitivity, allocation,
refinement, quantize passes, fallback check) is :func:`layercut.compress.quant.search.mixed_run.quantize_mixed`;
this stage loads, calls it, writes and reports. The options are
:class:`~layercut.compress.quant.config.QuantizeConfig`'s. The first ``sensitivity_samples`` calibration sequences
measure the sensitivities. With ``refine`` (GPTQ, ``sensitivity="loss"``) the quantize pass
of the chosen allocation also re-solves each unit's neighbouring candidates on the Hessian of
the quantized prefix (:mod:`layercut.compress.quant.search.refine`), the allocation is solved again on those
losses, and quantized again if it moved. The fallback check then quantizes the uniform baseline too and
writes it instead when the mixed model's KL to the float model is not lower on
``sensitivity_samples`` further sequences drawn after the calibration windows' part of the
text (disjoint from every sequence behind the Hessians and sensitivities); one line on
stderr says when the baseline wins. ``allocation.json`` (and ``allocation.png`` when the
mixed result is written) go into the checkpoint. Every option is validated before any
work; the output appears atomically. A checkpoint input streams (one decoder block in memory)
for uniform bits, RTN and ``avg_bits`` alike (:mod:`layercut.compress.quant.search.mixed_stream`), except with
``sensitivity="kl"``, whose per-unit KL needs the whole model. ``sensitivity="kl-swap"``
(:mod:`layercut.compress.quant.search.swap`) replaces the sensitivity pass by full quantizations and
measured swaps; its baseline pass is the fallback check's uniform baseline.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from layercut.compress.core.devices import on_device, resolve_device
from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.workflow.stages.base import RunEnv, strip_volatile

if TYPE_CHECKING:  # torch-free at import, as the other stage modules
    from layercut.compress.core.distributed import Group


def apply(net, tokenizer, config: QuantizeConfig, seed: int, progress: bool = True, after_block=None,
          stream=None, group: Group | None = None, calib=None):
    """The shared core: choose (bits, group size) per unit (with ``avg_bits``) and quantize ``net`` in place.

    Returns (QuantizeResult, report, allocation or None, allocation.json text or None); the
    allocation is None for uniform bits and when the fallback check kept the uniform baseline.
    ``stream``: a :class:`layercut.compress.quant.search.mixed_stream.StreamedOutputs` when ``net`` is a lazily
    loaded model and ``avg_bits`` is set: the mixed (and uniform) checkpoints are written block
    by block there and the fallback check streams; ``stream.keep`` is left to the caller.
    ``group`` (under torchrun, uniform bits only): this process's place; ``calib``: the calibration
    set already drawn (the same on every rank), else drawn here.
    """
    from dataclasses import replace

    from layercut.calibrate.data import calibration_batch
    from layercut.compress.quant.search.allocate import candidate_label
    from layercut.compress.quant.solve.driver import check_model, quantize_model

    auto_gs = config.group_size is None
    if auto_gs:  # the default: resolved from this model's input sizes
        from layercut.compress.quant.solve.driver import auto_group_size

        config = config.model_copy(update={"group_size": auto_group_size(net)})
    cfg, gs = config.core(), config.group_size
    cfg.check()
    mixed = config.avg_bits is not None
    check_model(net, replace(cfg, group_size=-1) if mixed else cfg)  # mixed: group sizes are checked per unit
    head = config.head_pair()
    if head is not None:
        from layercut.compress.quant.solve.head import check_head

        report_head = {"module": check_head(net, *head), "bits": head[0], "group_size": head[1]}
    device = resolve_device(config.device)
    sym = "symmetric" if config.sym else "asymmetric"
    report: dict = {"method": config.method, "group_size": gs, "group_size_from": "default" if auto_gs else "given",
                    "sym": config.sym, "act_order": config.act_order,
                    "static_groups": config.static_groups, "group_aware": config.group_aware,
                    "sequential": config.sequential, "damp": config.damp, "solve_dtype": config.solve_dtype,
                    "scale_search": cfg.scale_search,
                    **({"scale_grid": [cfg.scale_min, cfg.scale_steps], "scale_bounds": cfg.scale_bounds}
                       if cfg.scale_search != "none" else {}),
                    "refit_scales": cfg.refit_scales,
                    **({"block_tune": {"steps": cfg.tune.steps, "batch": cfg.tune.batch, "lr": cfg.tune.lr, "scale_lr": cfg.tune.scale_lr,
                                       "target": cfg.tune.target, "loss": cfg.tune.loss}} if cfg.tune is not None else {}),
                    "calib": config.text_label(),
                    "samples": config.samples, "seq_len": config.seq_len}
    if not mixed:
        if calib is None:
            calib = calibration_batch(tokenizer, config.text_sources(), samples=config.samples,
                                      seq_len=config.seq_len, seed=seed)
        result = quantize_model(net, calib if config.method == "gptq" else None, cfg, batch_size=config.batch_size,
                                device=device, progress=progress, after_block=after_block, head=head, group=group)
        report.update(bits=config.bits, avg_bits=result.avg_bits(), quantize_seconds=result.seconds,
                      solve_seconds=result.solve_seconds, linears=len(result.body()), tokens=result.tokens,
                      bits_per_layer={"all linears": config.bits},
                      description=f"{config.method.upper()}{' + block tuning' if cfg.tune else ''} ({sym}, group "
                                  f"size {gs}), {config.bits} bits,")
        if result.tune_reports:
            report["block_tune"].update(tune_summary(result.tune_reports))
        if head is not None:  # the report and the card say the head is quantized, and how
            q = result.layers[result.head]
            report_head["avg_bits"] = q.stored_bits / (q.in_features * q.out_features)
            label = candidate_label(head)
            report.update(head=report_head, bits_per_layer={"all linears": config.bits, result.head: label},
                          description=f"{config.method.upper()} ({sym}, group size {gs}), {config.bits} bits; "
                                      f"output head {result.head} {label} ({report_head['avg_bits']:.2f} bits per "
                                      "weight); decoder blocks:")
        return result, report, None, None

    from layercut.compress.quant.search.mixed_run import quantize_mixed

    mixed_run = quantize_mixed(net, tokenizer, config, cfg, seed, device, progress, stream)
    report.update(mixed_run.report)
    return (mixed_run.result, report, mixed_run.alloc,
            json.dumps(strip_volatile(mixed_run.allocation), indent=2) + "\n")


def tune_summary(reports: dict) -> dict:
    """What block tuning did, over all blocks: how many kept their tuned result, the block-output
    loss of what was kept / GPTQ's (geometric mean of the per-block ratios), and the share of codes moved."""
    rs = list(reports.values())
    ratios = [min(r.loss_tuned, r.loss_gptq) / r.loss_gptq for r in rs if r.loss_gptq > 0]
    return {"blocks_kept": sum(r.kept for r in rs), "blocks": len(rs),
            "loss_ratio": math.exp(sum(math.log(max(x, 1e-12)) for x in ratios) / max(1, len(ratios))),
            "codes_moved": sum(r.codes_changed for r in rs) / max(1, len(rs))}


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
    from layercut.compress.core.distributed import same_on_every_rank, world_from_env
    from layercut.compress.core.errors import LayercutError
    from layercut.compress.core.save import atomic_dir, check_output_dir
    from layercut.compress.io.models import load_model, resolve_model
    from layercut.compress.options import torch_dtype
    from layercut.compress.quant.format.checkpoint import write_quantized_into
    from layercut.compress.workflow.stages.base import load_streamed
    from layercut.export.export import is_quantized

    env = env or RunEnv()
    with same_on_every_rank():  # under torchrun every process checks; rank 0 alone prints the error
        config.core().check()
        check_output_dir(output, env.overwrite)
        path = resolve_model(source)
        if is_quantized(path):
            raise LayercutError(f"quantize: {path} is already quantized (config.json has a quantization_config); "
                                "quantize the dense original")
    start = time.perf_counter()
    if world_from_env()[1] > 1:  # torchrun: data-parallel calibration (docs/architecture.md)
        return _run_shared(config, source, path, output, env, start)
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


def _run_streamed(lazy, path: Path, config: QuantizeConfig, folder: Path, env: RunEnv, **shared) -> dict:
    """GPTQ or RTN over a lazily loaded model, written block by block into ``folder``: uniform
    bits, or bits per unit (the mixed and uniform candidates each written as they go).
    ``shared``: ``group`` and ``calib`` under torchrun (uniform bits), for :func:`apply`."""
    from layercut.compress.core.shards import ShardWriter
    from layercut.compress.io.models import load_tokenizer
    from layercut.compress.options import torch_dtype
    from layercut.compress.quant.format.stream import write_block_fn, write_rest
    from layercut.compress.quant.search.mixed_stream import StreamedOutputs

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
                                 after_block=write_block_fn(lazy, writer, save_dtype), **shared)
    extra = {"quantize.json": json.dumps(strip_volatile(report), indent=2, default=str) + "\n"}
    write_rest(lazy, result, writer, folder, save_dtype, extra)
    return report


def _run_shared(config: QuantizeConfig, source, path: Path, output, env: RunEnv, start: float) -> dict:
    """``run`` under torchrun: every process draws the same calibration set and checks that all agree
    (model, options, output, a hash of the calibration tokens), runs its share of the micro-batches
    through each block (Hessians gathered, :class:`layercut.compress.quant.solve.driver.HessianSet`) and
    solves identically; rank 0 alone writes the output (atomically), the others wait at a barrier."""
    from dataclasses import replace

    from layercut.calibrate.data import calibration_batch
    from layercut.compress.core.distributed import process_group, same_on_every_rank, tensor_digest
    from layercut.compress.core.save import atomic_dir
    from layercut.compress.io.models import load_model, load_tokenizer
    from layercut.compress.options import torch_dtype
    from layercut.compress.quant.format.checkpoint import write_quantized_into
    from layercut.compress.quant.format.stream import discard_block
    from layercut.compress.workflow.stages.base import load_streamed

    with process_group(resolve_device(config.device)) as group:
        tokenizer = load_tokenizer(path, env.trust_remote_code)
        calib = calibration_batch(tokenizer, config.text_sources(), samples=config.samples, seq_len=config.seq_len,
                                  seed=config.seed)
        group.check_agree("quantize", {"model": str(path), "options": config.model_dump_json(),
                                       "output": str(Path(output).resolve()),
                                       "calibration tokens": tensor_digest(calib.input_ids, calib.attention_mask)})
        with same_on_every_rank():
            reason = config.distributed_blocker()
            if reason is not None:
                raise LayercutError(f"quantize: {reason}")
        env = replace(env, progress=env.progress and group.rank == 0)
        lazy = load_streamed(path, config.dtype, env, config.whole_model, "quantize")
        if lazy is not None and group.rank == 0:
            with atomic_dir(output, env.overwrite) as tmp:
                report = _run_streamed(lazy, path, config, Path(tmp), env, group=group, calib=calib)
        elif lazy is not None:  # the same blocks, solved alike, written by rank 0 only
            _, report, _, _ = apply(lazy.model, tokenizer, config, config.seed, False, after_block=discard_block,
                                    group=group, calib=calib)
        else:
            net, tokenizer = load_model(path, dtype=torch_dtype(config.dtype, path),
                                        trust_remote_code=env.trust_remote_code)
            result, report, _, _ = apply(net, tokenizer, config, config.seed, env.progress, group=group, calib=calib)
            if group.rank == 0:
                extra = {"quantize.json": json.dumps(strip_volatile(report), indent=2, default=str) + "\n"}
                with atomic_dir(output, env.overwrite) as tmp:
                    write_quantized_into(net, tokenizer, result, Path(tmp), dtype=torch_dtype(config.save_dtype),
                                         extra_files=extra)
        group.barrier()  # the output exists (renamed into place by rank 0) when any process returns
    return {"model": str(source), "output": str(output), **report, "processes": group.world,
            "seconds": time.perf_counter() - start}


def _plot(alloc, folder: Path, config: QuantizeConfig, report: dict) -> None:
    from layercut.compress.quant.search.allocate import plot_allocation

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

    from layercut.compress.core.errors import format_error

    if isinstance(options.get("candidates"), tuple):
        options["candidates"] = list(options["candidates"])
    try:
        config = QuantizeConfig(**options)
    except ValidationError as exc:
        raise LayercutError(f"quantize: {format_error(exc)}") from None
    return run(config, model, output, RunEnv(overwrite=overwrite, progress=progress))
