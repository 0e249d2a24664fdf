"""Streaming accumulators fed by the capture driver, one micro-batch at a time.

Usage::

    cos = CosineStats()
    cos.update(h_l, h_next, mask)          # [B, L, D], [B, L, D], [B, L] bool
    cos.mean_cosine(), cos.mean_angle()    # over every real token

    gram = GramStats(dim_x=D, dim_y=D)
    gram.update(x, y, mask)                # accumulates XᵀX and XᵀY in float64
    gram.xtx, gram.xty, gram.count

Everything masks padding tokens and accumulates in float64 where a Gram matrix is
solved later (see calibrate/capture.py: one capture driver for every stage).
"""

from __future__ import annotations

import math

import torch


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index T of the last real token per row: mask [B, L] -> [B] long."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1).clamp(min=0)


def last_tokens(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """States at the last real token: h [B, L, D], mask [B, L] -> [B, D]."""
    idx = last_token_index(mask)
    return h[torch.arange(h.shape[0], device=h.device), idx]


def token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token cosine in float64: [..., D] x [..., D] -> [...]."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1, eps=1e-12)


def angular_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """arccos(cos(a, b)) / π per token, in [0, 1]."""
    return torch.arccos(token_cosine(a, b).clamp(-1.0, 1.0)) / math.pi


class CosineStats:
    """Mean per-token cosine and angular distance between two streams over real tokens."""

    def __init__(self) -> None:
        self.cos_sum = 0.0
        self.angle_sum = 0.0
        self.count = 0

    def update(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        cos = token_cosine(a, b)
        if mask is not None:
            cos = cos[mask.bool()]
        cos = cos.reshape(-1)
        self.cos_sum += float(cos.sum())
        self.angle_sum += float((torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi).sum())
        self.count += cos.numel()

    def mean_cosine(self) -> float:
        return self.cos_sum / max(self.count, 1)

    def mean_angle(self) -> float:
        return self.angle_sum / max(self.count, 1)


class GramStats:
    """XᵀX (and optionally XᵀY) over real tokens, summed in float64.

    x: [B, L, dx] or [T, dx]; y likewise with dy; mask: [B, L] or [T] (True = real).
    Each micro-batch's product is computed in ``product_dtype`` (float32 by default: the
    costly [d, d] matmul at twice the float64 speed, with no float64 copy of the
    activations) and added to the float64 running sums, as quantize does for its
    Hessians. ``benchmarks/gram_precision.py`` measures float32 against float64 products
    on the lstsq replacement, the stage most sensitive to the Gram's conditioning.
    """

    product_dtype: torch.dtype = torch.float32

    def __init__(self, dim_x: int, dim_y: int | None = None, device: str | torch.device = "cpu"):
        self.xtx = torch.zeros(dim_x, dim_x, dtype=torch.float64, device=device)
        self.xty = None if dim_y is None else torch.zeros(dim_x, dim_y, dtype=torch.float64, device=device)
        self.count = 0

    def update(self, x: torch.Tensor, y: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> None:
        x = x.reshape(-1, x.shape[-1])
        if y is not None:
            y = y.reshape(-1, y.shape[-1])
        if mask is not None:
            keep = mask.reshape(-1).bool()
            x = x[keep]
            y = y[keep] if y is not None else None
        if y is None and self.xty is not None:
            raise ValueError("GramStats built with dim_y needs y")
        x = x.to(self.xtx.device, self.product_dtype)
        y = None if self.xty is None else y.to(self.xtx.device, self.product_dtype)
        if self.product_dtype == torch.float64:  # accumulate in place
            self.xtx.addmm_(x.T, x)
            if y is not None:
                self.xty.addmm_(x.T, y)
        else:  # the float32 product is promoted to float64 by the in-place add
            self.xtx.add_(x.T @ x)
            if y is not None:
                self.xty.add_(x.T @ y)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """GPTQ's H = 2/N Σ x xᵀ in float32."""
        return (2.0 / max(self.count, 1) * self.xtx).float()
