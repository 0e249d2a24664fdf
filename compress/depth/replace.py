"""Linear replacement (ReplaceMe): drop spans of blocks, fold a linear map into the block before.

Usage::

    from layercut.compress.depth.replace import linear_replace
    fits = linear_replace(model, [12, 13, 14, 15, 16, 17, 25, 26], calib, method="lstsq")
    # model is now 8 blocks shorter; blocks 11 and 24 carry the maps in their down_proj
    [f.to_dict() for f in fits]        # per span: tokens, relative error of drop vs map

    layercut prune bundled:smollm2-135m -o out --drop 8 --select block-influence --replace lstsq

For a removed run of blocks i+1 … i+n (Shopkhoev et al. 2025, §3): M = what block i's MLP
adds to the residual stream, Y = h_{i+1} − M (block i's output without it), L = h_{i+n+1}
(the output of the run's last block). T = argmin ‖M T − (L − Y)‖ then
``down_proj.weight ← Tᵀ · down_proj.weight`` (bias ← b T), so block i outputs Y + M T ≈ L:
a standard checkpoint with no extra parameters. Only valid where nothing sits between the
MLP output and the residual add: Gemma2/3 (post-feedforward norm) are refused.

``lstsq``: T = (MᵀM + αI)⁻¹ Mᵀ(L − Y) from float64 Gram sums over every real (non-pad) token.

``cosine``: Adam from T = I on Σ_t 1 − cos(Y_t + M_t T, L_t), the direction of the block
output itself (the paper's unsimplified objective), on at most ``max_rows`` tokens sampled
uniformly from the real tokens (memory: 3 · max_rows · D floats; default 16384). The
simplification cos(M_t T, (L − Y)_t) (``cosine_target="residual"``) is scale-free per token
and cannot reproduce the "massive activation" of each sequence's first token (on SmolLM2
‖L − Y‖ ≈ 24 000 there vs ≈ 110 elsewhere): on the angular span 11–18 it ends far *worse*
than plain drop (held-out ppl 4843 vs 263), while the output objective reaches 186 and
lstsq 178. Even the output objective only ties plain drop on block influence's spans
(87.9 vs 86.2; lstsq 64.2): per-token cosine is blind to the sink token's magnitudes — on
span 12–17, where plain drop leaves a relative squared error of only 0.004, the cosine map
raises it to 0.017. Prefer ``lstsq``.

Every span gets its own map, all in ONE pass of :func:`layercut.calibrate.capture.run_blocks`;
M and Y are held from block i until block i+n's output arrives (2 activation sets per open
span). ``stream="original"`` fits every map on the unmodified model's activations;
``stream="sequential"`` (the default) hands Y + M T on as the stream after each span, so
later spans are fitted on the activations the pruned model will really produce. Measured on
SmolLM2 with block influence's spans 12–17 and 25–26 (benchmarks/depth.py): held-out ppl
63.4 vs 64.2 and KL 0.763 vs 0.775, sequential vs original; the second span's relative
squared error 0.22 vs 0.30. Same cost, so sequential is the default.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from layercut.calibrate.capture import BlockRun, run_blocks
from layercut.calibrate.data import CalibSet
from layercut.calibrate.stats import GramStats
from layercut.compress.core.arch import ArchSpec, arch_for, get_submodule
from layercut.compress.core.errors import LayercutError
from layercut.compress.depth.blocks import check_block_drop_supported, drop_blocks, validate_layers
from layercut.compress.depth.cores import (
    cosine_map,
    lstsq_map,
    mean_cosine_loss,
    merge_map_into_bias,
    merge_map_into_down,
    runs_of,
)

METHODS = ("lstsq", "cosine")
STREAMS = ("original", "sequential")


@dataclass
class SpanFit:
    """One removed run of blocks ``first..last`` and the map folded into block ``anchor``."""

    first: int
    last: int
    anchor: int
    method: str
    tokens: int = 0
    rel_err_drop: float = float("nan")  # ‖M − (L − Y)‖² / ‖L − Y‖²: plain drop (T = I)
    rel_err_map: float = float("nan")  # ‖M T − (L − Y)‖² / ‖L − Y‖²
    cos_loss_drop: float | None = None  # mean 1 − cos on the sampled rows (cosine method)
    cos_loss_map: float | None = None
    seconds: float = 0.0
    t: torch.Tensor | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "t"}


def check_replace_supported(model: nn.Module) -> ArchSpec:
    spec = arch_for(model)
    if spec.post_mlp_norm:
        raise LayercutError(
            f"linear replacement is not possible for {spec.family}: a norm sits between the MLP output and "
            "the residual add (post_feedforward_layernorm), so a map cannot be folded into down_proj; "
            "use --replace none or --fuse"
        )
    check_block_drop_supported(model)
    return spec


def plan_spans(layers: Sequence[int], num_layers: int) -> list[tuple[int, int, int]]:
    """(first, last, anchor) per contiguous run; refuse a run with no block before it."""
    spans = []
    for first, last in runs_of(validate_layers(layers, num_layers)):
        if first == 0:
            raise LayercutError(
                f"blocks {first}..{last} start at block 0: no earlier block's down_proj can absorb a map "
                "(keep block 0, or use --replace none)"
            )
        spans.append((first, last, first - 1))
    return spans


class _Replay(nn.Module):
    """Stands in for a block so the driver hands ``outputs[i]`` on for micro-batch i."""

    def __init__(self, outputs: list[torch.Tensor]):
        super().__init__()
        self.outputs, self.calls = outputs, 0

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = self.outputs[self.calls % len(self.outputs)]
        self.calls += 1
        return out


class SpanFitter:
    """Driver callback: collect M, Y at each anchor, fit T when the span's last block runs.

    Several fitters with ``stream="original"`` (and other read-only callbacks) can share one
    ``run_blocks`` pass; a ``"sequential"`` fitter rewrites the stream, so it runs alone.
    ``spans`` come from :func:`plan_spans`; :meth:`results` lists the fits in span order.
    """

    def __init__(self, spans: Sequence[tuple[int, int, int]], method: str = "lstsq", alpha: float = 1e-4,
                 stream: str = "sequential", max_rows: int = 16384, total_tokens: int = 1,
                 cosine_steps: int = 200, cosine_lr: float = 1e-3, cosine_target: str = "output", seed: int = 0):
        if cosine_target not in ("output", "residual"):
            raise LayercutError(f"unknown cosine target '{cosine_target}' (output or residual)")
        self.cosine_target = cosine_target
        if method not in METHODS:
            raise LayercutError(f"unknown replace method '{method}' (choose from {', '.join(METHODS)})")
        if stream not in STREAMS:
            raise LayercutError(f"unknown stream mode '{stream}' (choose from {', '.join(STREAMS)})")
        self.order = [anchor for _, _, anchor in spans]
        self.fits = {anchor: SpanFit(first, last, anchor, method) for first, last, anchor in spans}
        self.by_last = {fit.last: fit for fit in self.fits.values()}
        self.held: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.method, self.alpha, self.stream = method, alpha, stream
        self.keep_p = min(1.0, max_rows / max(total_tokens, 1))
        self.cosine_steps, self.cosine_lr = cosine_steps, cosine_lr
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, run: BlockRun) -> None:
        if run.index in self.fits:
            start = time.perf_counter()
            _, mlp, outs = run.sublayer_outputs()
            self.held[run.index] = ([m.float() for m in mlp], [(o - m).float() for o, m in zip(outs, mlp)])
            self.fits[run.index].seconds += time.perf_counter() - start
        if run.index in self.by_last:
            self._fit(run, self.by_last[run.index])

    def results(self) -> list[SpanFit]:
        missing = [a for a in self.order if self.fits[a].t is None]
        if missing:
            raise LayercutError(f"span after block {missing[0]} was never fitted (did the driver run every block?)")
        return [self.fits[a] for a in self.order]

    def _fit(self, run: BlockRun, fit: SpanFit) -> None:
        start = time.perf_counter()
        ms, ys = self.held.pop(fit.anchor)
        outs = run.outputs()  # L = h_{last+1}
        dim = ms[0].shape[-1]
        gram = GramStats(dim, dim)
        zz, drop_err = 0.0, 0.0
        rows_m, rows_y, rows_l = [], [], []
        for m, y, out, mask in zip(ms, ys, outs, run.masks):
            z = out.float() - y  # L − Y: [B, L, D]
            gram.update(m, z, mask)
            real = mask.bool()
            zr, mr = z[real].double(), m[real].double()
            zz += float((zr * zr).sum())
            drop_err += float(((mr - zr) ** 2).sum())
            if self.method == "cosine":
                pick = (torch.rand(zr.shape[0], generator=self.gen) < self.keep_p).to(m.device)
                rows_m.append(m[real][pick].cpu())
                rows_y.append(y[real][pick].cpu())
                rows_l.append(out.float()[real][pick].cpu())
        if self.method == "lstsq":
            t = lstsq_map(gram.xtx, gram.xty, self.alpha)
        else:
            rm, ry, rl = torch.cat(rows_m), torch.cat(rows_y), torch.cat(rows_l)
            target, offset = (rl, ry) if self.cosine_target == "output" else (rl - ry, None)
            t = cosine_map(rm, target, steps=self.cosine_steps, lr=self.cosine_lr, offset=offset)
            fit.cos_loss_drop = mean_cosine_loss(rm, target, offset=offset)
            fit.cos_loss_map = mean_cosine_loss(rm, target, t, offset=offset)
        t64 = t.double().to(gram.xtx.device)
        map_err = float((t64 * (gram.xtx @ t64)).sum() - 2 * (t64 * gram.xty).sum()) + zz
        fit.tokens = gram.count
        fit.rel_err_drop = drop_err / max(zz, 1e-30)
        fit.rel_err_map = map_err / max(zz, 1e-30)
        fit.t = t.cpu()
        if self.stream == "sequential":
            # From here on the driver carries the pruned model's stream: block i's new output.
            tt = t.to(ms[0].device)
            run.block = _Replay([(y + m @ tt).to(o.dtype) for m, y, o in zip(ms, ys, outs)])
            run.invalidate()
        fit.seconds += time.perf_counter() - start


@torch.no_grad()
def fit_linear_maps(
    model: nn.Module,
    layers: Sequence[int],
    calib: CalibSet,
    method: str = "lstsq",
    alpha: float = 1e-4,
    stream: str = "sequential",
    batch_size: int = 8,
    max_rows: int = 16384,
    cosine_steps: int = 200,
    cosine_lr: float = 1e-3,
    cosine_target: str = "output",
    progress: bool = True,
    seed: int = 0,
) -> list[SpanFit]:
    """One map T per contiguous run of ``layers`` (nothing is modified). See the module doc."""
    spec = check_replace_supported(model)
    spans = plan_spans(layers, len(spec.layers_of(model)))
    fitter = SpanFitter(spans, method, alpha, stream, max_rows, int(calib.attention_mask.sum()), cosine_steps,
                        cosine_lr, cosine_target, seed)
    # blocks past the last span's end feed no fit: the pass stops there
    run_blocks(model, calib, [fitter], batch_size=batch_size, progress=progress, desc=f"replace:{method}",
               last=max(last for _, last, _ in spans))
    return fitter.results()


@torch.no_grad()
def merge_maps(model: nn.Module, fits: Sequence[SpanFit]) -> None:
    """Fold each fit's T into its anchor block's down projection (old block numbering)."""
    spec = arch_for(model)
    blocks = spec.layers_of(model)
    for fit in fits:
        down = get_submodule(blocks[fit.anchor], spec.down_proj)
        t = fit.t.to(down.weight.device)
        down.weight.copy_(merge_map_into_down(down.weight, t, conv1d=spec.conv1d))
        if getattr(down, "bias", None) is not None:
            down.bias.copy_(merge_map_into_bias(down.bias, t))


def linear_replace(model: nn.Module, layers: Sequence[int], calib: CalibSet, **kwargs) -> list[SpanFit]:
    """Fit one map per span, fold them into the weights and remove ``layers``, in place."""
    fits = fit_linear_maps(model, layers, calib, **kwargs)
    merge_maps(model, fits)
    drop_blocks(model, layers)
    return fits
