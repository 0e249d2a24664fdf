"""Block-wise reconstruction after GPTQ: tune one decoder block's rounding and scales against
the float block's output, keeping the GPTQ v1 format.

Run it::

    layercut quantize bundled:smollm2-135m -o q3 --bits 3 --group-size 64 --block-tune

    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.plan import solver_settings
    cfg = solver_settings(QuantizeConfig(bits=3, group_size=64, block_tune=True, block_tune_steps=100))
    quantize_model(model, calib, cfg)        # GPTQ, then each block tuned before the next one runs

What trains (per quantized linear, everything else of the block frozen):

- a rounding offset ``v`` per weight, in code units, bounded to [-1, 1] around GPTQ's code ``q``,
  so each code may move one step up or down (AdaRound, Nagel et al. 2020; AutoRound, Cheng et al.
  2023, who bound it to a half step around the float weight instead);
- a relative change ``t`` of each group scale (Block-AP, EfficientQAT, Chen et al. 2024 §3.2):

      W[o, c] = s0[g, o]·(1 + t[g, o]) · (clamp(round(q[o, c] + v[o, c]), 0, 2^b − 1) − z[g, o]),
      g = g_idx[c]

  with the straight-through estimator for the rounding. Zero points stay GPTQ's integers.

The loss is the mean squared error of the block's output over real tokens against a fixed
target ``T``: the *float* block's output on the same inputs (``target="quantized"``: the inputs
are the quantized model's stream, the stream the block sees at inference), or the float model's
own stream (``target="float"``: the float block on the float model's inputs, kept alongside; the
tuned block then also corrects what the blocks before it got wrong; the default). With
``loss="channel"`` (the default) each hidden channel's squared error is divided by that channel's
mean square in the target (:func:`channel_weights`): a residual stream holds most of its energy in
a few channels, which a plain MSE (``loss="mse"``) would fit at the expense of the rest; on
brown-val this lifted gemma-3-270m's 3-bit gap closed from 1% to 21% and left SmolLM2's at 34-36%
(``benchmarks/block_tune.py --text bundled:brown-val``). The offsets
start at GPTQ's own rounding residual and take Adam steps (AutoRound's signed steps, without
state, are ``optimizer="sign"``; from GPTQ's codes they lost on SmolLM2's first blocks), the step
size decaying linearly to zero; the scales take Adam steps too. A step takes ``batch``
sequences of one calibration micro-batch; the micro-batches are visited in a shuffled order.

With ``norm_lr`` > 0 the block's norm weights (:func:`norm_weights`) train too, by Adam; they are
stored unquantized, so the format and bytes stay. Off by default: on brown-val at 64 x 128
calibration it bought SmolLM2 0.6% of 3-bit KL and cost gemma-3-270m 3.7% (docs/quantize.md).

Memory: per linear the codes (uint8), the residual (float16), the offsets with their gradient and
Adam's two moments (float32), and only while a
linear runs its dense weight (:class:`_DequantLinearFn` rebuilds it in the backward instead of
keeping it). At the end the codes are rounded, the scales rounded to float16 (how they are
stored), and the tuned block is kept only if its loss over all calibration micro-batches is
below GPTQ's (so tuning never makes a block worse on what it was fitted to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.solve.gptq import QuantResult
from layercut.compress.quant.solve.settings import (  # noqa: F401  (re-exported: the tuner's settings)
    INITS,
    LOSSES,
    OPTIMIZERS,
    TARGETS,
    BlockTune,
)


class _DequantLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b with W built from (codes, offsets, scales) — rebuilt in the backward, not saved.

    Shapes: x [..., in], codes / offsets [out, in], s0 / t / zeros [G, out], g_idx [in] (long)."""

    @staticmethod
    def forward(ctx, x, codes, v, s0, t, zeros, g_idx, maxq, bias):  # noqa: D401
        W, _ = _weight(codes, v, s0, t, zeros, g_idx, maxq)
        ctx.save_for_backward(x, codes, v, s0, t, zeros, g_idx)
        ctx.maxq = maxq
        return F.linear(x, W.to(x.dtype), bias)

    @staticmethod
    def backward(ctx, gy):
        x, codes, v, s0, t, zeros, g_idx = ctx.saved_tensors
        W, (c, S) = _weight(codes, v, s0, t, zeros, g_idx, ctx.maxq)
        gx = gy @ W.to(gy.dtype)
        gW = gy.reshape(-1, gy.shape[-1]).float().T @ x.reshape(-1, x.shape[-1]).float()  # [out, in]
        gv = gW * S  # straight through the rounding (and the clamp)
        # dW/dt[g, o] = s0[g, o]·(c − z)[o, c] for the columns c of group g
        gq = (gW * (c - zeros.T.float()[:, g_idx])).T  # [in, out]
        gt = torch.zeros_like(t).index_add_(0, g_idx, gq) * s0
        return gx, None, gv, None, gt, None, None, None, None


def _weight(codes: Tensor, v: Tensor, s0: Tensor, t: Tensor, zeros: Tensor, g_idx: Tensor,
            maxq: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """W [out, in] and (rounded codes c, expanded scales S), both [out, in], float32."""
    c = (codes.float() + v).round_().clamp_(0, maxq)
    S = (s0 * (1 + t)).T[:, g_idx]  # [out, in]
    return S * (c - zeros.T.float()[:, g_idx]), (c, S)


class TunedLinear(nn.Module):
    """Stands in for one quantized linear while its block trains."""

    def bound_(self) -> None:
        """Keep the offsets in their range (see ``__init__``)."""
        with torch.no_grad():
            if self.r is None:
                self.v.clamp_(-1.0, 1.0)
            else:
                r = self.r.float()
                torch.minimum(self.v, r + 0.5, out=self.v.data)
                torch.maximum(self.v, r - 0.5, out=self.v.data)

    def __init__(self, res: QuantResult, bias: Tensor | None, init: str = "residual"):
        super().__init__()
        dev = res.scales.device
        self.bits = res.bits
        self.maxq = 2**res.bits - 1
        self.register_buffer("codes", res.q.to(torch.uint8 if res.bits <= 8 else torch.int32))
        self.register_buffer("s0", res.scales.float())
        self.register_buffer("zeros", res.zeros)
        self.register_buffer("g_idx", res.g_idx.long().to(dev))
        # v starts at GPTQ's rounding residual r (no code changes) and stays within r ± 1/2: each code may
        # become the floor or the ceiling of GPTQ's error-updated value; without r, one step either way
        r = res.residual if init == "residual" else None
        self.register_buffer("r", None if r is None else r.to(torch.float16))
        self.v = nn.Parameter(torch.zeros(res.q.shape, dtype=torch.float32, device=dev) if r is None
                              else r.float().clamp(-0.499, 0.499))
        self.t = nn.Parameter(torch.zeros(res.scales.shape, dtype=torch.float32, device=dev))
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return _DequantLinearFn.apply(x, self.codes, self.v, self.s0, self.t, self.zeros, self.g_idx, self.maxq,
                                      self.bias)

    def result(self, like: QuantResult, tuned: bool = True) -> QuantResult:
        """The tuned codes and float16-rounded scales as a GPTQ v1 result (zeros and g_idx unchanged);
        ``tuned=False``: GPTQ's own codes and scales, its dense weight rebuilt."""
        with torch.no_grad():
            if tuned:
                q = (self.codes.float() + self.v).round_().clamp_(0, self.maxq).to(torch.int32)
                scales = (self.s0 * (1 + self.t)).clamp_min(2.0**-24).half().float()
            else:
                q, scales = self.codes.to(torch.int32), self.s0
            S = scales.T[:, self.g_idx]
            dequant = S * (q - self.zeros.T[:, self.g_idx]).float()
        return QuantResult(q=q, scales=scales, zeros=like.zeros, g_idx=like.g_idx, dequant=dequant, loss=like.loss,
                           damp_used=like.damp_used, bits=like.bits, group_size=like.group_size)


def _swap(block: nn.Module, path: str, new: nn.Module) -> nn.Module:
    parent, _, child = path.rpartition(".")
    owner = block.get_submodule(parent) if parent else block
    old = getattr(owner, child)
    setattr(owner, child, new)
    return old


def masked_mse(y: Tensor, target: Tensor, mask: Tensor, weight: Tensor | None = None) -> Tensor:
    """Mean over real tokens of the squared error summed over the hidden size: y, target [B, L, D], mask [B, L];
    ``weight`` [D] scales each channel's squared error."""
    d = (y.float() - target.float())[mask].pow(2)
    return (d if weight is None else d * weight).sum(-1).mean()


def channel_weights(targets: list[Tensor], masks: list[Tensor]) -> Tensor:
    """1 / (mean square of each hidden channel of the targets over real tokens), averaging 1 over channels.

    A residual stream's energy sits in a few channels (SmolLM2's last blocks: one channel holds ~60%
    of it; gemma-3's: ~90% at every depth); a plain MSE then fits those channels and little else,
    while the next block's RMSNorm divides them out."""
    with torch.no_grad():
        sq = sum(t.float()[m].pow(2).sum(0) for t, m in zip(targets, masks))
        ms = sq / max(1, sum(int(m.sum()) for m in masks))
        w = 1.0 / (ms + 1e-6 * ms.mean() + 1e-12)
        return w / w.mean()


@dataclass
class TuneReport:
    loss_gptq: float  # block-output MSE over every calibration micro-batch, GPTQ's codes and scales
    loss_tuned: float  # the same after tuning
    kept: bool  # False: tuning did not lower the loss, GPTQ's result was kept
    codes_changed: float  # fraction of codes that moved


def tune_block(
    block: nn.Module,
    call: Callable[[int, Tensor | None], Tensor],
    targets: list[Tensor],
    masks: list[Tensor],
    solved: dict[str, tuple[QuantResult, Tensor | None]],
    cfg: BlockTune,
    release: bool = False,
) -> tuple[dict[str, QuantResult], TuneReport]:
    """Tune the quantized linears of ``block`` (paths inside it → (GPTQ result, bias)) so that
    ``call(i, rows)`` — the block's output on micro-batch i (its sequences ``rows``; all for None) —
    matches ``targets[i]`` on ``masks[i]``. A call that ignores ``rows`` must return the whole micro-batch.

    The block's own modules are swapped for :class:`TunedLinear` while it trains and put back
    after; the caller sets their weights from the returned results. ``release``: the swapped-out
    modules' weights are freed while the block trains (they come back allocated, not filled) and
    every returned result carries its dense weight, GPTQ's rebuilt where tuning was not kept."""
    cfg.check()
    frozen = [p for p in block.parameters() if p.requires_grad]
    norms = norm_weights(block) if cfg.norm_lr > 0 else []
    before = [p.detach().clone() for p in norms]
    tuned = {path: TunedLinear(res, bias, cfg.init) for path, (res, bias) in solved.items()}
    originals = {path: _swap(block, path, m) for path, m in tuned.items()}
    held = {path: (m.weight.shape, m.weight.dtype, m.weight.device) for path, m in originals.items()} if release else {}
    for path in held:
        originals[path].weight.data = originals[path].weight.data.new_empty(0)
    for p in frozen:
        p.requires_grad_(False)
    try:
        for p in norms:
            p.requires_grad_(True)
        report = _train(call, targets, masks, tuned, cfg, norms)
        out = {path: (m.result(solved[path][0]) if report.kept else
                      m.result(solved[path][0], tuned=False) if release else solved[path][0])
               for path, m in tuned.items()}
        if not report.kept:
            with torch.no_grad():
                for p, b in zip(norms, before):
                    p.copy_(b)
    finally:
        for path, (shape, dtype, device) in held.items():
            originals[path].weight.data = torch.empty(shape, dtype=dtype, device=device)
        for p in norms:
            p.grad = None
            p.requires_grad_(False)
        for path, m in originals.items():
            _swap(block, path, m)
        for p in frozen:
            p.requires_grad_(True)
    return out, report


def norm_weights(block: nn.Module) -> list[nn.Parameter]:
    """The weights of the block's normalisation layers (RMSNorm / LayerNorm, q/k norms included):
    few numbers, stored unquantized, so tuning them keeps the format and the bytes."""
    return [m.weight for m in block.modules()
            if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), nn.Parameter)]


def _full_loss(call, targets, masks, weight: Tensor | None) -> float:
    with torch.no_grad():
        total = sum(float(masked_mse(call(i, None), targets[i], masks[i], weight)) * int(masks[i].sum())
                    for i in range(len(targets)))
    return total / max(1, sum(int(m.sum()) for m in masks))


def _train(call, targets, masks, tuned: dict[str, TunedLinear], cfg: BlockTune,
           norms: list[nn.Parameter]) -> TuneReport:
    scales = [m.t for m in tuned.values()]
    groups = ([{"params": scales, "lr": cfg.scale_lr}] if cfg.scale_lr > 0 else []) + \
        ([{"params": norms, "lr": cfg.norm_lr}] if norms else [])
    adam = torch.optim.Adam(groups) if groups else None
    vadam = torch.optim.Adam([m.v for m in tuned.values()], lr=cfg.lr) if cfg.optimizer == "adam" else None
    n = len(targets)
    gen = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    weight = channel_weights(targets, masks) if cfg.loss == "channel" else None
    loss0 = _full_loss(call, targets, masks, weight)
    with torch.enable_grad():
        for step in range(cfg.steps):
            if not order:
                order = torch.randperm(n, generator=gen).tolist()
            i = order.pop()
            n_i = len(targets[i])
            rows = torch.randperm(n_i, generator=gen)[:cfg.batch].to(targets[i].device) if cfg.batch < n_i else None
            y = call(i, rows)
            if rows is not None and len(y) != n_i:
                loss = masked_mse(y, targets[i][rows], masks[i][rows], weight)
            else:  # the whole micro-batch (asked for, or a call that cannot take a subset)
                loss = masked_mse(y, targets[i], masks[i], weight)
            if not torch.isfinite(loss):
                raise LayercutError("quantize: block tuning diverged (non-finite loss); lower --block-tune-lr")
            loss.backward()
            lr = cfg.lr * (1 - step / cfg.steps)
            if vadam is not None:
                for group in vadam.param_groups:
                    group["lr"] = lr
                vadam.step()
                vadam.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m in tuned.values():
                    if vadam is None:
                        m.v.add_(m.v.grad.sign(), alpha=-lr)
                        m.v.grad = None
                    m.bound_()
            if adam is not None:
                adam.step()
                adam.zero_grad(set_to_none=True)
            if cfg.scale_lr == 0:
                for t in scales:
                    t.grad = None
    moved = sum(int(((m.codes.float() + m.v).round().clamp(0, m.maxq) != m.codes.float()).sum()) for m in tuned.values())
    total = sum(m.codes.numel() for m in tuned.values())
    loss1 = _full_loss(call, targets, masks, weight)
    return TuneReport(loss0, loss1, loss1 < loss0, moved / total if loss1 < loss0 else 0.0)
