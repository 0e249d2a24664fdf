"""Swap-KL: how much the output distribution moves when adjacent blocks trade places.

Usage::

    from layercut.compress.select.swap_kl import swap_kl_scores
    res = swap_kl_scores(model, calib, samples=4)     # or (model, tokenizer, source=...)
    res["interchange"][i]   # d_int(i, i+1) = E_t KL(p_M ‖ p_M with blocks i, i+1 swapped)
    res["replacement"][i]   # d_repl(i, i+1) = max(KL with i's weights in i+1's slot, and vice versa)

    layercut score MODEL --method swap-kl --json

A diagnostic, not a selector: small d_int / d_repl means the two blocks compute nearly
interchangeable functions, which is what makes a span removable or fusable. Each pair
costs one (interchange) or two (replacement) full-model forwards on a few sequences, so
keep ``samples`` small: 3·(L−1) forwards of samples × seq_len tokens in all. Blocks are
swapped in the model's ``nn.ModuleList`` (each moved block's ``layer_idx`` set to its new
slot, everything restored afterwards); no private per-layer loop. The blocks before a pair
are unchanged, so their output is cached once (from the capture driver) and stand-in
modules return it — the same ModuleList stand-in trick the driver uses — which halves the
block compute on average. In Gemma-style models the slot decides the mask type (sliding /
full), so a swapped block sees its slot's mask.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from layercut.calibrate import DEFAULT_CALIB_TEXT
from layercut.calibrate.capture import run_blocks
from layercut.calibrate.data import CalibSet, Sources, calibration_batch
from layercut.compress.core.arch import arch_for
from layercut.compress.core.errors import LayercutError


def token_kl(ref_logp: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor,
             ref_p: torch.Tensor | None = None) -> float:
    """Mean over real tokens of KL(p_ref ‖ p): log-probs [B, L, V], logits [B, L, V], mask [B, L]."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    ref_p = ref_logp.exp() if ref_p is None else ref_p
    kl = (ref_p * (ref_logp - logp)).sum(-1)  # [B, L]
    return float(kl[mask.bool()].mean())


class _Cached(nn.Module):
    """Stands in for block 0 of a skipped prefix: returns the cached stream h_start."""

    def __init__(self, h: torch.Tensor):
        super().__init__()
        self.h = h

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.h


class _PassThrough(nn.Module):
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


@contextlib.contextmanager
def _skip_prefix(layers: nn.ModuleList, start: int, streams: list[torch.Tensor]) -> Iterator[None]:
    """Blocks 0..start−1 replaced by stand-ins that yield the cached h_start (restored after)."""
    saved = [layers[i] for i in range(start)]
    try:
        for i in range(start):
            layers[i] = _Cached(streams[start]) if i == 0 else _PassThrough()
        yield
    finally:
        for i, block in enumerate(saved):
            layers[i] = block


def _set_layer_idx(block: nn.Module, index: int) -> list[tuple[nn.Module, int]]:
    """Point every ``layer_idx`` inside ``block`` at ``index``; return the old values."""
    old = []
    for module in block.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            old.append((module, module.layer_idx))
            module.layer_idx = index
    return old


def _restore(old: list[tuple[nn.Module, int]]) -> None:
    for module, value in old:
        module.layer_idx = value


@torch.no_grad()
def swap_kl_scores(
    model: nn.Module,
    tokenizer_or_calib,
    source: Sources = DEFAULT_CALIB_TEXT,
    samples: int = 4,
    seq_len: int = 128,
    replacement: bool = True,
    progress: bool = True,
) -> dict:
    """Interchange and replacement KL for every adjacent pair (i, i+1), i = 0..L−2.

    ``tokenizer_or_calib``: a :class:`CalibSet` (its first ``samples`` rows, cut to
    ``seq_len`` tokens, are used) or a tokenizer (then ``samples`` × ``seq_len`` tokens are
    drawn from ``source``: any text :func:`layercut.calibrate.data.calibration_batch` takes, e.g. a
    ``ScoreConfig``'s ``text_sources()``).
    Returns ``{"pairs": [[i, i+1], ...], "interchange": [...], "replacement": [...] | None,
    "samples": N, "tokens": T}`` with KLs in nats per token.
    """
    if isinstance(tokenizer_or_calib, CalibSet):
        rows = slice(0, samples)
        calib = CalibSet(tokenizer_or_calib.input_ids[rows, :seq_len], tokenizer_or_calib.attention_mask[rows, :seq_len])
    else:
        calib = calibration_batch(tokenizer_or_calib, source, samples=samples, seq_len=seq_len, seed=0)
    if not bool(calib.attention_mask.bool().any(dim=1).all()):
        raise LayercutError(f"swap-kl: a calibration row has no real tokens in its first {seq_len} positions")
    device = next(model.parameters()).device
    ids, mask = calib.input_ids.to(device), calib.attention_mask.to(device)
    streams: list[torch.Tensor] = []  # h_l entering each block, one micro-batch of all samples
    run_blocks(model, calib, [lambda run: streams.append(run.inputs[0])], batch_size=calib.num_samples,
               progress=False)

    def kl(start: int) -> float:
        with _skip_prefix(layers, start, streams):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return token_kl(ref, logits, mask, ref_p)

    ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask, use_cache=False).logits.double(), dim=-1)
    ref_p = ref.exp()
    layers = arch_for(model).layers_of(model)
    n = len(layers)
    inter, repl = [], []
    for i in tqdm(range(n - 1), desc="swap-kl", disable=not progress, unit="pair"):
        a, b = layers[i], layers[i + 1]
        old = _set_layer_idx(a, i + 1) + _set_layer_idx(b, i)
        layers[i], layers[i + 1] = b, a
        try:
            inter.append(kl(i))
        finally:
            layers[i], layers[i + 1] = a, b
            _restore(old)
        if replacement:
            kls = []
            for src, dst in ((i, i + 1), (i + 1, i)):
                clone = copy.deepcopy(layers[src])  # src's weights in dst's slot
                _set_layer_idx(clone, dst)
                original = layers[dst]
                layers[dst] = clone
                try:
                    kls.append(kl(dst))  # blocks before dst are unchanged
                finally:
                    layers[dst] = original
                del clone
            repl.append(max(kls))
    return {
        "pairs": [[i, i + 1] for i in range(n - 1)],
        "interchange": inter,
        "replacement": repl if replacement else None,
        "samples": calib.num_samples,
        "tokens": int(mask.sum()),
    }
