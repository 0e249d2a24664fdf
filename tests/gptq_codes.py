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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [out, in]``, ``z [groups, out]``, fp16-exact ``s [groups, out]``, int32 ``g_idx [in]``
    and the dense ``W [out, in] = s[g] · (q − z[g])`` they encode.

    ``gs = -1`` is one group over all inputs; ``act_order`` shuffles ``g_idx``; scales are
    ``rand · scale[0] + scale[1]``, rounded to fp16 so packing and dequantizing are exact.
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
    s = (torch.rand(groups, out_f, generator=gen) * scale[0] + scale[1]).half().float()
    w = s[g_idx].T * (q.float() - z[g_idx].T.float())
    return q, z, s, g_idx.to(torch.int32), w
