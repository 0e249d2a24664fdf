"""Tensor-level depth-compression formulas: no model, no hooks, no files.

Usage::

    from layercut.compress.depth.cores import lstsq_map, cosine_map, merge_map_into_down, laco_merge
    T = lstsq_map(gram.xtx, gram.xty, alpha=1e-3)        # ReplaceMe closed form, [D, D]
    T = cosine_map(M, target, steps=300, lr=1e-4)          # ReplaceMe cosine variant
    down.weight.copy_(merge_map_into_down(down.weight, T)) # y -> y T folded into the weight
    fused = laco_merge(base_w, [w_1, w_2], coeff=1.0)      # LaCo RDSC layer merge

References: Shopkhoev et al. 2025, "ReplaceMe: Network Simplification via Depth Pruning
and Transformer Block Linear Replacement" (§3: T = argmin ‖M T − (L − Y)‖ with M the MLP
output of the block before the span, Y its output minus M, L the output of the span's last
block; closed form and cosine objective); Yang et al. 2024, "LaCo: Large Language Model
Pruning via Layer Collapse" (§3.2, Reserving-Differences-while-Seeking-Common layer merge:
θ*_l = θ_l + Σ_k (θ_{l+k} − θ_l)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def runs_of(layers: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of sorted, distinct indices as inclusive (first, last) pairs.

    ``[3, 4, 5, 9]`` -> ``[(3, 5), (9, 9)]``.
    """
    out: list[tuple[int, int]] = []
    for i in sorted(set(int(x) for x in layers)):
        if out and i == out[-1][1] + 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def lstsq_map(xtx: torch.Tensor, xty: torch.Tensor, alpha: float = 0.0) -> torch.Tensor:
    """Ridge least squares T = (MᵀM + αI)⁻¹ Mᵀ(L − Y), solved in float64.

    xtx: [D, D] = MᵀM; xty: [D, D'] = Mᵀ(L − Y) (both accumulated over real tokens).
    ``alpha`` is relative to the mean diagonal of MᵀM (scale-free damping); a singular
    system is damped further until the Cholesky factorisation succeeds. Returns [D, D']
    float32 with ``M @ T`` ≈ L − Y.
    """
    a = xtx.double()
    b = xty.double()
    scale = float(a.diagonal().mean().clamp(min=1e-12))
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    damp = alpha
    for _ in range(8):
        chol, info = torch.linalg.cholesky_ex(a + damp * scale * eye)
        if int(info) == 0:
            return torch.cholesky_solve(b, chol).float()
        damp = max(damp * 10.0, 1e-8)
    raise ValueError("MᵀM is not positive definite even with damping; is the calibration data empty?")


def cosine_map(
    m: torch.Tensor,
    target: torch.Tensor,
    steps: int = 200,
    lr: float = 1e-4,
    batch_tokens: int = 1024,
    offset: torch.Tensor | None = None,
    init: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """T minimising Σ_t 1 − cos(offset_t + M_t T, target_t) with Adam, from T = I (ReplaceMe §3.2).

    m: [N, D] MLP outputs; target: [N, D'] rows on the same tokens. ``offset=None`` is the
    paper's simplified objective cos(M_t T, (L − Y)_t) (pass target = L − Y); ``offset=Y``
    with target = L is the unsimplified one, cos(Y_t + M_t T, L_t): the direction of the
    block output itself. Each step uses a random minibatch of ``batch_tokens`` rows.
    Returns [D, D'] float32.
    """
    m = m.float()
    target = target.float()
    offset = None if offset is None else offset.float()
    if init is None:
        if m.shape[1] != target.shape[1]:
            raise ValueError("T = I needs square maps; pass init for D != D'")
        init = torch.eye(m.shape[1])
    t = torch.nn.Parameter(init.detach().float().clone())
    opt = torch.optim.Adam([t], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    n = m.shape[0]
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(n, (batch_tokens,), generator=gen) if n > batch_tokens else slice(None)
            pred = m[idx] @ t if offset is None else offset[idx] + m[idx] @ t
            loss = (1.0 - torch.nn.functional.cosine_similarity(pred, target[idx], dim=-1, eps=1e-8)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return t.detach()


def mean_cosine_loss(
    m: torch.Tensor, target: torch.Tensor, t: torch.Tensor | None = None, offset: torch.Tensor | None = None
) -> float:
    """Mean 1 − cos(offset_t + M_t T, target_t) over rows (T = I when None): [N, D], [N, D'] -> float."""
    pred = m.float() if t is None else m.float() @ t.float()
    pred = pred if offset is None else offset.float() + pred
    return float((1.0 - torch.nn.functional.cosine_similarity(pred, target.float(), dim=-1, eps=1e-8)).mean())


def merge_map_into_down(weight: torch.Tensor, t: torch.Tensor, conv1d: bool = False) -> torch.Tensor:
    """Fold ``y -> y T`` into the projection producing y.

    nn.Linear weight [out, in] (y = x Wᵀ): returns Tᵀ W, [out', in].
    Conv1D weight [in, out] (GPT-2, y = x W): returns W T, [in, out'].
    A bias b [out] becomes ``b @ T`` (use :func:`merge_map_into_bias`).
    """
    t = t.to(torch.float64)
    w = weight.to(torch.float64)
    merged = w @ t if conv1d else t.T @ w
    return merged.to(weight.dtype)


def merge_map_into_bias(bias: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """b [out] -> b T [out'] (the bias is added before the map)."""
    return (bias.to(torch.float64) @ t.to(torch.float64)).to(bias.dtype)


def laco_merge(base: torch.Tensor, others: Sequence[torch.Tensor], coeff: float | torch.Tensor = 1.0) -> torch.Tensor:
    """LaCo's RDSC merge θ_l + c · Σ_k (θ_{l+k} − θ_l); c = 1 is the paper's formula.

    base: θ_l (any shape); others: the removed layers' same-named tensors. The sum runs
    in float32 (or float64 for float64 inputs) and the result keeps ``base``'s dtype.
    ``coeff`` may be a tensor (e.g. a learnable scalar) for calibration.
    """
    acc_dtype = torch.float64 if base.dtype == torch.float64 else torch.float32
    b = base.to(acc_dtype)
    diff = torch.zeros_like(b)
    for other in others:
        if other.shape != base.shape:
            raise ValueError(f"cannot merge tensors of shapes {tuple(base.shape)} and {tuple(other.shape)}")
        diff = diff + (other.to(acc_dtype) - b)
    merged = b + coeff * diff
    return merged if isinstance(coeff, torch.Tensor) and coeff.requires_grad else merged.to(base.dtype)
