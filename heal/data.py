"""Healing data: token windows, their per-step order, and the teacher's top-k cache.

Usage::

    from layercut.heal.data import heal_data, build_topk_cache, HealDataset
    data = heal_data(tokenizer, cfg)                          # CalibSet [N, seq_len]
    cache = build_topk_cache(teacher, data, k=64)             # teacher runs once, then can go
    ds = HealDataset(data, total=cfg.steps * cfg.batch, seed=cfg.seed, cache=cache)

Windows come from :func:`layercut.calibrate.data.calibration_batch` (one source, or several mixed
by weight) with the run's seed and an offset per source (``HealConfig.source_offsets``:
300,000 tokens into the bundled Brown calibration stream, past everything a default
calibration draw reads; 0 elsewhere), with BOS prepended like the eval protocol does.
The evaluation texts (``bundled:brown-heldout`` and its halves ``bundled:brown-val`` /
``bundled:brown-test``) are refused, also as one entry of a mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from layercut.calibrate.capture import run_blocks
from layercut.calibrate.data import EVAL_TEXTS, CalibSet, calibration_batch
from layercut.compress.core.errors import LayercutError
from layercut.compress.io.lazy import LazyModel
from layercut.heal.config import HealConfig
from layercut.heal.losses import teacher_topk
from layercut.heal.progress import progress_bar


def heal_data(tokenizer, cfg: HealConfig) -> CalibSet:
    """``cfg.num_samples`` windows of ``cfg.seq_len`` tokens ([BOS] + text when there is a BOS).

    ``cfg.data`` may mix several sources by weight (:func:`layercut.calibrate.data.calibration_batch`);
    each starts at its own offset (:meth:`HealConfig.source_offsets`).
    """
    sources = cfg.text_sources()
    for src in sources:
        if src.source.strip() in EVAL_TEXTS:
            raise LayercutError(f"{src.source.strip()} is evaluation text ({', '.join(EVAL_TEXTS)}); heal on other "
                                "data (default bundled:brown-calib)")
    bos = tokenizer.bos_token_id
    body = cfg.seq_len - 1 if bos is not None else cfg.seq_len
    calib = calibration_batch(tokenizer, sources, samples=cfg.num_samples, seq_len=body,
                              seed=cfg.seed, offset=cfg.source_offsets())
    if int(calib.attention_mask.sum()) < 2:
        raise LayercutError(f"heal data '{cfg.text_label()}' is empty after tokenization")
    if bos is None:
        return calib
    n = calib.num_samples
    ids = torch.cat([torch.full((n, 1), bos, dtype=torch.long), calib.input_ids], dim=1)
    mask = torch.cat([torch.ones((n, 1), dtype=torch.long), calib.attention_mask], dim=1)
    return CalibSet(ids, mask)


def sample_order(n_samples: int, total: int, seed: int) -> torch.Tensor:
    """Which sample each of ``total`` draws uses: fresh permutations of N, seeded. [total] long."""
    gen = torch.Generator().manual_seed(seed + 1)
    epochs = (total + n_samples - 1) // n_samples
    return torch.cat([torch.randperm(n_samples, generator=gen) for _ in range(epochs)])[:total]


@dataclass
class TopKCache:
    """The teacher's top-k log-probs for every token of a heal data set.

    logp [N, L, k] float32, idx [N, L, k] int32, tail_logp [N, L] float32; memory is
    N·L·(8k + 4) bytes (e.g. 800 × 256 tokens at k = 64: 105 MB).
    """

    logp: torch.Tensor
    idx: torch.Tensor
    tail_logp: torch.Tensor
    temperature: float
    vocab: int

    @property
    def k(self) -> int:
        return int(self.logp.shape[-1])

    def check(self, data: CalibSet, vocab: int, temperature: float) -> None:
        if tuple(self.logp.shape[:2]) != tuple(data.input_ids.shape):
            raise LayercutError(f"top-k cache covers {tuple(self.logp.shape[:2])} tokens but the heal data is "
                                f"{tuple(data.input_ids.shape)}; rebuild it for this config")
        if self.vocab != vocab:
            raise LayercutError(f"top-k cache is over {self.vocab} tokens, the student has {vocab} logits")
        if self.temperature != temperature:
            raise LayercutError(f"top-k cache was built at temperature {self.temperature}, config asks {temperature}")


@torch.no_grad()
def build_topk_cache(teacher: torch.nn.Module, data: CalibSet, k: int, temperature: float = 1.0,
                     batch_size: int = 4, progress: bool = True) -> TopKCache:
    """Run the teacher once over ``data`` and keep its top-k log-probs (see layercut.heal.losses)."""
    teacher.eval()
    device = next(teacher.parameters()).device
    logps, idxs, tails = [], [], []
    vocab = 0
    for ids, mask in progress_bar(data.split(batch_size), desc="teacher top-k", unit="batch", enabled=progress):
        logits = teacher(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        vocab = int(logits.shape[-1])
        top = teacher_topk(logits, k, temperature)
        logps.append(top.logp.cpu())
        idxs.append(top.idx.to(torch.int32).cpu())
        tails.append(top.tail_logp.cpu())
        del logits
    return TopKCache(torch.cat(logps), torch.cat(idxs), torch.cat(tails), float(temperature), vocab)


CHUNK_BYTES = 256 << 20  # last-block outputs of the streamed teacher held at once (float32 bytes)
POSITION_SLICE = 128  # positions whose [positions, vocab] logits are alive at once


@torch.no_grad()
def build_topk_cache_streamed(path, data: CalibSet, k: int, temperature: float = 1.0, batch_size: int = 4,
                              progress: bool = True, dtype: torch.dtype = torch.float32,
                              trust_remote_code: bool = False) -> TopKCache:
    """:func:`build_topk_cache` with the teacher read from its checkpoint ``path`` one decoder block at a
    time (:class:`~layercut.compress.io.lazy.LazyModel` over :func:`~layercut.calibrate.capture.run_blocks`),
    computed in ``dtype``: never the whole teacher in memory. The data goes through in chunks whose
    last-block outputs fit :data:`CHUNK_BYTES` (each chunk streams the blocks again); the final norm and
    head run :data:`POSITION_SLICE` positions at a time. Memory: one block, the embedding or the head, and
    one chunk's activations."""
    lazy = LazyModel(path, compute_dtype=dtype, trust_remote_code=trust_remote_code)
    hidden_size = int(lazy.config.get_text_config().hidden_size)
    per_chunk = max(batch_size, CHUNK_BYTES // (4 * hidden_size * max(data.seq_len, 1)) // batch_size * batch_size)
    logps, idxs, tails = [], [], []
    vocab = 0
    bar = progress_bar(total=data.num_samples, desc="teacher top-k", unit="seq", enabled=progress)
    for c0 in range(0, data.num_samples, per_chunk):
        part = CalibSet(data.input_ids[c0:c0 + per_chunk], data.attention_mask[c0:c0 + per_chunk])
        hidden = run_blocks(lazy.model, part, [], batch_size=batch_size, progress=False)
        lazy.release_outside()
        for h in hidden:  # [B, S, D] per micro-batch
            for row in h:
                pieces = []
                for p0 in range(0, row.shape[0], POSITION_SLICE):
                    logits = lazy.head_logits(row[p0:p0 + POSITION_SLICE])
                    vocab = int(logits.shape[-1])
                    pieces.append(teacher_topk(logits, k, temperature))
                    del logits
                logps.append(torch.cat([t.logp for t in pieces]).unsqueeze(0).cpu())
                idxs.append(torch.cat([t.idx for t in pieces]).to(torch.int32).unsqueeze(0).cpu())
                tails.append(torch.cat([t.tail_logp for t in pieces]).unsqueeze(0).cpu())
                bar.update(1)
        del hidden
        lazy.release_outside()
    bar.close()
    return TopKCache(torch.cat(logps), torch.cat(idxs), torch.cat(tails), float(temperature), vocab)


def distill_target(teacher: torch.nn.Module | TopKCache, data: CalibSet, cfg: HealConfig,
                   progress: bool = True) -> torch.nn.Module | TopKCache:
    """What the student learns from: with ``cfg.teacher_topk`` set, the teacher's top-k cache over
    ``data`` (the teacher runs once and the caller can free it); otherwise the teacher itself."""
    if isinstance(teacher, TopKCache) or not cfg.teacher_topk:
        return teacher
    return build_topk_cache(teacher, data, cfg.teacher_topk, cfg.temperature, cfg.batch_size, progress)


class HealDataset(Dataset):
    """Item i = the sample drawn at position i of the training order (with its top-k if cached)."""

    def __init__(self, data: CalibSet, total: int, seed: int, cache: TopKCache | None = None):
        self.data, self.cache = data, cache
        self.order = sample_order(data.num_samples, total, seed)

    def __len__(self) -> int:
        return int(self.order.numel())

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = int(self.order[i])
        item = {"input_ids": self.data.input_ids[j], "attention_mask": self.data.attention_mask[j]}
        if self.cache is not None:
            item.update(topk_logp=self.cache.logp[j], topk_idx=self.cache.idx[j], tail_logp=self.cache.tail_logp[j])
        return item
