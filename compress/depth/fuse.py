"""Fuse removed blocks into a neighbour with LaCo's layer merge, optionally calibrated.

Usage::

    from layercut.compress.depth.fuse import fuse_blocks
    report = fuse_blocks(model, [12, 13, 14])                   # LaCo, c = 1, in place
    report = fuse_blocks(model, [12, 13, 14], calib=calib)      # c per matrix, fitted on data

    layercut prune bundled:smollm2-135m -o out --drop 8 --select angular --fuse [--fuse-calibrate]

For a removed run a..b the base block l is the kept block just before it (a − 1), or just
after it (b + 1) when the run starts at block 0. Every linear weight (and bias) of l
becomes θ_l + c · Σ_k (θ_k − θ_l) over k = a..b (Yang et al. 2024, "LaCo", §3.2: RDSC layer
merge, c = 1); norms stay l's. Then a..b are removed.

Calibrated variant: one scalar c per linear matrix (q, k, v, o, gate, up, down …), chosen
by Adam to minimise the mean per-token cosine distance 1 − cos(fused block output, stream
after the last fused block) on real calibration tokens of up to ``fit_samples`` sequences.
Cosine, not squared error: the first token of every sequence carries "massive
activations" (on SmolLM2 ‖h‖ ≈ 24 000 after block 18 vs ≈ 150 elsewhere) that would own
a squared error, and the next block's norm sees directions. The search starts from
whichever of c = 0 (plain drop) and c = 1 (LaCo) fits better and keeps the best point seen,
so it never ends worse than both on this objective.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from layercut.calibrate.capture import BlockRun, run_blocks
from layercut.calibrate.data import CalibSet
from layercut.compress.core.arch import ArchSpec, arch_for
from layercut.compress.core.errors import LayercutError
from layercut.compress.depth.blocks import check_block_drop_supported, drop_blocks, validate_layers
from layercut.compress.depth.cores import laco_merge, runs_of


@dataclass
class FuseGroup:
    """Blocks ``first..last`` folded into block ``base`` with one coefficient per matrix."""

    first: int
    last: int
    base: int
    coeffs: dict[str, float] = field(default_factory=dict)
    loss_drop: float | None = None  # mean 1 − cos at c = 0 (plain drop)
    loss_laco: float | None = None  # c = 1
    loss_fused: float | None = None  # chosen c
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def plan_groups(layers: Sequence[int], num_layers: int) -> list[FuseGroup]:
    groups = []
    for first, last in runs_of(validate_layers(layers, num_layers)):
        base = first - 1 if first > 0 else last + 1
        if groups and groups[-1].base == base:
            raise LayercutError(
                f"blocks {groups[-1].first}..{groups[-1].last} and {first}..{last} would both fold into block "
                f"{base}; fuse them in two runs, or keep a block between them"
            )
        groups.append(FuseGroup(first, last, base))
    return groups


def _param_names(spec: ArchSpec, block: nn.Module) -> list[str]:
    """Names (relative to the block) of every linear's weight and bias."""
    names = []
    for name, module in spec.linears(block):
        names.append(f"{name}.weight")
        if getattr(module, "bias", None) is not None:
            names.append(f"{name}.bias")
    return names


def _matrix_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0]


class CoeffFitter:
    """Driver callback: keep the entry stream of each group, fit c when its exit block has run.

    Read-only on the stream, so it can share a ``run_blocks`` pass with other callbacks.
    Fills ``coeffs`` and the ``loss_*`` fields of the :class:`FuseGroup` objects it is given.
    """

    def __init__(self, groups: list[FuseGroup], blocks: nn.ModuleList, spec: ArchSpec, fit_samples: int = 8,
                 steps: int = 25, lr: float = 0.05):
        self.groups, self.blocks, self.spec = groups, blocks, spec
        self.entry = {min(g.first, g.base): g for g in groups}
        self.exit = {max(g.last, g.base): g for g in groups}
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.base_args: dict[int, list] = {}
        self.fit_samples, self.steps, self.lr = fit_samples, steps, lr

    def _take(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole micro-batches (their masks / rotary args are per batch) up to fit_samples rows."""
        out, count = [], 0
        for t in tensors:
            if count >= self.fit_samples:
                break
            out.append(t)
            count += t.shape[0]
        return out

    def __call__(self, run: BlockRun) -> None:
        for g in self.groups:
            if run.index == g.base:  # the fused block runs with the base block's masks / rotary
                self.base_args[g.base] = run.call_args
        if run.index in self.entry:
            g = self.entry[run.index]
            self.inputs[g.base] = [t.clone() for t in self._take(run.inputs)]
        if run.index in self.exit:
            g = self.exit[run.index]
            target = self._take(run.outputs())
            masks = self._take(run.masks)
            self._fit(g, self.inputs.pop(g.base), target, masks)

    def _fit(self, g: FuseGroup, inputs, targets, masks) -> None:
        start = time.perf_counter()
        block = self.blocks[g.base]
        names = _param_names(self.spec, block)
        params = dict(block.named_parameters())
        base = {n: params[n].detach() for n in names}
        diff = {n: laco_merge(base[n], [self.blocks[k].get_parameter(n).detach() for k in range(g.first, g.last + 1)], 1.0)
                - base[n] for n in names}
        matrices = sorted({_matrix_of(n) for n in names})
        call_args = self.base_args[g.base]

        def loss_at(c: torch.Tensor) -> torch.Tensor:
            over = {n: base[n] + c[matrices.index(_matrix_of(n))] * diff[n] for n in names}
            total, count = 0.0, 0
            for i, (h, target, mask) in enumerate(zip(inputs, targets, masks)):
                args, kwargs = call_args[i]
                out = functional_call(block, over, (h, *args), kwargs)
                out = out[0] if isinstance(out, (tuple, list)) else out
                cos = torch.nn.functional.cosine_similarity(out.float(), target.float(), dim=-1, eps=1e-8)
                err = (1.0 - cos)[mask.bool()]
                total = total + err.sum()
                count += err.numel()
            return total / max(count, 1)

        with torch.no_grad():
            zero, one = torch.zeros(len(matrices)), torch.ones(len(matrices))
            g.loss_drop, g.loss_laco = float(loss_at(zero)), float(loss_at(one))
        c = torch.nn.Parameter((one if g.loss_laco < g.loss_drop else zero).clone())
        best, best_loss = c.detach().clone(), min(g.loss_drop, g.loss_laco)
        opt = torch.optim.Adam([c], lr=self.lr)
        with torch.enable_grad():
            for _ in range(self.steps):
                loss = loss_at(c)
                if loss.item() < best_loss:
                    best, best_loss = c.detach().clone(), loss.item()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        g.coeffs = {m: float(v) for m, v in zip(matrices, best)}
        g.loss_fused = best_loss
        g.seconds += time.perf_counter() - start


@torch.no_grad()
def fuse_blocks(
    model: nn.Module,
    layers: Sequence[int],
    calib: CalibSet | None = None,
    fit_samples: int = 8,
    steps: int = 25,
    lr: float = 0.05,
    batch_size: int = 8,
    progress: bool = True,
) -> list[FuseGroup]:
    """Fold each run of ``layers`` into its base block (LaCo; calibrated c when ``calib``), drop them."""
    spec = arch_for(model)
    check_block_drop_supported(model)
    blocks = spec.layers_of(model)
    groups = plan_groups(layers, len(blocks))
    if calib is not None:
        fitter = CoeffFitter(groups, blocks, spec, fit_samples, steps, lr)
        run_blocks(model, calib, [fitter], batch_size=batch_size, progress=progress, desc="fuse:calibrate")
    return apply_fuse(model, groups)


@torch.no_grad()
def apply_fuse(model: nn.Module, groups: Sequence[FuseGroup]) -> list[FuseGroup]:
    """Merge every group into its base block (its ``coeffs``, else c = 1) and remove the groups' blocks."""
    spec = arch_for(model)
    blocks = spec.layers_of(model)
    for g in groups:
        start = time.perf_counter()
        base_block = blocks[g.base]
        names = _param_names(spec, base_block)
        if not g.coeffs:
            g.coeffs = {_matrix_of(n): 1.0 for n in names}
        for name in names:
            param = base_block.get_parameter(name)
            others = [blocks[k].get_parameter(name) for k in range(g.first, g.last + 1)]
            param.copy_(laco_merge(param, others, g.coeffs[_matrix_of(name)]))
        g.seconds += time.perf_counter() - start
    drop_blocks(model, [k for g in groups for k in range(g.first, g.last + 1)])
    return list(groups)
