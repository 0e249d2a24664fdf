"""Least-squares scales for fixed GPTQ codes: the layer's output error, re-solved per row.

Once GPTQ has chosen every integer code ``q`` and zero point ``z``, the dequantized row
``ŵ_r = Σ_g s_rg · v_rg`` is linear in that row's group scales, where ``v_rg`` holds
``q - z`` on group g's columns and 0 elsewhere. The layer's output error for row r,
``(w_r - ŵ_r)ᵀ H (w_r - ŵ_r)`` with H the Hessian of its inputs, is then a quadratic in the
G scales, and its minimum is one G×G solve::

    M_r[g, g'] = v_rgᵀ H v_rg'        b_r[g] = v_rgᵀ H w_r        s_r = M_r⁻¹ b_r

GPTQ itself fixes each group's scale before it has chosen the codes (from the min/max range,
or the range search), so the scales it stores are not the best ones for the codes it ends with.
Refitting them costs nothing on disk (the same fp16 scales, the same codes) and about one
``W @ H`` of arithmetic per linear; by construction the output error cannot grow (a row keeps its
old scales when the fp16-rounded new ones would not lower it, or are not positive).

    from layercut.compress.quant.solve.scale_fit import refit_scales
    scales, gain = refit_scales(W, H, q, zeros, g_idx, scales)
"""

from __future__ import annotations

import torch
from torch import Tensor

ROW_SLICE = 256  # rows solved at once: [rows, G, G] systems and [rows, in] temporaries


def _systems(W: Tensor, H: Tensor, V: Tensor, members: list[Tensor], onehot: Tensor) -> tuple[Tensor, Tensor]:
    """M [rows, G, G] and b [rows, G] for one slice of rows (V = q - z, [rows, in]; onehot [in, G])."""
    rows, G = V.shape[0], len(members)
    b = (V * (W @ H)) @ onehot  # [rows, G]
    M = V.new_empty(rows, G, G)
    for g, cols in enumerate(members):
        P = V[:, cols] @ H[cols]  # [rows, in]: (H v_rg)ᵀ
        M[:, g] = (P * V) @ onehot
    return M, b


def _quad(M: Tensor, b: Tensor, s: Tensor) -> Tensor:
    """sᵀ M s - 2 bᵀ s per row: the row's output error up to a constant."""
    return (s.unsqueeze(1) @ M @ s.unsqueeze(2)).reshape(-1) - 2 * (b * s).sum(1)


def refit_scales(
    W: Tensor, H: Tensor, q: Tensor, zeros: Tensor, g_idx: Tensor, scales: Tensor
) -> tuple[Tensor, float]:
    """The float16-representable scales [groups, out] that minimise ``tr((W - Ŵ) H (W - Ŵ)ᵀ)`` for
    the fixed codes ``q`` [out, in] and ``zeros`` [groups, out] (GPTQ v1 layout, ``g_idx`` [in] the
    group of each column), and the error removed (in the same units: the sum over rows of
    the quadratic's drop, computed in float64 accumulation).

    ``W`` [out, in] is the original weight and ``H`` [in, in] its inputs' Hessian (undamped is
    the real output error; a dead input with H_ii = 0 has v = 0 and does not matter). Rows whose
    system is singular, whose solution is not finite and positive, or whose fp16-rounded
    solution would not lower the error keep their old scales."""
    out_f, in_f = W.shape
    G = scales.shape[0]
    W = W.to(torch.float32)
    H = H.to(device=W.device, dtype=torch.float32)
    g_idx = g_idx.to(device=W.device, dtype=torch.int64)
    members = [torch.nonzero(g_idx == g).reshape(-1) for g in range(G)]
    onehot = torch.nn.functional.one_hot(g_idx, G).to(torch.float32)  # [in, G]
    new = scales.clone()
    gain = 0.0
    for r0 in range(0, out_f, ROW_SLICE):
        rows = slice(r0, min(r0 + ROW_SLICE, out_f))
        V = q[rows].to(torch.float32) - zeros[g_idx, rows].T.to(torch.float32)  # [rows, in]
        M, b = _systems(W[rows], H, V, members, onehot)
        Md, bd = M.double(), b.double()
        Md = (Md + Md.transpose(1, 2)) / 2
        d = Md.diagonal(dim1=1, dim2=2)
        empty = d <= 0  # a group whose codes all sit at the zero point: its scale does not matter
        ridge = 1e-9 * d.clamp_min(0).mean(1, keepdim=True).clamp_min(1e-30)
        A = Md + torch.diag_embed(torch.where(empty, torch.ones_like(d), ridge))
        s, info = torch.linalg.solve_ex(A, bd)
        old = scales[:, rows].T.double()  # [rows, G]
        s = torch.where(empty, old, s).to(torch.float16).double()  # stored in fp16
        ok = (info == 0) & torch.isfinite(s).all(1) & (s > 0).all(1)
        drop = _quad(Md, bd, old) - _quad(Md, bd, s)
        ok &= drop > 0
        new[:, rows] = torch.where(ok[None, :], s.T.to(new.dtype), new[:, rows])
        gain += float(drop[ok].sum())
    return new, gain
