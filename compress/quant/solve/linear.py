"""Solving one weight, or one fused group of weights that share an input: the pieces the block
driver (:mod:`layercut.compress.quant.solve.driver`) and the output head
(:mod:`layercut.compress.quant.solve.head`) both use.

    from layercut.compress.quant.solve.linear import solve, solve_group
    res = solve(W, H, 4, cfg)                         # one W [out, in], H [in, in] (None for RTN)
    parts = solve_group([Wq, Wk, Wv], H, 4, cfg)      # q/k/v stacked along out: one solve, three results

``cfg`` is a :class:`layercut.compress.quant.solve.settings.SolverConfig`; its ``bits`` is not read
(the width is an argument), its ``group_size`` is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.solve.gptq import QuantResult, gptq_quantize, rtn_quantize
from layercut.compress.quant.solve.settings import SolverConfig

SOLVE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def solve_dtype(cfg: SolverConfig) -> torch.dtype:
    """The torch dtype of ``cfg.solve_dtype``."""
    return SOLVE_DTYPES[cfg.solve_dtype]


def linear_weight(module: nn.Module, conv1d: bool) -> Tensor:
    """W [out, in] of a Linear (GPT-2's Conv1D stores it transposed)."""
    return module.weight.T if conv1d else module.weight


def set_weight(module: nn.Module, W: Tensor, conv1d: bool) -> None:
    w = W.T if conv1d else W
    module.weight.data.copy_(w.to(module.weight.dtype))



def check_finite(weight: Tensor, name: str) -> None:
    if not torch.isfinite(weight.sum(dtype=torch.float64)):  # one reduction: NaN/Inf propagate
        raise LayercutError(f"quantize: {name} has NaN or Inf weights")



@contextlib.contextmanager
def solver_threads(device: torch.device) -> Iterator[None]:
    """One intra-op thread on CPU while solving and packing: GPTQ's column loop is a chain
    of small [out]-sized ops, and on this shared 2-core machine 2 threads made such ops
    5-10x slower (threads wait on each other when a core is taken by another process)."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def solve(W: Tensor, H: Tensor | None, bits: int, cfg: SolverConfig, overwrite_h: bool = False) -> QuantResult:
    """Quantize one weight W [out, in] with ``cfg.method`` (H [in, in] may be None for RTN).

    ``overwrite_h``: GPTQ may use a float64 H as scratch (garbage afterwards; one copy fewer)."""
    with solver_threads(W.device):
        return _solve(W, H, bits, cfg, overwrite_h)


def output_loss(W: Tensor, W_hat: Tensor, H: Tensor) -> float:
    """½ tr((Ŵ − W) H (Ŵ − W)ᵀ), undamped, in float32: W, Ŵ [out, in], H [in, in]."""
    D = (W_hat - W).float()
    return float(((D @ H.to(device=D.device, dtype=torch.float32)) * D).sum() / 2)


def solve_group(Ws: list[Tensor], H: Tensor | list[Tensor] | None, bits: int, cfg: SolverConfig,
                overwrite_h: bool = False) -> list[QuantResult]:
    """Quantize linears that share one input (hence one H) in a single call.

    GPTQ treats the rows of W independently given H (Frantar et al. 2022, §3: the
    Hessian is the same for every row), so stacking q/k/v (or gate/up) along ``out``
    is the same computation as one call per linear, but inverts H once and runs the
    column loop once. ``loss`` of each part is its undamped ½ tr(ΔW H ΔWᵀ) (NaN for RTN).
    ``overwrite_h``: the caller is done with H; the losses use a float32 copy taken first (the
    precision they were always computed in) and GPTQ solves in H's storage, converted to
    ``cfg.solve_dtype`` first. To let that conversion free the float64 H, pass it as a
    one-element list that nobody else references (``[H]``): it is emptied.
    """
    if isinstance(H, list):
        H = H.pop()
    if H is not None and overwrite_h:
        H_loss = H.to(device=Ws[0].device, dtype=torch.float32, copy=True)
        if H.dtype != solve_dtype(cfg):
            del H  # frees a float64 H nobody else holds, before its float32 copy is made
            H = H_loss.clone()  # = H.float(): the conversion is exact-rounded either way
    else:
        H_loss, overwrite_h = H, False
    res = solve(torch.cat(Ws) if len(Ws) > 1 else Ws[0], H, bits, cfg, overwrite_h)
    del H
    H = H_loss
    out, r0 = [], 0
    for W in Ws:
        r1 = r0 + W.shape[0]
        part = QuantResult(q=res.q[r0:r1], scales=res.scales[:, r0:r1], zeros=res.zeros[:, r0:r1], g_idx=res.g_idx.clone(),
                           dequant=res.dequant[r0:r1], loss=float("nan"), damp_used=res.damp_used, bits=bits,
                           group_size=res.group_size, residual=None if res.residual is None else res.residual[r0:r1])
        if H is not None:
            part.loss = output_loss(W, part.dequant, H)
        out.append(part)
        r0 = r1
    return out


def _solve(W: Tensor, H: Tensor | None, bits: int, cfg: SolverConfig, overwrite_h: bool = False) -> QuantResult:
    if cfg.method == "rtn":
        return rtn_quantize(W, bits, cfg.group_size, cfg.sym, H=H)
    return gptq_quantize(
        W, H, bits, cfg.group_size, sym=cfg.sym, act_order=cfg.act_order,
        static_groups=cfg.static_groups, damp=cfg.damp, block_size=cfg.block_size, group_aware=cfg.group_aware,
        overwrite_h=overwrite_h, solve_dtype=solve_dtype(cfg),
        scale_search=cfg.scale_search, scale_min=cfg.scale_min, scale_steps=cfg.scale_steps,
        refit=cfg.refit_scales, scale_bounds=cfg.scale_bounds, residual=cfg.tune is not None,
    )

