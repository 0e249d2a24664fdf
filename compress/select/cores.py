"""Tensor-level layer-selection formulas: no model, no hooks, no files.

Usage::

    from layercut.compress.select.cores import (angular_last, angular_tokens, cosine_importance,
                                       span_distances, best_span, lowest, gate_norm_qk)
    d = angular_last(h_l, h_ln, mask)          # [B] per-sample arccos(cos)/π at the last real token
    bi = cosine_importance(h_l, h_next, mask)  # (Σ cos over real tokens, count) -> 1 − mean
    g = gate_norm_qk(w_q, w_k, num_heads=32, num_kv_heads=8)

Streams are ``[B, L, D]`` with a ``[B, L]`` bool mask (True on real tokens). Every
reduction runs in float64 and ignores padding. The stage wrappers in
:mod:`layercut.compress.select.driver` feed these from the capture driver; the tests check them
against direct computations on hand-made tensors.

References: Gromov et al. 2024, "The Unreasonable Ineffectiveness of the Deeper Layers"
(angular span distance, §3.2); Men et al. 2024, "ShortGPT" (Block Influence, eq. 1);
He et al. 2024, "What Matters in Transformers? Not All Attention is Needed" (LLM-Drop
sublayer cosine importance, §3); Gate-Norm: ‖W_Q W_Kᵀ‖_F of each attention layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from layercut.calibrate.stats import last_tokens, token_cosine


def angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """arccos(cos(a, b)) / π along the last dim, float64, in [0, 1]."""
    return torch.arccos(token_cosine(a, b).clamp(-1.0, 1.0)) / math.pi


def angular_last(h_a: torch.Tensor, h_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample angular distance at the last real token T: [B, L, D] x2, [B, L] -> [B] float64."""
    return angle(last_tokens(h_a, mask), last_tokens(h_b, mask))


def angular_tokens(h_a: torch.Tensor, h_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Angular distance of every real token: [B, L, D] x2, [B, L] -> [n_real] float64."""
    return angle(h_a, h_b)[mask.bool()]


def cosine_sum(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """(Σ cos(x_t, y_t), number of real tokens) over the masked tokens of [B, L, D] streams.

    Importance scores are ``1 − Σcos / count`` accumulated over micro-batches:
    ShortGPT's BI_l = 1 − E_t cos(h_l,t, h_{l+1},t) with (x, y) = (h_l, h_{l+1}); LLM-Drop's
    attention importance with (x, x + Attn(LN(x))) and MLP importance likewise.
    """
    cos = token_cosine(x, y)[mask.bool()]
    return float(cos.sum()), int(cos.numel())


def span_distances(states: Sequence[torch.Tensor], n: int) -> list[float]:
    """d(l, n) for l = 0..len(states)−1−n from per-layer last-token states.

    ``states[l]`` is h_l at the last real token of every sample, [N, D] (h_0 = embeddings,
    h_L = raw last-block output), so ``len(states) = L + 1``. Returns the mean over samples
    of arccos(cos(h_l,T, h_{l+n},T)) / π (Gromov et al. eq. 3).
    """
    if n < 1 or n >= len(states):
        raise ValueError(f"span {n} must be in 1..{len(states) - 1}")
    return [float(angle(states[i], states[i + n]).mean()) for i in range(len(states) - n)]


def best_span(distances: Sequence[float], n: int) -> list[int]:
    """Blocks l*..l*+n−1 with l* = argmin_l d(l, n) (first minimum on ties)."""
    start = min(range(len(distances)), key=lambda i: (distances[i], i))
    return list(range(start, start + n))


def lowest(scores: Sequence[float], k: int) -> list[int]:
    """Indices of the k lowest scores, sorted ascending by index (stable on ties)."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    return sorted(order[:k])


def ranking(scores: Sequence[float]) -> list[int]:
    """All indices, lowest score (least important, removed first) first."""
    return sorted(range(len(scores)), key=lambda i: (scores[i], i))


# -- Gate-Norm ------------------------------------------------------------------------------


def gate_norm_sq_per_head(w_q: torch.Tensor, w_k: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Σ-ready terms ‖W_Q,h W_K,g(h)ᵀ‖_F² per query head, from d_h×d_h Grams only.

    w_q: [H·d_h, d] and w_k: [H_kv·d_h, d] in nn.Linear layout (rows = output features),
    heads contiguous along the rows; query head h reads key head g(h) = h // (H / H_kv)
    (GQA, as ``repeat_kv`` does). In the paper's layout (q = x W_Q) the bilinear form of head
    h is W_Q,h W_K,gᵀ = w_q,hᵀ w_k,g ([d, d]); its squared norm is
    tr((w_q,h w_q,hᵀ)(w_k,g w_k,gᵀ)), a product of two [d_h, d_h] Grams, so the d×d matrix
    is never formed. Cost: d·d_h·(H + H_kv)·d_h multiply-adds. Returns [H] float64.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} key heads")
    d = w_q.shape[1]
    if w_q.shape[0] % num_heads or w_k.shape[1] != d:
        raise ValueError(f"q {tuple(w_q.shape)} / k {tuple(w_k.shape)} do not fit {num_heads} heads")
    head_dim = w_q.shape[0] // num_heads
    if w_k.shape[0] != num_kv_heads * head_dim:
        raise ValueError(f"k {tuple(w_k.shape)} is not {num_kv_heads} heads of dim {head_dim}")
    q = w_q.float().reshape(num_heads, head_dim, d)
    k = w_k.float().reshape(num_kv_heads, head_dim, d)
    gram_q = torch.bmm(q, q.transpose(1, 2))  # [H, d_h, d_h]
    gram_k = torch.bmm(k, k.transpose(1, 2))  # [H_kv, d_h, d_h]
    gram_k = gram_k.repeat_interleave(num_heads // num_kv_heads, dim=0)  # head h -> its KV group
    # tr(A B) = Σ_ij A_ij B_ji = Σ_ij A_ij B_ij for symmetric B.
    return (gram_q.double() * gram_k.double()).sum(dim=(1, 2))


def gate_norm_qk(w_q: torch.Tensor, w_k: torch.Tensor, num_heads: int, num_kv_heads: int | None = None) -> float:
    """Gate-Norm G = sqrt(Σ_h ‖W_Q,h W_K,g(h)ᵀ‖_F²): the norm (not its square).

    The Gate-Norm score is often written Σ_h tr((W_Q,h W_Q,hᵀ)(W_K,g W_K,gᵀ)), which is G². With one head this
    is exactly ‖W_Q W_Kᵀ‖_F; with several heads it is the norm of the per-head bilinear
    forms stacked side by side (the cross-head products, which attention never computes,
    are left out). Shapes as in :func:`gate_norm_sq_per_head`.
    """
    terms = gate_norm_sq_per_head(w_q, w_k, num_heads, num_kv_heads or num_heads)
    return float(terms.sum().clamp(min=0).sqrt())


def split_fused_qkv(
    weight: torch.Tensor, layout: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q [H·d_h, d], w_k [H_kv·d_h, d]) from one fused projection weight.

    layouts:
      ``stacked`` — Phi3 ``qkv_proj``: rows [q (H·d_h) | k (H_kv·d_h) | v (H_kv·d_h)].
      ``neox`` — GPT-NeoX ``query_key_value``: rows interleaved per head, [H, (q|k|v), d_h].
      ``conv1d`` — GPT-2 ``c_attn`` (transformers Conv1D): weight [d, 3·d] = (in, out),
      columns [q | k | v]; transposed to the Linear layout here.
    """
    if layout == "conv1d":
        weight = weight.T
        layout = "stacked"
    if layout == "stacked":
        q_rows, k_rows = num_heads * head_dim, num_kv_heads * head_dim
        if weight.shape[0] != q_rows + 2 * k_rows:
            raise ValueError(f"fused qkv {tuple(weight.shape)} is not q {q_rows} + k/v {k_rows} rows")
        return weight[:q_rows], weight[q_rows : q_rows + k_rows]
    if layout == "neox":
        if num_kv_heads != num_heads or weight.shape[0] != 3 * num_heads * head_dim:
            raise ValueError(f"NeoX fused qkv {tuple(weight.shape)} is not 3×{num_heads}×{head_dim} rows")
        per_head = weight.reshape(num_heads, 3, head_dim, weight.shape[1])
        return per_head[:, 0].reshape(-1, weight.shape[1]), per_head[:, 1].reshape(-1, weight.shape[1])
    raise ValueError(f"unknown fused qkv layout '{layout}' (stacked, neox, conv1d)")
