"""GPTQ over a whole model, block by block on the capture driver (the stage wrapper).

Run it::

    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.plan import solver_settings
    from layercut.compress.quant.solve.driver import quantize_model
    cfg = solver_settings(QuantizeConfig(bits=4, group_size=64))  # the stage's defaults (asym, GPTQ, damp 0.01)
    result = quantize_model(model, calib, cfg, bits={"model.layers.3.mlp.down_proj": 8})
    result = quantize_model(model, calib, cfg, bits={"model.layers.3.mlp.down_proj": (3, -1)})  # (bits, gs)
    result.layers["model.layers.0.self_attn.q_proj"].tensors    # packed GPTQ v1 tensors

or ``layercut quantize MODEL -o OUT --bits 4`` (the stage, compress/workflow/stages/quantize.py, runs
a :class:`layercut.compress.quant.plan.QuantPlan`: its ``solver`` and per-linear pairs come here).

Each decoder block's turn in :func:`layercut.calibrate.capture.run_blocks`: hooks on the first
linear of each fused group ({q,k,v}, o, {gate,up}, down — they share an input) fold
the masked inputs into one Hessian H = 2/N Σ x xᵀ per group, every linear of the group
is quantized with :func:`layercut.compress.quant.solve.gptq.gptq_quantize`, its weight is replaced *in
place* by the dequantized weight (so the model stays a plain, fast model whose forward
is exactly what a checkpoint decodes to), and ``run.invalidate()`` makes the next block
see the quantized block's outputs (Frantar et al. 2022, §4 "sequential").

``sequential`` picks how often the Hessians are re-collected inside a block:
``"block"`` (one pass: all four groups see the block's float inputs), ``"sublayer"``
(attention, then MLP with inputs from the quantized attention) or ``"linear"`` (the
reference "true sequential": qkv, o, gate_up, down each after the previous is quantized,
4 passes). Each pass is a full block forward over the calibration set, which is what
dominates wall time on CPU; see docs/results/quant.md for the measured trade-off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from layercut.calibrate.capture import BlockRun, first_tensor, run_blocks
from layercut.calibrate.data import CalibSet
from layercut.compress.core.arch import ArchSpec, arch_for, get_submodule, target_linears
from layercut.compress.core.distributed import Group
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.io.lazy import lazy_of, trim_heap
from layercut.compress.quant.format.pack import pack_gptq
from layercut.compress.quant.format.qlinear import QuantLinear
from layercut.compress.quant.format.result import SUPPORTED_BITS, QuantizedLinear, QuantizeResult
from layercut.compress.quant.solve.block_tune import BlockTune, tune_block
from layercut.compress.quant.solve.gptq import QuantResult, hessian_update
from layercut.compress.quant.solve.head import check_head, head_hessian, quantize_head
from layercut.compress.quant.solve.linear import (  # noqa: F401  (solve_group, solve: re-exported)
    check_finite,
    linear_weight,
    set_weight,
    solve,
    solve_group,
    solver_threads,
)
from layercut.compress.quant.solve.settings import SolverConfig, pick_group_size

SEQUENTIAL = {"block": ((0, 1, 2, 3),), "sublayer": ((0, 1), (2, 3)), "linear": ((0,), (1,), (2,), (3,))}
GROUP_LABELS = ("qkv", "o", "gate_up", "down")


def is_quantized_model(model: nn.Module) -> bool:
    """True if ``model`` already holds GPTQ (or other) quantized layers / config."""
    return is_quantized(model) or any(hasattr(m, "qweight") for m in model.modules())


def linear_plan(
    cfg: SolverConfig, bits: Mapping[str, int | tuple[int, int]] | None, names
) -> dict[str, tuple[int, int]]:
    """(bits, group size) of each of ``names``: ``bits[name]`` (a width, at ``cfg.group_size``,
    or a pair), else (``cfg.bits``, ``cfg.group_size``)."""
    bits = bits or {}
    out = {}
    for name in names:
        v = bits.get(name, cfg.bits)
        out[name] = (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), cfg.group_size)
    return out


def _label(c: tuple[int, int]) -> str:
    return f"{c[0]}-bit per channel" if c[1] == -1 else f"{c[0]}-bit g{c[1]}"


def auto_group_size(model: nn.Module) -> int:
    """The default group size for ``model``: 128 (the GPTQ convention) where it divides every
    quantized linear's input size, else the largest of 64, 32 that does, else -1 (one per row)."""
    spec = arch_for(model)
    return pick_group_size(linear_weight(module, spec.conv1d).shape[1] for _, _, _, module in target_linears(model, spec))


def check_model(
    model: nn.Module, cfg: SolverConfig, bits: Mapping[str, int | tuple[int, int]] | None = None
) -> list[tuple[int, int, str, nn.Module]]:
    """Validate everything quantization needs before any work; return the target linears.

    ``bits`` maps linear names to a width (at ``cfg.group_size``) or a (bits, group size)
    pair. Refuses: an already-quantized model; bits outside {2,3,4,8} (default or per
    layer); per-layer entries naming no target linear; fused projections with different
    configurations; a group size that does not divide its linear's in_features (no silent
    per-layer fallback: pick a divisor, or -1); weights with NaN/Inf.
    """
    if is_quantized_model(model):
        raise LayercutError("quantize: the model is already quantized (it has a quantization_config or "
                            "quantized layers); quantize the dense original instead")
    spec = arch_for(model)
    targets = target_linears(model, spec)
    names = {name for _, _, name, _ in targets}
    for name in bits or {}:
        if name not in names:
            raise LayercutError(f"quantize: per-layer bits name '{name}', which is not a quantizable linear")
    plan = linear_plan(cfg, bits, [name for _, _, name, _ in targets])
    for name, (b, gs) in plan.items():
        if b not in SUPPORTED_BITS:
            raise LayercutError(f"quantize: bits for {name} must be one of {SUPPORTED_BITS}, got {b}")
        if gs != -1 and gs <= 0:
            raise LayercutError(f"quantize: group size for {name} must be -1 or positive, got {gs}")
    group_cfg: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for i, g, name, _ in targets:
        group_cfg.setdefault((i, g), set()).add(plan[name])
    for (i, g), pairs in group_cfg.items():
        if len(pairs) > 1:
            widths = sorted({b for b, _ in pairs})
            what = f"bits {widths}" if len(widths) > 1 else f"configurations {sorted(map(_label, pairs))}"
            raise LayercutError(f"quantize: layer {i}: {', '.join(spec.groups[g])} get {what}; "
                                "projections that servers fuse must share one bit width and group size")
    for _, _, name, module in targets:
        if not hasattr(module, "weight") or module.weight.dim() != 2:
            raise LayercutError(f"quantize: {name} is not a dense linear layer ({type(module).__name__})")
        in_f = linear_weight(module, spec.conv1d).shape[1]
        gs = plan[name][1]
        if gs != -1 and in_f % gs:
            raise LayercutError(
                f"quantize: group size {gs} does not divide in_features={in_f} of {name}; "
                f"use a divisor of every layer's input size or -1"
            )
        if not module.weight.is_meta:  # a streamed model's blocks are checked at their turn
            check_finite(module.weight, name)
    return targets



def _apply_group(items, Ws: list[Tensor], parts: list[QuantResult], conv1d: bool, result: QuantizeResult) -> None:
    """Each linear of a solved group takes its dequantized weight; its packed tensors go to ``result``."""
    for (name, module), W, res in zip(items, Ws, parts):
        set_weight(module, res.dequant, conv1d)
        result.layers[name] = _record(name, res, W)


def _record(name: str, res: QuantResult, W: Tensor) -> QuantizedLinear:
    with solver_threads(torch.device("cpu")):
        packed = pack_gptq(res.q.cpu(), res.zeros.cpu(), res.scales.cpu(), res.g_idx.cpu(), res.bits)
    stored = sum(t.numel() * t.element_size() * 8 for k, t in packed.items() if k != "g_idx")
    return QuantizedLinear(name, res.bits, res.group_size, W.shape[1], W.shape[0], packed, res.loss, res.damp_used,
                           stored)


class HessianSet:
    """Running Hessians of the inputs of some groups of one block, filled by forward hooks.

    Each micro-batch's 2/m Σ x xᵀ is computed in float32 (the costly product, [in, in])
    and merged into a float64 running mean, so N never limits precision.

    Under torchrun (``group``, with ``rounds`` = micro-batches of rank 0) each process runs its own
    micro-batches (global k = round·W + rank); after every round the W micro-batch Hessians are
    all-gathered and every process folds them in global order k, exactly as one process folds
    its micro-batches one after another: the same float32 products, merged in the same order, so
    the Hessians (and the solves) are bit-identical to a single process's.
    """

    def __init__(self, run: BlockRun, groups: tuple[int, ...], group: Group | None = None, rounds: int = 0):
        self.run, self.groups = run, groups
        self.H: dict[int, Tensor | None] = {g: None for g in groups}
        self.n: dict[int, int] = {g: 0 for g in groups}
        self.group, self.rounds = group, rounds
        self.pending: dict[int, tuple[Tensor, int]] = {}  # this round's micro-batch Hessian per group

    def hooks(self) -> dict:
        return {self.run.spec.groups[g][0]: self._hook(g) for g in self.groups}

    def _hook(self, g: int):
        def fn(i: int, x: Tensor, _y: Tensor) -> None:
            Hb, m = hessian_update(None, 0, x.float(), self.run.masks[i], dtype=torch.float32)
            if self.group is not None:  # folded with the other ranks' at the end of the round
                self.pending[g] = (Hb, m)
                return
            self._fold(g, Hb, m)

        return fn

    def _fold(self, g: int, Hb: Tensor, m: int) -> None:
        if m == 0:
            return
        n = self.n[g]
        if self.H[g] is None:
            self.H[g] = Hb.double()
        else:  # H·n/(n+m) + Hb·m/(n+m), in place: no float64 copy of Hb
            self.H[g].mul_(n / (n + m)).add_(Hb, alpha=m / (n + m))
        self.n[g] = n + m

    def collect(self) -> None:
        if self.group is None:
            self.run.forward(hooks=self.hooks())
            return
        self.run.forward(hooks=self.hooks(), after_each=lambda _i: self._exchange())
        for _ in range(self.rounds - len(self.run.inputs)):  # ranks with one micro-batch fewer: empty rounds
            self._exchange()

    def _exchange(self) -> None:
        """End of a round: every rank's pending micro-batch Hessian, folded in rank (= global) order."""
        group, spec = self.group, self.run.spec
        counts = group.all_gather(torch.tensor([self.pending.get(g, (None, 0))[1] for g in self.groups]))
        for j, g in enumerate(self.groups):
            Hb = self.pending.pop(g, (None, 0))[0]
            ms = [int(c[j]) for c in counts]
            if not any(ms):
                continue
            if Hb is None:  # no tokens here this round: a placeholder of the right shape
                n_in = linear_weight(get_submodule(self.run.block, spec.groups[g][0]), spec.conv1d).shape[1]
                Hb = torch.zeros(n_in, n_in, dtype=torch.float32, device=group.device)
            for Hr, m in zip(group.all_gather(Hb), ms):
                self._fold(g, Hr.to(Hb.device), m)

    def take(self, g: int, where: str) -> list[Tensor]:
        """Group g's Hessian as a one-element list the set no longer references (for
        ``solve_group(..., overwrite_h=True)``, which may then free it)."""
        H = self.get(g, where)
        self.H[g] = None
        return [H]

    def get(self, g: int, where: str) -> Tensor:
        H = self.H[g]
        if H is None or self.n[g] == 0:
            raise LayercutError(f"quantize: no calibration tokens reached {where} (all padding?)")
        if not torch.isfinite(H.sum()):
            raise LayercutError(f"quantize: the Hessian of {where} has NaN/Inf (non-finite activations: "
                                "check the model in float32 and the calibration data)")
        return H


# ------------------------------------------------------------------------- driver


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    calib: CalibSet | None,
    cfg: SolverConfig,
    bits: Mapping[str, int | tuple[int, int]] | None = None,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    after_block: Callable[[BlockRun, QuantizeResult], None] | None = None,
    probe: Callable[[list[str], list[Tensor], Tensor], None] | None = None,
    head: tuple[int, int] | None = None,
    group: Group | None = None,
) -> QuantizeResult:
    """Quantize every target linear of ``model`` in place (weights ← dequantized GPTQ weights).

    ``bits`` maps full linear names (``model.layers.3.mlp.down_proj``) to their bit width
    (at ``cfg.group_size``) or to a (bits, group size) pair; the rest get (``cfg.bits``,
    ``cfg.group_size``). Fused projections must share one pair. ``calib`` [N, L] tokens drive the Hessians (not needed for
    RTN). ``device``: where each block runs and is solved (e.g. ``"cuda"``; default: the
    model's device). Returns the packed tensors of each linear for
    :func:`layercut.compress.quant.format.checkpoint.save_quantized`. ``after_block(run)`` is called once
    each block is quantized (GPTQ and RTN): a streamed run writes the block there and frees
    its packed tensors from ``result``. ``probe(names, Ws, H)`` (GPTQ only) sees each fused
    group's float weights and Hessian just before their solve and must leave both unchanged
    (:mod:`layercut.compress.quant.search.refine` re-solves other candidates there). ``head`` = (bits,
    group size) also quantizes the untied output head after the last block
    (:mod:`layercut.compress.quant.solve.head`). ``group`` (under torchrun, :mod:`layercut.compress.core.distributed`):
    this process runs its share of ``calib``'s micro-batches (``group.shard_rows``), the Hessians are
    gathered and folded in the single-process order (:class:`HessianSet`), and every process solves
    every linear identically; ``calib`` must be the same on every rank.
    """
    targets = check_model(model, cfg, bits)
    if head is not None:
        check_head(model, *head)
    plan = linear_plan(cfg, bits, [name for _, _, name, _ in targets])
    spec = arch_for(model)
    result = QuantizeResult(config=cfg)
    start = time.perf_counter()

    if cfg.method == "rtn":
        _rtn_blocks(model, targets, plan, cfg, spec, result, device, progress, after_block)
        if head is not None:
            quantize_head(model, None, *head, cfg, result, device=device)
        result.seconds = time.perf_counter() - start
        return result

    if calib is None:
        raise LayercutError("quantize: GPTQ needs calibration data")
    rounds = 0
    if group is not None:
        if cfg.tune is not None or head is not None or probe is not None:
            raise LayercutError("quantize: block tuning, the head and probes do not run under torchrun")
        rows = group.shard_rows(calib.num_samples, batch_size)
        rounds = group.rounds(math.ceil(calib.num_samples / batch_size))
        calib = CalibSet(calib.input_ids[rows], calib.attention_mask[rows])
    by_block: dict[int, list[tuple[int, str, nn.Module]]] = {}
    for i, g, name, module in targets:
        by_block.setdefault(i, []).append((g, name, module))

    tuner = _BlockTuner(cfg.tune, result) if cfg.tune is not None else None

    def on_block(run: BlockRun) -> None:
        if tuner is not None:  # the float block's output, before any of its weights change
            tuner.start(run)
        for stage in SEQUENTIAL[cfg.sequential]:
            stage = tuple(g for g in stage if g < len(spec.groups))
            if not stage:
                continue
            hs = HessianSet(run, stage, group, rounds)
            hs.collect()
            for g in stage:
                items = [(name, module) for gg, name, module in by_block[run.index] if gg == g]
                box = hs.take(g, ", ".join(name for name, _ in items))  # the solve may overwrite H
                Ws = [linear_weight(module, spec.conv1d).detach() for _, module in items]
                for (name, _), W in zip(items, Ws):
                    check_finite(W, name)
                box[0] = box[0].to(Ws[0].device)
                if probe is not None:  # its solves are not counted in solve_seconds
                    probe([name for name, _ in items], Ws, box[0])
                t0 = time.perf_counter()
                b, gs = plan[items[0][0]]  # one pair per fused group (checked)
                parts = solve_group(Ws, box, b, replace(cfg, group_size=gs), overwrite_h=True)
                result.solve_seconds += time.perf_counter() - t0
                if tuner is not None:  # recorded once tuned
                    tuner.add(items, Ws, parts, spec.conv1d)
                else:
                    _apply_group(items, Ws, parts, spec.conv1d, result)
                del parts, Ws  # before the next group's solve: its codes and dequantized weights
                trim_heap()  # and the heap pages its [in, in] temporaries left behind
                result.tokens = hs.n[g]  # the Hessian was freed with the solve, before the next group's
        run.invalidate()  # the next block sees this block's quantized outputs
        if tuner is not None:
            tuner.finish(run, spec.conv1d)
            run.invalidate()

    callbacks = [on_block] + ([lambda run: after_block(run, result)] if after_block is not None else [])
    h_last = run_blocks(model, calib, callbacks, batch_size=batch_size, device=device, progress=progress,
                        desc="gptq")
    if head is not None:  # the head's input is norm(h_L) of the quantized blocks
        H, _ = head_hessian(model, h_last, [m.bool() for _, m in calib.split(batch_size)])
        del h_last
        quantize_head(model, H, *head, cfg, result, device=device)
    result.seconds = time.perf_counter() - start
    return result


class _BlockTuner:
    """Block-wise reconstruction inside the GPTQ block loop (:mod:`layercut.compress.quant.solve.block_tune`):
    the float block's output is the target, the block's solved linears are tuned once all are solved,
    then set and recorded. With ``target="float"`` it carries the float model's own stream."""

    def __init__(self, cfg: BlockTune, result: QuantizeResult):
        self.cfg, self.result = cfg, result
        self.float_stream: list[Tensor] | None = None
        self.targets: list[Tensor] = []
        self.solved: list[tuple[str, nn.Module, Tensor, QuantResult]] = []

    def start(self, run: BlockRun) -> None:
        if self.cfg.target == "quantized":
            self.targets = run.outputs()
            run.invalidate()
            return
        if self.float_stream is None:  # block 0: both streams are the embeddings
            self.float_stream = run.inputs
        self.targets = [first_tensor(run.block(x, *a, **k))
                        for x, (a, k) in zip(self.float_stream, run.call_args)]
        self.float_stream = self.targets

    def add(self, items, Ws: list[Tensor], parts: list[QuantResult], conv1d: bool) -> None:
        for (name, module), W, res in zip(items, Ws, parts):
            set_weight(module, res.dequant, conv1d)  # the later groups' Hessians see it quantized
            self.solved.append((name, module, torch.empty(W.shape, device="meta"), _compact(res)))

    def finish(self, run: BlockRun, conv1d: bool) -> None:
        paths = {id(m): p for p, m in run.block.named_modules()}
        solved = {paths[id(module)]: (res, getattr(module, "bias", None)) for _, module, _, res in self.solved}
        tuned, report = tune_block(run.block, run.call, self.targets, run.masks, solved, self.cfg, release=True)
        for name, module, W, _ in self.solved:
            res = tuned[paths[id(module)]]
            set_weight(module, res.dequant, conv1d)  # released while the block trained: refilled
            self.result.layers[name] = _record(name, replace(res, q=res.q.to(torch.int32)), W)
        self.result.tune_reports[run.index] = report
        self.solved, self.targets = [], []


def _compact(res: QuantResult) -> QuantResult:
    """What the tuner keeps of a solved linear until its block is tuned: codes as uint8, the rounding
    residual as float16 (the tuner's own dtypes, so :class:`TunedLinear` shares them) and no dense
    weight (the module holds it) — 3 bytes a weight instead of 12, which a 3B block's 100M weights need."""
    small = res.bits <= 8
    return replace(res, q=res.q.to(torch.uint8) if small else res.q, dequant=res.dequant.new_empty(0),
                   residual=None if res.residual is None else res.residual.to(torch.float16))


def _rtn_blocks(model, targets, plan, cfg: SolverConfig, spec: ArchSpec, result: QuantizeResult, device,
                progress: bool, after_block) -> None:
    """Round-to-nearest, block by block: no forwards. A streamed model's block is read for its
    turn, quantized, handed to ``after_block`` (which writes it) and released."""
    lazy = lazy_of(model)
    by_block: dict[int, list[tuple[str, nn.Module]]] = {}
    for i, _, name, module in targets:
        by_block.setdefault(i, []).append((name, module))
    for i in tqdm(sorted(by_block), desc="rtn", disable=not progress, unit="block"):
        block = lazy.block(i) if lazy is not None else spec.layers_of(model)[i]
        try:
            for name, module in by_block[i]:
                W = linear_weight(module, spec.conv1d).detach()
                check_finite(W, name)
                dev = torch.device(device) if device is not None else W.device
                t0 = time.perf_counter()
                b, gs = plan[name]
                res = solve(W.to(dev), None, b, replace(cfg, group_size=gs))
                result.solve_seconds += time.perf_counter() - t0
                set_weight(module, res.dequant.to(W.device), spec.conv1d)
                result.layers[name] = _record(name, res, W)
                del res
            if after_block is not None:
                after_block(SimpleNamespace(index=i, block=block), result)
        finally:
            if lazy is not None:
                lazy.release(lazy.block_path(i))


def to_quant_linears(model: nn.Module, result: QuantizeResult) -> nn.Module:
    """Swap each quantized linear of ``model`` for a :class:`~layercut.compress.quant.format.qlinear.QuantLinear`
    holding its packed tensors (the model then runs the GPTQ op; weights are freed)."""
    # QuantLinear computes x @ Wᵀ with W [out, in]: the same map as a GPT-2 Conv1D's x @ weight
    for name, ql in result.layers.items():
        module = model.get_submodule(name)
        new = QuantLinear(ql.in_features, ql.out_features, ql.bits, ql.group_size,
                          bias=module.bias is not None, device="meta")
        state = dict(ql.tensors)
        if module.bias is not None:
            state["bias"] = module.bias.detach().to(torch.float16)
        dev = module.weight.device
        new.load_state_dict({k: v.to(dev) for k, v in state.items()}, assign=True)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model

