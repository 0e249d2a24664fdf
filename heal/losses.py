"""Healing losses: token-level distillation (full or top-k cached teacher) and LM loss.

Usage::

    from layercut.heal.losses import kd_loss, topk_kd_loss, lm_loss, teacher_topk
    loss = kd_loss(student_logits, teacher_logits, mask, temperature=1.0)      # [B, L, V] each
    cache = teacher_topk(teacher_logits, k=64, temperature=1.0)                 # store once
    loss = topk_kd_loss(student_logits, cache.logp, cache.idx, cache.tail_logp, mask)

Plain tensor functions: no models, no files. Distillation follows Hinton et al. (2015),
"Distilling the Knowledge in a Neural Network", §2: KL(p_T ‖ p_S) between the softened
distributions softmax(z/τ), scaled by τ² so gradient magnitudes do not depend on τ.
The KL is token-level (every non-pad position, Kim & Rush 2016 "word-level KD") and
averaged over those positions.

Top-k approximation (used when the teacher's logits are cached instead of recomputed):
keep the teacher's k largest log-probs per token plus the log of the remaining mass
(the *tail*). The loss is the exact KL between teacher and student after both are
coarse-grained onto k + 1 outcomes: the k cached tokens and one bucket holding every
other token,

    KL_k = Σ_{i∈S} p_i (log p_i − log q_i) + p_tail (log p_tail − log q_tail),

with q_tail = Σ_{j∉S} q_j computed exactly from the student's logits. By the log-sum
inequality KL_k ≤ KL, with equality when k = V (empty tail) or when the student's tail
is proportional to the teacher's. The student is taught the teacher's top-k shape and
its total tail mass, not how that mass is spread over the tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def _masked_mean(per_token: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of ``per_token`` [...] over positions where ``mask`` [...] is true."""
    if mask is None:
        return per_token.mean()
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp_min(1.0)


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None = None,
            temperature: float = 1.0) -> Tensor:
    """τ²·KL(p_T ‖ p_S) per token, averaged over ``mask``.

    student_logits, teacher_logits: [..., V]; mask: [...] (1 on real tokens) or None.
    Computed in float32 whatever the input dtype. Returns a scalar.
    """
    t = float(temperature)
    log_q = F.log_softmax(student_logits.float() / t, dim=-1)
    log_p = F.log_softmax(teacher_logits.float() / t, dim=-1)
    per_token = (log_p.exp() * (log_p - log_q)).sum(-1)  # [...]
    return _masked_mean(per_token, mask) * (t * t)


@dataclass
class TopK:
    """A teacher's top-k log-probs for a batch of tokens (at one temperature).

    logp: [..., k] float32, log p_i of the k most likely tokens (descending);
    idx: [..., k] int64 (or int32 on disk), their token ids;
    tail_logp: [...] float32, log of the mass outside the k tokens (−inf when k = V).
    """

    logp: Tensor
    idx: Tensor
    tail_logp: Tensor


@torch.no_grad()
def teacher_topk(teacher_logits: Tensor, k: int, temperature: float = 1.0) -> TopK:
    """Top-k log-probs of softmax(z/τ) and the log tail mass. teacher_logits: [..., V]."""
    t = float(temperature)
    log_p = F.log_softmax(teacher_logits.float() / t, dim=-1)
    vocab = log_p.shape[-1]
    k = min(int(k), vocab)
    values, idx = log_p.topk(k, dim=-1)
    if k == vocab:
        tail = torch.full(values.shape[:-1], float("-inf"), dtype=values.dtype, device=values.device)
    else:
        tail = torch.logsumexp(log_p.scatter(-1, idx, float("-inf")), dim=-1)
    return TopK(values, idx, tail)


def topk_kd_loss(student_logits: Tensor, topk_logp: Tensor, topk_idx: Tensor, tail_logp: Tensor,
                 mask: Tensor | None = None, temperature: float = 1.0) -> Tensor:
    """τ²·KL over the top-k support plus one tail bucket (see the module docstring).

    student_logits: [..., V]; topk_logp, topk_idx: [..., k] (teacher, same temperature);
    tail_logp: [...]; mask: [...] or None. Returns a scalar; equals :func:`kd_loss` when k = V.
    """
    t = float(temperature)
    z = student_logits.float() / t
    lse = torch.logsumexp(z, dim=-1)  # [...]
    idx = topk_idx.long()
    log_q_top = z.gather(-1, idx) - lse.unsqueeze(-1)  # [..., k]
    p_top = topk_logp.float().exp()
    per_token = (p_top * (topk_logp.float() - log_q_top)).sum(-1)
    if idx.shape[-1] < z.shape[-1]:  # a non-empty tail: k < V for every token
        log_q_tail = torch.logsumexp(z.scatter(-1, idx, float("-inf")), dim=-1) - lse
        tail = tail_logp.float()
        p_tail = tail.exp()
        # xlogy-style: a tail of exactly zero teacher mass contributes nothing
        per_token = per_token + torch.where(p_tail > 0, p_tail * (tail - log_q_tail), torch.zeros_like(p_tail))
    return _masked_mean(per_token, mask) * (t * t)


def lm_loss(logits: Tensor, input_ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """Next-token cross-entropy: logits [B, L, V] at t predict input_ids [B, L] at t+1.

    A position counts when both it and its target are real tokens (mask [B, L]).
    """
    pred = logits[:, :-1].float()
    target = input_ids[:, 1:]
    nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="none")
    nll = nll.view(target.shape)
    valid = None if mask is None else (mask[:, :-1].bool() & mask[:, 1:].bool())
    return _masked_mean(nll, valid)


def heal_loss(kind: str, student_logits: Tensor, input_ids: Tensor, mask: Tensor | None,
              teacher_logits: Tensor | None = None, topk: TopK | None = None,
              temperature: float = 1.0, kd_weight: float = 0.5) -> Tensor:
    """The training objective: ``kd``, ``lm`` or ``kd+lm`` = w·KD + (1 − w)·LM.

    Teacher signal from ``teacher_logits`` [B, L, V] (on the fly) or ``topk`` (cached).
    """
    def kd() -> Tensor:
        if topk is not None:
            return topk_kd_loss(student_logits, topk.logp, topk.idx, topk.tail_logp, mask, temperature)
        if teacher_logits is None:
            raise ValueError("kd loss needs teacher_logits or a top-k cache")
        return kd_loss(student_logits, teacher_logits, mask, temperature)

    if kind == "kd":
        return kd()
    if kind == "lm":
        return lm_loss(student_logits, input_ids, mask)
    if kind == "kd+lm":
        return kd_weight * kd() + (1.0 - kd_weight) * lm_loss(student_logits, input_ids, mask)
    raise ValueError(f"unknown loss '{kind}' (kd, lm, kd+lm)")
