"""What the planner measures: KL to the source on held-apart calibration sequences, RTN
predictions of each quantization's KL, decode speed.

Usage::

    judge = KLJudge("src-dir", tokenizer, sources, samples=16, seq_len=128, seed=0, calib_samples=64)
    judge.kl_path("candidate-dir")          # mean KL(p_source || p_candidate) per token
    judge.rtn_kl((3, 64))                   # the source, round-to-nearest at 3 bits g64, same KL

The sequences are :func:`layercut.compress.quant.search.mixed.held_apart`'s: windows of the
calibration text after the part every calibration window of ``calib_samples`` comes from,
so no candidate was fitted on them; never a validation or test text. The source's
log-probabilities are computed once and kept ([N·L, vocab] float32: 16 × 128 tokens of a
49k vocabulary are 400 MB); candidates load whole, in float32 (quantized ones through
layercut's GPTQ loader).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from layercut.compress.core.arch import arch_for, target_linears
from layercut.compress.io.models import load_model
from layercut.compress.quant.search.mixed import held_apart
from layercut.compress.quant.solve.driver import linear_weight, set_weight
from layercut.compress.quant.solve.gptq import rtn_quantize


class KLJudge:
    """KL to the source model on fixed held-apart calibration windows."""

    def __init__(self, source: Path, tokenizer, sources, samples: int, seq_len: int, seed: int,
                 calib_samples: int, batch_size: int = 4) -> None:
        self.held, self.how = held_apart(tokenizer, sources, samples, seq_len, seed, calib_samples)
        self.batch_size = batch_size
        self.source = source
        self.model, _ = load_model(source, dtype=torch.float32, with_tokenizer=False)
        self.ref = [self._logprobs(self.model, ids, mask) for ids, mask in self.held.split(batch_size)]
        self.tokens = int(self.held.attention_mask.sum())
        self.seconds = 0.0

    @staticmethod
    @torch.no_grad()
    def _logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [B, L, V]
        return F.log_softmax(logits, dim=-1)[mask.bool()]  # [tokens, V]

    @torch.no_grad()
    def kl_model(self, model) -> float:
        """Mean over the held-apart tokens of KL(p_source ‖ p_model)."""
        start, total = time.perf_counter(), 0.0
        for (ids, mask), ref in zip(self.held.split(self.batch_size), self.ref):
            lp = self._logprobs(model, ids, mask)
            total += float((ref.exp() * (ref - lp)).sum())
        self.seconds += time.perf_counter() - start
        return total / self.tokens

    def kl_path(self, path: str | Path) -> float:
        model, _ = load_model(path, dtype=torch.float32, with_tokenizer=False)
        try:
            return self.kl_model(model)
        finally:
            del model

    def rtn_kl(self, config: tuple[int, int]) -> float:
        """KL of the source with every quantized linear rounded to nearest at ``config`` (no data)."""
        model = self.model  # rounded in place, then the source's weights are put back
        spec = arch_for(model)
        saved = []
        try:
            for _, _, _, module in target_linears(model, spec):
                W = linear_weight(module, spec.conv1d)
                saved.append((module, W.clone()))
                set_weight(module, rtn_quantize(W, config[0], config[1]).dequant.to(W.dtype), spec.conv1d)
            return self.kl_model(model)
        finally:
            for module, W in saved:
                set_weight(module, W, spec.conv1d)

    def close(self) -> None:
        self.model, self.ref = None, []


@torch.no_grad()
def decode_tokens_per_s(path: str | Path, tokenizer, new_tokens: int = 8, prompt_tokens: int = 32) -> float:
    """Batch-1 greedy decode speed (tokens/s after a warm-up token) of the checkpoint at ``path``."""
    model, _ = load_model(path, dtype=torch.float32, with_tokenizer=False)
    ids = torch.arange(3, 3 + prompt_tokens).unsqueeze(0) % max(int(model.config.vocab_size), 4)
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                   pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0)
    seconds = time.perf_counter() - start
    del model
    return new_tokens / seconds


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None below 3 points.

    >>> spearman([1, 2, 3, 4], [10, 20, 40, 30])
    0.8
    """
    if len(a) < 3 or len(a) != len(b):
        return None

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return round(cov / (va * vb), 4) if va and vb else None
