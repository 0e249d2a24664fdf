"""The quantize stage: GPTQ (or RTN) with uniform bits, or (bits, group size) chosen per unit under a budget.

Run it::

    layercut quantize bundled:smollm2-135m -o q4 --bits 4 --group-size 64
    layercut quantize MODEL -o mix --avg-bits 3.5                       # default candidate pairs
    layercut quantize MODEL -o mix --avg-bits 3.5 --candidates 3g64,3g128,4g64,4ch,8ch
    layercut quantize UNTIED -o q4h8 --bits 4 --quantize-head 8g128       # + the untied head (quant/solve/head.py)
    layercut quantize MODEL --bits 4 --dry-run                          # the plan, one table; nothing written

    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.stages.quantize import quantize_model, run
    run(QuantizeConfig(bits=4), "bundled:smollm2-135m", "q4")
    model = quantize_model(model, tokenizer, QuantizeConfig(bits=4))   # in memory (weights fake-quantized)

Every run builds one :class:`~layercut.compress.quant.plan.QuantPlan` from the config and the model
(:func:`~layercut.compress.quant.plan.build_plan`: the resolved group size, each linear's (bits, group
size), the head, the solver's settings; checked before any work) and runs it with one executor,
:func:`execute`, into one of two sinks: :class:`MemorySink` (in place; :func:`quantize_model`
returns the model, :func:`run` writes it whole afterwards) or :class:`StreamSink` (a lazily loaded
model, each block written as it is quantized). ``--dry-run`` prints the plan instead;
``quantize.json`` (:func:`checkpoint_files`, its one writer) stores the executed plan, and
``layercut run --resume`` compares it with the plan of the resumed recipe (:func:`check_resume`).

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
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from layercut.calibrate.data import calibration_batch
from layercut.compress.core.devices import on_device, resolve_device
from layercut.compress.core.distributed import (
    Group,
    process_group,
    same_on_every_rank,
    tensor_digest,
    world_from_env,
)
from layercut.compress.core.errors import LayercutError, format_error
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.core.save import atomic_dir, check_output_dir
from layercut.compress.core.shards import ShardWriter
from layercut.compress.io.models import load_model, load_tokenizer, resolve_model
from layercut.compress.options import torch_dtype
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.quant.format.checkpoint import (
    discard_block,
    write_block_fn,
    write_quantized_into,
    write_rest,
)
from layercut.compress.quant.format.result import QuantizeResult
from layercut.compress.quant.plan import QuantPlan, build_plan, plan_from_facts
from layercut.compress.quant.search.allocate import Allocation, candidate_label, plot_allocation
from layercut.compress.quant.search.mixed_run import quantize_mixed
from layercut.compress.quant.search.mixed_stream import StreamedOutputs
from layercut.compress.quant.solve.driver import quantize_model as quantize_linears
from layercut.compress.workflow.stages.base import RunEnv, load_streamed, strip_volatile

log = logging.getLogger("layercut.quantize")


# ------------------------------------------------------------------ the executor


@dataclass
class Executed:
    """What :func:`execute` did."""

    plan: QuantPlan  # every linear's pair known: for avg_bits, the pairs that are written
    result: QuantizeResult  # what is written (for avg_bits: the mixed allocation, or the uniform baseline)
    report: dict
    alloc: Allocation | None  # avg_bits, when the mixed allocation is written; else None
    allocation: str | None  # allocation.json's text (avg_bits)


class MemorySink:
    """Quantize in memory: each linear's weight becomes its dequantized weight in place (the model
    stays a plain model whose forward is what the checkpoint decodes to). :meth:`write` writes the
    quantized model into a checkpoint folder afterwards (the whole-model path of :func:`run`)."""

    stream = None

    def after_block(self):
        return None

    def write(self, executed: Executed, net, tokenizer, folder: Path, config: QuantizeConfig) -> None:
        write_quantized_into(net, tokenizer, executed.result, folder, dtype=torch_dtype(config.save_dtype),
                             extra_files=checkpoint_files(executed))
        _plot(executed, folder, config)


class StreamSink:
    """Stream into a checkpoint: one decoder block of a lazily loaded model in memory, written (and
    freed) as soon as it is quantized; :meth:`write` adds the rest once all blocks are done. Uniform
    bits write one checkpoint; ``avg_bits`` the mixed and uniform candidates as they go
    (:class:`~layercut.compress.quant.search.mixed_stream.StreamedOutputs`), keeping the one the run
    writes. ``folder`` None: the blocks are quantized alike and dropped (torchrun ranks other than 0)."""

    def __init__(self, lazy, folder: Path | None, config: QuantizeConfig):
        self.lazy, self.folder, self.config = lazy, folder, config
        self.save_dtype = torch_dtype(config.save_dtype)
        mixed = config.avg_bits is not None
        self.stream = StreamedOutputs(lazy, folder, self.save_dtype) if mixed and folder is not None else None
        self.writer = ShardWriter(folder, "2GB", always_index=True) if not mixed and folder is not None else None

    def after_block(self):
        if self.folder is None:
            return discard_block
        return None if self.writer is None else write_block_fn(self.lazy, self.writer, self.save_dtype)

    def write(self, executed: Executed) -> None:
        if self.folder is None:
            return
        files = checkpoint_files(executed)
        if self.stream is None:
            write_rest(self.lazy, executed.result, self.writer, self.folder, self.save_dtype, files)
            return
        self.stream.keep(executed.report["written"])
        for name, text in files.items():
            (self.folder / name).write_text(text)
        _plot(executed, self.folder, self.config)


def execute(plan: QuantPlan, net, tokenizer, config: QuantizeConfig, sink: MemorySink | StreamSink,
            progress: bool = True, group: Group | None = None, calib=None) -> Executed:
    """The one executor: quantize ``net`` in place as ``plan`` says (uniform bits: one pass at the
    plan's pairs; ``avg_bits``: the sensitivity pass, the allocation, the quantize passes and the
    fallback check, :func:`~layercut.compress.quant.search.mixed_run.quantize_mixed`), handing each
    quantized block to ``sink``. ``plan`` is :func:`~layercut.compress.quant.plan.build_plan`'s for
    ``config`` and ``net``. ``group`` (under torchrun, uniform bits only): this process's place;
    ``calib``: the calibration set already drawn (the same on every rank), else drawn here.
    """
    device = resolve_device(config.device)
    s, gs = plan.solver, plan.group_size
    sym = "symmetric" if s.sym else "asymmetric"
    report: dict = {"method": s.method, "group_size": gs, "group_size_from": plan.group_size_from,
                    "sym": s.sym, "act_order": s.act_order, "static_groups": s.static_groups,
                    "group_aware": s.group_aware, "sequential": s.sequential, "damp": s.damp,
                    "solve_dtype": s.solve_dtype, "scale_search": s.scale_search,
                    **({"scale_grid": [s.scale_min, s.scale_steps], "scale_bounds": s.scale_bounds}
                       if s.scale_search != "none" else {}),
                    "refit_scales": s.refit_scales,
                    **({"block_tune": {"steps": s.tune.steps, "batch": s.tune.batch, "lr": s.tune.lr,
                                       "scale_lr": s.tune.scale_lr, "target": s.tune.target, "loss": s.tune.loss}}
                       if s.tune is not None else {}),
                    "calib": config.text_label(), "samples": config.samples, "seq_len": config.seq_len}
    if plan.avg_bits is not None:
        mixed_run = quantize_mixed(net, tokenizer, config, plan, config.seed, device, progress, sink.stream)
        report.update(mixed_run.report)
        if mixed_run.result.tune_reports:
            report["block_tune"].update(tune_summary(mixed_run.result.tune_reports))
        return Executed(plan.with_pairs(mixed_run.result.configs()), mixed_run.result, report, mixed_run.alloc,
                        json.dumps(strip_volatile(mixed_run.allocation), indent=2) + "\n")
    if calib is None:
        calib = calibration_batch(tokenizer, config.text_sources(), samples=config.samples, seq_len=config.seq_len,
                                  seed=config.seed)
    result = quantize_linears(net, calib if s.method == "gptq" else None, s, plan.pairs(),
                              batch_size=config.batch_size, device=device, progress=progress,
                              after_block=sink.after_block(), head=plan.head, group=group)
    report.update(bits=plan.bits, avg_bits=result.avg_bits(), quantize_seconds=result.seconds,
                  solve_seconds=result.solve_seconds, linears=len(result.body()), tokens=result.tokens,
                  bits_per_layer={"all linears": plan.bits},
                  description=f"{s.method.upper()}{' + block tuning' if s.tune else ''} ({sym}, group "
                              f"size {gs}), {plan.bits} bits,")
    if result.tune_reports:
        report["block_tune"].update(tune_summary(result.tune_reports))
    if plan.head is not None:  # the report and the card say the head is quantized, and how
        q = result.layers[result.head]
        head = {"module": plan.output_head.name, "bits": plan.head[0], "group_size": plan.head[1],
                "avg_bits": q.stored_bits / (q.in_features * q.out_features)}
        label = candidate_label(plan.head)
        report.update(head=head, bits_per_layer={"all linears": plan.bits, result.head: label},
                      description=f"{s.method.upper()} ({sym}, group size {gs}), {plan.bits} bits; "
                                  f"output head {result.head} {label} ({head['avg_bits']:.2f} bits per "
                                  "weight); decoder blocks:")
    return Executed(plan, result, report, None, None)


def checkpoint_files(executed: Executed) -> dict[str, str]:
    """The stage's own files in the checkpoint (the one writer of ``quantize.json``): the report
    without timings and paths, plus the executed ``plan`` (:meth:`QuantPlan.to_dict`; a resumed run
    compares it, :func:`check_resume`); with ``avg_bits`` also ``allocation.json``."""
    report = {**strip_volatile(executed.report), "plan": executed.plan.to_dict()}
    files = {"quantize.json": json.dumps(report, indent=2, default=str) + "\n"}
    if executed.allocation is not None:
        files["allocation.json"] = executed.allocation
    return files


def tune_summary(reports: dict) -> dict:
    """What block tuning did, over all blocks: how many kept their tuned result, the block-output
    loss of what was kept / GPTQ's (geometric mean of the per-block ratios), the share of codes moved,
    and per block (in block order) that ratio (``block_ratios``; 1.0 where GPTQ's loss was 0)."""
    rs = [reports[k] for k in sorted(reports)]
    per_block = [min(r.loss_tuned, r.loss_gptq) / r.loss_gptq if r.loss_gptq > 0 else 1.0 for r in rs]
    ratios = [x for x, r in zip(per_block, rs) if r.loss_gptq > 0]
    return {"blocks_kept": sum(r.kept for r in rs), "blocks": len(rs),
            "loss_ratio": math.exp(sum(math.log(max(x, 1e-12)) for x in ratios) / max(1, len(ratios))),
            "codes_moved": sum(r.codes_changed for r in rs) / max(1, len(rs)),
            "block_ratios": [round(x, 4) for x in per_block]}


# ------------------------------------------------------------------ entry points


def quantize_model(model, tokenizer, config: QuantizeConfig, progress: bool = True):
    """Quantize an in-memory model: each linear's weight becomes its dequantized GPTQ weight (in place).

    The model stays a plain model whose forward is what the checkpoint would decode to;
    :func:`run` writes the packed checkpoint instead.
    """
    execute(build_plan(config, model), model, tokenizer, config, MemorySink(), progress)
    return model


@on_device
def run(config: QuantizeConfig, source: str | Path, output: str | Path | None, env: RunEnv | None = None) -> dict:
    """Quantize ``source`` into a GPTQ v1 checkpoint at ``output``; returns the report.

    Report: achieved average bits, per-unit bits, timings; ``quantize.json`` in the
    checkpoint holds the same minus timings and paths, plus the plan. ``env.dry_run``: build and
    return the plan (:meth:`QuantPlan.rows`), quantize nothing, write nothing (``output`` may be None).
    """
    env = env or RunEnv()
    with same_on_every_rank():  # under torchrun every process checks; rank 0 alone prints the error
        if output is not None or not env.dry_run:
            check_output_dir(output, env.overwrite)
        path = resolve_model(source)
        if is_quantized(path):
            raise LayercutError(f"quantize: {path} is already quantized (config.json has a quantization_config); "
                                "quantize the dense original")
    start = time.perf_counter()
    if env.dry_run:
        return _dry_run(config, path, source, output, env, start)
    if world_from_env()[1] > 1:  # torchrun: data-parallel calibration (docs/architecture.md)
        return _run_shared(config, source, path, output, env, start)
    streamable = config.avg_bits is None or config.sensitivity != "kl"  # the exact KL needs the whole model
    lazy = load_streamed(path, config.dtype, env, config.whole_model or not streamable, "quantize")
    if lazy is not None:  # one block in memory: quantized, written and freed at its turn
        tokenizer = load_tokenizer(path, env.trust_remote_code)
        with atomic_dir(output, env.overwrite) as tmp:
            executed = _stream_into(lazy, tokenizer, config, Path(tmp), env.progress)
    else:
        net, tokenizer = load_model(path, dtype=torch_dtype(config.dtype, path),
                                    trust_remote_code=env.trust_remote_code)
        sink = MemorySink()
        executed = execute(build_plan(config, net), net, tokenizer, config, sink, env.progress)
        with atomic_dir(output, env.overwrite) as tmp:
            sink.write(executed, net, tokenizer, Path(tmp), config)
    return {"model": str(source), "output": str(output), **executed.report, "seconds": time.perf_counter() - start}


def _stream_into(lazy, tokenizer, config: QuantizeConfig, folder: Path | None, progress: bool,
                 group: Group | None = None, calib=None) -> Executed:
    """GPTQ or RTN over a lazily loaded model, written block by block into ``folder`` (None: not
    written); ``group`` and ``calib`` under torchrun (uniform bits)."""
    sink = StreamSink(lazy, folder, config)
    executed = execute(build_plan(config, lazy.model), lazy.model, tokenizer, config, sink, progress, group, calib)
    sink.write(executed)
    return executed


def _run_shared(config: QuantizeConfig, source, path: Path, output, env: RunEnv, start: float) -> dict:
    """``run`` under torchrun: every process draws the same calibration set and checks that all agree
    (model, options, output, a hash of the calibration tokens), runs its share of the micro-batches
    through each block (Hessians gathered, :class:`layercut.compress.quant.solve.driver.HessianSet`) and
    solves identically; rank 0 alone writes the output (atomically), the others wait at a barrier."""
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
                executed = _stream_into(lazy, tokenizer, config, Path(tmp), env.progress, group, calib)
        elif lazy is not None:  # the same blocks, solved alike, written by rank 0 only
            executed = _stream_into(lazy, tokenizer, config, None, False, group, calib)
        else:
            net, tokenizer = load_model(path, dtype=torch_dtype(config.dtype, path),
                                        trust_remote_code=env.trust_remote_code)
            sink = MemorySink()
            executed = execute(build_plan(config, net), net, tokenizer, config, sink, env.progress, group, calib)
            if group.rank == 0:
                with atomic_dir(output, env.overwrite) as tmp:
                    sink.write(executed, net, tokenizer, Path(tmp), config)
        group.barrier()  # the output exists (renamed into place by rank 0) when any process returns
    return {"model": str(source), "output": str(output), **executed.report, "processes": group.world,
            "seconds": time.perf_counter() - start}


def _dry_run(config: QuantizeConfig, path: Path, source, output, env: RunEnv, start: float) -> dict:
    """The plan a run would execute, as one table (:meth:`QuantPlan.rows`); nothing is quantized or
    written. The model is read lazily where it can be (names and shapes only), else whole."""
    lazy = load_streamed(path, config.dtype, env, False, "quantize")
    if lazy is not None:
        model = lazy.model
    else:
        model, _ = load_model(path, dtype=torch_dtype(config.dtype, path), trust_remote_code=env.trust_remote_code)
    plan = build_plan(config, model)
    log.info("quantize (dry run): %s", plan.rows())
    return {"dry_run": True, **plan.rows(), "source": str(source), "output": None if output is None else str(output),
            "seconds": round(time.perf_counter() - start, 3)}


def check_resume(config, checkpoint: Path) -> None:
    """``layercut run --resume`` over a finished quantize stage whose checkpoint is ``checkpoint``:
    the plan of ``config`` (the resumed recipe's stage) on the model facts stored with the written
    plan must equal that plan, else one :class:`LayercutError` names the first difference. Nothing is
    loaded but ``quantize.json``; a checkpoint written without a plan is not checked here."""
    if not isinstance(config, QuantizeConfig):
        return
    try:
        stored = json.loads((Path(checkpoint) / "quantize.json").read_text()).get("plan")
    except (OSError, ValueError):
        return
    if stored is None:
        return
    old = QuantPlan.from_dict(stored)
    diff = old.difference(plan_from_facts(config, old.facts()))
    if diff is not None:
        raise LayercutError(f"--resume: the quantize plan differs from the one {checkpoint} was written with "
                            f"({diff}); use a new output folder")


def _plot(executed: Executed, folder: Path, config: QuantizeConfig) -> None:
    """``allocation.png`` beside the checkpoint's files when the mixed allocation is written."""
    alloc, report = executed.alloc, executed.report
    if alloc is None:
        return
    plot_allocation(alloc, folder / "allocation.png",
                    title=f"{config.unit} bits (colour: group size), budget {config.avg_bits} → {alloc.avg_bits:.3f} "
                          f"avg bits (sensitivity: {config.sensitivity})")
    report["checkpoint_plot"] = "allocation.png"  # travels inside the checkpoint (export keeps it)


def quantize_checkpoint(model: str | os.PathLike, output: str | os.PathLike | None, *, overwrite: bool = False,
                        progress: bool = True, dry_run: bool = False, **options) -> dict:
    """Quantize ``model`` (dir, .gguf or bundled:NAME) into a GPTQ v1 checkpoint at ``output``.

    ``options`` are :class:`QuantizeConfig`'s: exactly one of
    ``bits`` (uniform) or ``avg_bits`` (allocated, overhead included), ``group_size``, ...
    Returns a JSON-able report (achieved average bits, per-unit bits, timings). ``dry_run``:
    return the plan and write nothing (``output`` may then be None).
    """
    if isinstance(options.get("candidates"), tuple):
        options["candidates"] = list(options["candidates"])
    try:
        config = QuantizeConfig(**options)
    except ValidationError as exc:
        raise LayercutError(f"quantize: {format_error(exc)}") from None
    return run(config, model, output, RunEnv(overwrite=overwrite, progress=progress, dry_run=dry_run))
