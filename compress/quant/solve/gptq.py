"""GPTQ and round-to-nearest weight quantization: plain tensor cores.

Run it on any weight and Hessian::

    from layercut.compress.quant.solve.gptq import gptq_quantize, hessian_update
    H, n = hessian_update(None, 0, x)            # x: [tokens, in] layer inputs
    res = gptq_quantize(linear.weight, H, bits=4, group_size=128)
    linear.weight.data = res.dequant.to(linear.weight.dtype)

Nothing here knows of models, hooks or files. The quantizer follows the GPTQ v1
convention (the one GPTQModel, vLLM and transformers load): per output row and
group an integer ``q`` in [0, 2^bits - 1], an integer zero point in the same
range (``2^(bits-1)`` when symmetric) and a scale, ``w ≈ scale * (q - zero)``.
Scales are rounded to float16-representable values because that is how they are
stored, so ``dequant`` is exactly what a packed checkpoint decodes to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.format.result import SUPPORTED_BITS
from layercut.compress.quant.solve.scale_fit import refit_scales

_DAMP_TRIES = 5  # damp, 10·damp, 100·damp, ... before giving up
_FP16_MIN_SUBNORMAL = 2.0**-24
SLICE_ELEMENTS = 1 << 22  # [out, in] results are built in row slices of about this many elements


@dataclass
class QuantResult:
    """A quantized weight [out, in] in GPTQ v1 layout.

    ``dequant[o, c] == scales[g_idx[c], o] * (q[o, c] - zeros[g_idx[c], o])`` holds exactly.
    """

    q: Tensor  # int32 [out, in], values in [0, 2^bits - 1]
    scales: Tensor  # float32 [groups, out], float16-representable
    zeros: Tensor  # int32 [groups, out], values in [0, 2^bits - 1]
    g_idx: Tensor  # int32 [in], group of each (original) input column
    dequant: Tensor  # float32 [out, in]
    loss: float  # ½ tr(ΔW (H + λI) ΔWᵀ), the GPTQ objective (NaN for RTN without H)
    damp_used: float  # relative damping actually applied (0 for RTN)
    bits: int
    group_size: int  # as requested (-1: one group spanning all of `in`)
    # GPTQ with ``residual=True``: float32 [out, in], each weight's error-updated value in code units
    # (w/scale + zero) minus its code, clamped to [-0.5, 0.5] (block tuning starts its rounding there)
    residual: Tensor | None = None


# --------------------------------------------------------------------------- checks


def _check_args(W: Tensor, bits: int, group_size: int) -> int:
    """Validate W / bits / group size; return the effective group size (columns per group)."""
    if W.dim() != 2:
        raise LayercutError(f"quantize: weight must be 2-D [out, in], got shape {tuple(W.shape)}")
    if W.numel() == 0:
        raise LayercutError(f"quantize: weight is empty, shape {tuple(W.shape)}")
    if bits not in SUPPORTED_BITS:
        raise LayercutError(f"quantize: bits must be one of {SUPPORTED_BITS}, got {bits}")
    if not torch.isfinite(W).all():
        raise LayercutError("quantize: weight contains NaN or Inf")
    in_features = W.shape[1]
    if group_size == -1:
        return in_features
    if group_size <= 0 or in_features % group_size != 0:
        raise LayercutError(
            f"quantize: group_size must be -1 or a positive divisor of in_features={in_features}, "
            f"got {group_size}"
        )
    return group_size


# ----------------------------------------------------------------------- quantizer


def _minmax_params(x: Tensor, bits: int, sym: bool) -> tuple[Tensor, Tensor]:
    """Min-max scale and integer zero point per row of ``x`` [out, k] → ([out], [out]).

    As in GPTQ, the range always contains 0 (so 0 is exactly representable). Symmetric
    uses the range [-m, m] with m = max|x| and zero = 2^(bits-1). Two departures from the
    reference code: a non-negative row still gets the full symmetric range, and an
    asymmetric zero point is kept ≥ 1 (a row whose zero would round to 0 is given the
    range [-scale, max] instead), because zero 0 has no unambiguous GPTQ v1 encoding
    (``zero - 1`` stored) — GPTQModel and vLLM would decode it differently.
    """
    return _range_params(*_row_range(x, sym), bits, sym)


def _row_range(x: Tensor, sym: bool) -> tuple[Tensor, Tensor]:
    """(xmin, xmax) per row of ``x`` [out, k]: the range, widened to contain 0, symmetric with
    ``sym``, and [-1, 1] for an all-zero row."""
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    flat = (xmin == 0) & (xmax == 0)
    xmin = torch.where(flat, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(flat, torch.ones_like(xmax), xmax)
    return xmin, xmax


def _range_params(xmin: Tensor, xmax: Tensor, bits: int, sym: bool) -> tuple[Tensor, Tensor]:
    """Scale and integer zero point of the ranges [xmin, xmax] (xmin ≤ 0 ≤ xmax, any equal
    shapes; see ``_minmax_params``)."""
    maxq = 2**bits - 1
    # float16 is the storage dtype of scales: round now so dequant matches the checkpoint
    scale = ((xmax - xmin) / maxq).clamp(min=_FP16_MIN_SUBNORMAL).half().float()
    if sym:
        return scale, torch.full_like(scale, float(2 ** (bits - 1)))
    zero = torch.round(-xmin / scale).clamp(0, maxq)
    low = zero < 1  # range ⊂ [≈0, max]: use levels -1 .. maxq-1 of a slightly wider step
    if low.any():
        wider = (xmax / (maxq - 1)).clamp(min=_FP16_MIN_SUBNORMAL).half().float()
        scale = torch.where(low, wider, scale)
        zero = torch.where(low, torch.ones_like(zero), zero)
    return scale, zero


SCALE_SEARCH = ("none", "mse", "hessian", "obs")


def shrink_grid(scale_min: float, scale_steps: int) -> list[float]:
    """The shrink factors p tried by a scale search: 1 down to ``scale_min`` in ``scale_steps``
    equal steps (``scale_min`` 1 or ``scale_steps`` 0: only p = 1, i.e. plain min-max)."""
    if not (0 < scale_min <= 1) or scale_steps < 0:
        raise LayercutError(f"scale search: scale_min must lie in (0, 1] and scale_steps be >= 0, got "
                            f"{scale_min}, {scale_steps}")
    if scale_min == 1 or scale_steps == 0:
        return [1.0]
    return [1.0 - i * (1.0 - scale_min) / scale_steps for i in range(scale_steps + 1)]


SCALE_BOUNDS = ("joint", "separate")


def shrink_pairs(grid: list[float], bounds: str, sym: bool) -> tuple[list[float], list[float]]:
    """(p_lo, p_hi) factors of a scale search's candidates: ``joint`` shrinks both ends of the
    range by the same p of ``grid``; ``separate`` (asymmetric only: a symmetric range has one
    end) tries every pair of ``grid`` × ``grid`` for the negative and positive end. (1, 1) comes
    first either way, then larger factors before smaller ones."""
    if bounds not in SCALE_BOUNDS:
        raise LayercutError(f"scale search: bounds must be one of {SCALE_BOUNDS}, got {bounds!r}")
    if bounds == "joint" or sym:
        return list(grid), list(grid)
    pairs = sorted(((lo, hi) for lo in grid for hi in grid), key=lambda t: (-(t[0] + t[1]), -t[1]))
    return [lo for lo, _ in pairs], [hi for _, hi in pairs]


def _searched_params(
    x: Tensor, bits: int, sym: bool, grid: list[float], weight: Tensor | None, bounds: str = "joint"
) -> tuple[Tensor, Tensor]:
    """Scale and zero per row of ``x`` [out, k] with the range shrunk by the candidate of
    ``shrink_pairs(grid, bounds, sym)`` that minimises the row's round-to-nearest error
    Σ_j weight_j (x_j - q(x_j))² (``weight`` [k]: the Hessian diagonal of the group's columns,
    i.e. the inputs' mean energy; None: plain squared error, as GPTQModel's ``mse=2``). All
    candidates in one [P, out, k] pass (in row slices); ties keep the earlier one, so a grid of
    [1.0] is ``_minmax_params`` exactly."""
    xmin, xmax = _row_range(x, sym)  # [out]
    lo, hi = shrink_pairs(grid, bounds, sym)
    p_lo = torch.tensor(lo, dtype=x.dtype, device=x.device)[:, None]  # [P, 1]
    p_hi = torch.tensor(hi, dtype=x.dtype, device=x.device)[:, None]
    scale, zero = _range_params(p_lo * xmin, p_hi * xmax, bits, sym)  # [P, out]
    if len(lo) == 1:
        return scale[0], zero[0]
    maxq = 2**bits - 1
    out_f, k = x.shape
    total = torch.empty_like(scale)  # [P, out]
    step = max(1, SLICE_ELEMENTS // (len(lo) * k))  # rows per [P, rows, k] temporary
    for r in range(0, out_f, step):
        rows = slice(r, r + step)
        s3, z3 = scale[:, rows, None], zero[:, rows, None]  # [P, rows, 1]
        err = (s3 * (_quant(x[rows], s3, z3, maxq) - z3) - x[rows]).square_()  # [P, rows, k]
        if weight is not None:
            err.mul_(weight.to(err.dtype))
        total[:, rows] = err.sum(dim=2)
    best = total.argmin(dim=0, keepdim=True)  # [1, out]: the first minimum, i.e. the largest p
    return scale.gather(0, best)[0], zero.gather(0, best)[0]


def _quant(x: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tensor:
    """Integer codes (as float) of ``x`` [out, ...] with ``scale``/``zero`` broadcastable."""
    return torch.clamp(torch.round(x / scale) + zero, 0, maxq)


# ------------------------------------------------------------------------- Hessian


def hessian_update(
    H: Tensor | None,
    n_seen: int,
    x: Tensor,
    mask: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, int]:
    """Fold a batch of layer inputs into the running GPTQ Hessian H = 2/N Σ_t x_t x_tᵀ.

    ``x``: [..., in] inputs (any leading dims, e.g. [batch, seq, in]); ``mask``: bool/0-1
    tensor of x's leading shape, True for real tokens (padding excluded). ``H``: [in, in]
    running mean over the ``n_seen`` tokens so far (None to start; created in ``dtype``,
    an existing H keeps its own dtype). Returns (H, N) with N = n_seen + tokens used.
    """
    x = x.reshape(-1, x.shape[-1])
    if mask is not None:
        x = x[mask.reshape(-1).bool()]
    if H is None:
        if x.shape[0] > 0:  # one [in, in] allocation: the product, scaled in place
            xd = x.to(dtype)
            return (xd.T @ xd).mul_(2.0 / (n_seen + x.shape[0])), n_seen + x.shape[0]
        H = torch.zeros(x.shape[1], x.shape[1], dtype=dtype, device=x.device)
    elif H.shape != (x.shape[1], x.shape[1]):
        raise LayercutError(f"hessian_update: H is {tuple(H.shape)} but inputs have {x.shape[1]} features")
    m = x.shape[0]
    if m == 0:
        return H, n_seen
    n = n_seen + m
    xd = x.to(H.dtype)
    H = H * (n_seen / n) + (xd.T @ xd) * (2.0 / n)  # [in, in]
    return H, n


def _inverse_cholesky(H: Tensor, damp: float) -> tuple[Tensor, float]:
    """Upper Cholesky factor U of (H + λI)⁻¹ = UᵀU with λ = damp·mean(diag H), H [in, in]
    (float64 or float32).

    If the factorisation fails, damp is multiplied by 10 (``_DAMP_TRIES`` tries in all).
    ``H`` is the scratch space and is returned as the factor. With J the reversal
    permutation, J(H + λI)J = L̃L̃ᵀ gives (H + λI)⁻¹ = (J L̃⁻¹ J)ᵀ (J L̃⁻¹ J), and J L̃⁻¹ J is
    upper triangular: so H is reversed in place, factored once, L̃⁻¹ is solved into H's
    storage and reversed back. Two [in, in] matrices are alive at most, H and L̃ (at
    in = 28,672, a 70B down_proj, each is 6.6 GB in float64, 3.3 GB in float32), where
    factor → inverse → factor again (the reference code's route, equal to rounding:
    relative 3e-15 in float64) needed four. If the result is not finite (possible only for
    a near-singular H), the undamped try (damp 0) retries from a backup copy; a damped try
    raises, asking for more damping.
    """
    mean_diag = H.diagonal().mean()  # on the strided view, as it always was (the sum order matters)
    H.copy_(H.flip((0, 1)))  # J H J (one temporary; the damping below is symmetric in J)
    diag0 = H.diagonal().clone()
    tries = [damp * 10**k for k in range(_DAMP_TRIES)] if damp > 0 else [0.0, 1e-4, 1e-3, 1e-2, 1e-1]
    for d in tries:
        H.diagonal().copy_(diag0 + d * mean_diag)
        L, info_l = torch.linalg.cholesky_ex(H)
        if int(info_l) != 0:
            continue
        backup = H.clone() if d == 0 else None
        H.zero_()
        H.diagonal().fill_(1.0)
        torch.linalg.solve_triangular(L, H, upper=False, out=H)  # H ← L̃⁻¹ (lower)
        del L
        H.copy_(H.flip((0, 1)))  # U = J L̃⁻¹ J (upper)
        if torch.isfinite(H).all():
            return H, d
        if backup is None:
            raise LayercutError(f"gptq: the inverse of the damped Hessian (damp={d:g}) is not finite "
                                "numerically; raise --damp")
        H.copy_(backup)
        del backup
    raise LayercutError(
        f"gptq: Hessian is not positive definite even with damp={tries[-1]:g} "
        f"(tried {', '.join(f'{t:g}' for t in tries)}); check the calibration inputs"
    )


# ---------------------------------------------------------------------------- GPTQ


def gptq_quantize(
    W: Tensor,
    H: Tensor,
    bits: int,
    group_size: int = -1,
    sym: bool = False,
    act_order: bool = False,
    static_groups: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    group_aware: bool = False,
    overwrite_h: bool = False,
    solve_dtype: torch.dtype = torch.float64,
    scale_search: str = "none",
    scale_min: float = 0.75,
    scale_steps: int = 5,
    refit: bool = False,
    scale_bounds: str = "joint",
    residual: bool = False,
) -> QuantResult:
    """Quantize ``W`` [out, in] with GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training
    Quantization for Generative Pre-trained Transformers", Algorithm 1).

    ``H`` [in, in] is the layer Hessian 2/N Σ x xᵀ of its inputs (see ``hessian_update``).
    Columns are quantized one at a time (in descending diag(H) order with ``act_order``),
    the error of each being spread over the not yet quantized columns through the upper
    Cholesky factor of (H + λI)⁻¹, λ = damp·mean(diag H) (raised ×10 while Cholesky fails).
    Updates are applied lazily in blocks of ``block_size`` columns. Dead inputs
    (H_ii == 0) get H_ii = 1 and a zero weight. Group parameters (min-max per output row
    and group of ``group_size`` columns) are computed from the error-updated
    weights when a group starts (the reference convention: earlier blocks' updates included,
    the current block's not), or with ``static_groups`` all up front from the original
    weight in the original column order (so groups stay contiguous under act-order).

    ``group_aware`` (ignored under ``act_order``) is group-aware reordering (Gafni et al.
    2025, "Dual Precision Quantization", GAR; GPTQModel's default): whole groups are taken
    in descending order of their largest diag(H), and the columns of each group in
    descending diag(H). Groups stay contiguous, so their parameters are still computed from
    the updated weights when a group starts, and the result is stored in natural group
    order with ``g_idx = i // group_size`` (no desc_act needed to load it).

    ``loss`` is Σ (w - q)² / (2 [U]_jj²) over all quantized entries, which equals
    ½ tr(ΔW (H + λI) ΔWᵀ) ≈ mean over tokens of ‖(W - Ŵ) x‖² — the layer's output error.
    Computation is float32; the Hessian's damping, Cholesky factors and inverse are in
    ``solve_dtype`` (float64 here by default; the quantize stage's default is float32, as
    in the reference code and GPTQModel: see ``SolverConfig.solve_dtype``). Returns a
    ``QuantResult``.

    ``overwrite_h``: an ``H`` already in ``solve_dtype`` on W's device is used as scratch
    space instead of being copied (its values are garbage afterwards): one [in, in] copy fewer.

    ``scale_search`` ("none", "mse", "hessian", "obs"): when a group's scale and zero are fixed
    (up front under ``static_groups``, else when the group starts), each row's min/max range is
    shrunk by the factor p of ``shrink_grid(scale_min, scale_steps)`` (1, 0.95, ..., 0.75 by
    default) whose rounding error over the group's columns is least: plain Σ (w - q)² with
    "mse" (GPTQModel's ``mse=2``), Σ_j c_j (w_j - q_j)² with c_j = H_jj (the undamped Hessian
    diagonal, the mean energy of input j) for "hessian", or c_j = 1 / [U]_jj² for "obs": what
    ``loss`` charges an error in column j once the later columns have absorbed what they can
    (the OBS cost; for a diagonal H it is H_jj + λ). "none" and a grid of only p = 1 are plain
    min-max, bit for bit. The search is one [p, out, gs] pass per group (in row slices).
    ``scale_bounds="separate"`` (asymmetric only) shrinks the range's two ends by independent
    factors of the grid (P² candidates, ``shrink_pairs``) instead of one.

    ``refit``: once every code is chosen, each row's group scales are re-solved by least squares
    on the undamped H (:func:`layercut.compress.quant.solve.scale_fit.refit_scales`): the same codes and
    zeros, the output error no larger; ``loss`` is recomputed for the refit scales. It keeps a
    copy of W and of H ([out, in] + [in, in] float32) until the end.

    ``residual``: also return, per weight, how far its error-updated value lay from the code it got
    (in code units, clamped to [-0.5, 0.5]; one more [out, in] float32), the rounding decision that
    :mod:`layercut.compress.quant.solve.block_tune` revisits.
    """
    gs = _check_args(W, bits, group_size)
    out_f, in_f = W.shape
    if H.shape != (in_f, in_f):
        raise LayercutError(f"gptq: H must be [{in_f}, {in_f}] for a weight {tuple(W.shape)}, got {tuple(H.shape)}")
    if not torch.isfinite(H).all():
        raise LayercutError("gptq: Hessian contains NaN or Inf")
    if block_size <= 0:
        raise LayercutError(f"gptq: block_size must be positive, got {block_size}")
    if not (damp >= 0 and math.isfinite(damp)):
        raise LayercutError(f"gptq: damp must be a finite non-negative number, got {damp}")
    if solve_dtype not in (torch.float64, torch.float32):
        raise LayercutError(f"gptq: solve_dtype must be float64 or float32, got {solve_dtype}")
    if scale_search not in SCALE_SEARCH:
        raise LayercutError(f"gptq: scale_search must be one of {SCALE_SEARCH}, got {scale_search!r}")
    grid = shrink_grid(scale_min, scale_steps) if scale_search != "none" else None
    if scale_bounds not in SCALE_BOUNDS:
        raise LayercutError(f"gptq: scale_bounds must be one of {SCALE_BOUNDS}, got {scale_bounds!r}")

    maxq = 2**bits - 1
    n_groups = in_f // gs
    W = W.detach().to(torch.float32).clone()  # [out, in]
    Hs = H.detach().to(device=W.device, dtype=solve_dtype)  # [in, in]
    H = Hs.clone() if Hs.data_ptr() == H.data_ptr() and not overwrite_h else Hs
    del Hs
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    fit = (W.clone(), H.to(torch.float32, copy=True)) if refit else None  # original order, dead inputs fixed

    def group_params(x: Tensor, cols: slice, diag: Tensor | None) -> tuple[Tensor, Tensor]:
        if grid is None:
            return _minmax_params(x, bits, sym)
        return _searched_params(x, bits, sym, grid, None if diag is None else diag[cols], scale_bounds)

    perm = group_order = None
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True)
    elif group_aware:
        diag = H.diagonal().reshape(n_groups, gs)
        local = torch.argsort(diag, dim=1, descending=True, stable=True)  # [groups, gs]
        group_order = torch.argsort(diag.max(dim=1).values, descending=True, stable=True)  # [groups]
        perm = (group_order[:, None] * gs + local[group_order]).reshape(-1)
    W0 = W  # original column order (the static groups' parameters come from it)
    if perm is not None:
        W = W[:, perm]
        H.copy_(H[perm])  # rows, then columns, in place: one [in, in] temporary at a time
        H.copy_(H[:, perm])
    # group of each column in processing order
    orig_col = perm if perm is not None else torch.arange(in_f, device=W.device)
    col_group = (orig_col // gs) if static_groups else torch.arange(in_f, device=W.device) // gs
    col_group_list = col_group.tolist()

    # [in], processing order; a copy (for a float32 H, .float() would be a view the factorisation overwrites)
    hdiag = H.diagonal().to(torch.float32, copy=True) if scale_search == "hessian" else None
    U, damp_used = _inverse_cholesky(H, damp)  # U is H's storage
    del H
    Hinv = U if U.dtype == torch.float32 else U.float()  # [in, in] upper triangular; no copy in float32
    del U
    if scale_search == "obs":  # GPTQ's own cost of an error in column j: 1 / [U]_jj²
        hdiag = Hinv.diagonal().double().reciprocal().square().float()

    scales = torch.zeros(n_groups, out_f, dtype=torch.float32, device=W.device)  # [groups, out]
    zeros = torch.zeros(n_groups, out_f, dtype=torch.float32, device=W.device)
    if static_groups:
        worig = hdiag
        if hdiag is not None and perm is not None:
            worig = torch.empty_like(hdiag)
            worig[perm] = hdiag
        for g in range(n_groups):
            cols = slice(g * gs, (g + 1) * gs)
            scales[g], zeros[g] = group_params(W0[:, cols], cols, worig)
    del W0

    Q = torch.zeros_like(W)  # integer codes as float, processing order
    R = torch.zeros_like(W) if residual else None  # value - code, in code units, processing order
    loss = torch.zeros((), dtype=torch.float64, device=W.device)
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()  # [out, blk]
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = col_group_list[col]
            if not static_groups and col % gs == 0:
                # as in the reference: W holds earlier blocks' updates, not this block's
                # own (W1) — measured a little better than the fully updated weights
                scales[g], zeros[g] = group_params(W[:, col : col + gs], slice(col, col + gs), hdiag)
            w = W1[:, i]  # [out]
            d = Hinv1[i, i]
            q = _quant(w, scales[g], zeros[g], maxq)
            Q[:, col] = q
            if R is not None:
                R[:, col] = (w / scales[g] + zeros[g] - q).clamp_(-0.5, 0.5)
            err = (w - scales[g] * (q - zeros[g])) / d
            loss += (err.double().square().sum()) / 2
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1)  # OBS update of the block's remaining columns
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # lazy batch update of the remaining columns

    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
        R = None if R is None else R[:, torch.argsort(perm)]
    if group_order is not None and not static_groups:
        # processing group k is original group group_order[k]: store groups in natural order
        scales[group_order], zeros[group_order] = scales.clone(), zeros.clone()
        g_idx = torch.arange(in_f, device=W.device) // gs
    elif perm is not None:
        g_idx = col_group[torch.argsort(perm)]
    else:
        g_idx = col_group
    loss = float(loss)
    if fit is not None:
        loss = _refit(fit[0], fit[1], Q, scales, zeros, g_idx, loss, damp_used)
    res = _finish(Q, scales, zeros, g_idx, loss, damp_used, bits, group_size)
    res.residual = R
    return res


def _refit(W: Tensor, H: Tensor, Q: Tensor, scales: Tensor, zeros: Tensor, g_idx: Tensor, loss: float,
           damp_used: float) -> float:
    """Refit ``scales`` in place for the codes ``Q``; return ``loss`` (½ tr(ΔW (H + λI) ΔWᵀ)) for them.

    The loss changes by the undamped drop ½·gain and by λ/2 · (‖ΔW_new‖² - ‖ΔW_old‖²)."""
    new, gain = refit_scales(W, H, Q, zeros, g_idx, scales)
    lam = damp_used * float(H.diagonal().double().mean())
    idx = g_idx.to(torch.int64)
    sq_old = sq_new = 0.0
    step = max(1, SLICE_ELEMENTS // max(W.shape[1], 1))
    for r in range(0, W.shape[0], step):
        rows = slice(r, r + step)
        V = Q[rows] - zeros[idx, rows].T
        sq_old += float((W[rows] - scales[idx, rows].T * V).double().square().sum())
        sq_new += float((W[rows] - new[idx, rows].T * V).double().square().sum())
    scales.copy_(new)
    return loss - gain / 2 + lam / 2 * (sq_new - sq_old)


def _finish(
    Q: Tensor, scales: Tensor, zeros: Tensor, g_idx: Tensor, loss: float, damp_used: float, bits: int, group_size: int
) -> QuantResult:
    """Assemble a QuantResult; ``dequant`` is recomputed from the integer codes.

    ``Q`` (float codes, [out, in]) becomes the int32 codes in its own storage; both it and
    ``dequant`` are built in slices of rows, so no other [out, in] temporary is made (the same
    elementwise operations as on whole tensors: bit for bit the same values)."""
    g_idx = g_idx.to(torch.int64)
    out_f, in_f = Q.shape
    dequant = torch.empty_like(Q)
    step = max(1, SLICE_ELEMENTS // max(in_f, 1))
    Qi = Q.view(torch.int32)
    for r in range(0, out_f, step):
        rows = slice(r, r + step)
        dequant[rows] = scales[g_idx, rows].T * (Q[rows] - zeros[g_idx, rows].T)
        Qi[rows] = Q[rows].to(torch.int32)  # read whole before its bytes are overwritten
    return QuantResult(
        q=Qi,
        scales=scales,
        zeros=zeros.to(torch.int32),
        g_idx=g_idx.to(torch.int32),
        dequant=dequant,
        loss=loss,
        damp_used=damp_used,
        bits=bits,
        group_size=group_size,
    )


# ----------------------------------------------------------------------------- RTN


def rtn_quantize(
    W: Tensor, bits: int, group_size: int = -1, sym: bool = False, H: Tensor | None = None
) -> QuantResult:
    """Round-to-nearest baseline with the same min-max quantizer and layout as GPTQ.

    ``W`` [out, in]. If ``H`` [in, in] is given, ``loss`` = ½ tr(ΔW H ΔWᵀ) (the GPTQ
    objective, undamped) so the two are comparable; otherwise NaN.
    """
    gs = _check_args(W, bits, group_size)
    W = W.detach().to(torch.float32)
    out_f, in_f = W.shape
    n_groups = in_f // gs
    Wg = W.reshape(out_f, n_groups, gs).transpose(0, 1)  # [groups, out, gs]
    scales = torch.empty(n_groups, out_f, dtype=torch.float32, device=W.device)
    zeros = torch.empty_like(scales)
    for g in range(n_groups):
        scales[g], zeros[g] = _minmax_params(Wg[g], bits, sym)
    q = _quant(Wg, scales.unsqueeze(-1), zeros.unsqueeze(-1), 2**bits - 1)  # [groups, out, gs]
    Q = q.transpose(0, 1).reshape(out_f, in_f)
    g_idx = torch.arange(in_f, device=W.device) // gs
    res = _finish(Q, scales, zeros, g_idx, float("nan"), 0.0, bits, group_size)
    if H is not None:
        if H.shape != (in_f, in_f) or not torch.isfinite(H).all():
            raise LayercutError(f"rtn: H must be a finite [{in_f}, {in_f}] matrix, got {tuple(H.shape)}")
        res.loss = layer_loss(W, res.dequant, H)
    return res


def layer_loss(W: Tensor, W_hat: Tensor, H: Tensor) -> float:
    """½ tr((Ŵ - W) H (Ŵ - W)ᵀ) in float64 — the GPTQ objective for W, Ŵ [out, in], H [in, in]."""
    D = (W_hat.to(torch.float64) - W.to(torch.float64))  # [out, in]
    return float(((D @ H.to(device=D.device, dtype=torch.float64)) * D).sum() / 2)
