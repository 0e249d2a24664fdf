"""Random GPTQ codes for the pack / kernel / QuantLinear tests (one generator, three users)."""

from __future__ import annotations

import torch


def random_codes(
    bits: int,
    in_f: int,
    out_f: int,
    gs: int,
    act_order: bool = False,
    seed: int = 0,
    zmin: int = 1,
    scale: tuple[float, float] = (0.02, 1e-3),
    pow2_scales: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [out, in]``, ``z [groups, out]``, fp16-exact ``s [groups, out]``, int32 ``g_idx [in]``
    and the dense ``W [out, in] = s[g] · (q − z[g])`` they encode.

    ``gs = -1`` is one group over all inputs; ``act_order`` shuffles ``g_idx``; scales are
    ``rand · scale[0] + scale[1]``, rounded to fp16 so packing and dequantizing are exact.
    ``pow2_scales=(lo, hi)`` draws scales 2^-e with e in [lo, hi] instead: then every weight
    s·(q − z) and every product with a small-integer x is exact in fp16, bf16 and fp32, and so
    is every partial sum while it stays below 2^24 units of 2^-hi (see :func:`exact_sum_ok`).
    """
    gen = torch.Generator().manual_seed(seed * 1009 + bits * 31 + in_f + out_f + gs)
    g = in_f if gs == -1 else gs
    groups = (in_f + g - 1) // g
    g_idx = torch.arange(in_f) // g
    if act_order:
        g_idx = g_idx[torch.randperm(in_f, generator=gen)]
    maxq = (1 << bits) - 1
    q = torch.randint(0, maxq + 1, (out_f, in_f), generator=gen)
    z = torch.randint(zmin, maxq + 1, (groups, out_f), generator=gen)
    if pow2_scales is None:
        s = (torch.rand(groups, out_f, generator=gen) * scale[0] + scale[1]).half().float()
    else:
        e = torch.randint(pow2_scales[0], pow2_scales[1] + 1, (groups, out_f), generator=gen)
        s = torch.pow(2.0, -e.float())
    w = s[g_idx].T * (q.float() - z[g_idx].T.float())
    return q, z, s, g_idx.to(torch.int32), w


def small_int_x(shape: tuple[int, ...], seed: int = 0, amp: int = 3) -> torch.Tensor:
    """fp32 activations with integer values in [-amp, amp] (exact in fp16 and bf16)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-amp, amp + 1, shape, generator=gen).float()


def exact_sum_ok(x: torch.Tensor, pow2_scales: tuple[int, int], bits: int) -> bool:
    """Whether x @ W^T with pow2 scales is exact in fp32 in any summation order and factoring.

    Every term is a multiple of u = 2^-hi; the largest partial sum any order, or a factoring
    such as ``s·Σ x·(q − z)`` or ``s·(Σ x·q − z·Σ x)``, can form is below
    K·max|x|·2·(2^bits − 1)·2^-lo. fp32 holds every multiple of u up to 2^24·u exactly.
    """
    lo, hi = pow2_scales
    bound = x.shape[-1] * float(x.abs().max()) * 2 * ((1 << bits) - 1) * 2.0 ** (hi - lo)
    return bound < 2**24
