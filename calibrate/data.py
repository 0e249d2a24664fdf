"""Calibration batches: token windows drawn from one or several text sources.

Usage::

    from layercut.calibrate.data import load_texts, calibration_batch
    docs = load_texts("bundled:brown-calib")          # list[str]
    calib = calibration_batch(tokenizer, "bundled:brown-calib", samples=128, seq_len=512, seed=0)
    calib.input_ids, calib.attention_mask             # [N, L] each
    mix = [TextSource(source="bundled:brown-calib", weight=0.7),
           TextSource(source="hf:/data/chat@train[:500]", chat_template=True, weight=0.3)]
    calib = calibration_batch(tokenizer, mix, samples=128, seq_len=512, seed=0)   # ~90 + ~38 windows

Sources (:mod:`layercut.calibrate.sources`): the bundled Brown corpus, split by file id
(``calibrate/data/brown.json`` lists every split's file ids): ``bundled:brown-calib`` (400
files, calibration and healing), ``bundled:brown-val`` (50 held-out files, for choosing
defaults), ``bundled:brown-test`` (the other 50 held-out files, for reporting results) and
``bundled:brown-heldout`` (val + test, what results before the split were measured on); a
local ``.txt`` file (documents separated by blank lines), a local ``.jsonl`` file (a
``"text"`` field per line, or conversations with a chat template), or
``hf:NAME[:CONFIG][@SPLIT]`` through ``datasets.load_dataset`` (offline-friendly: local
dataset folders and cached datasets work without a network).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from layercut.calibrate.sources import BUNDLED_TEXTS, DATA_DIR, TextSource, documents
from layercut.compress.core.errors import LayercutError

__all__ = ["BUNDLED_TEXTS", "DATA_DIR", "EVAL_TEXTS", "CalibSet", "TextSource", "as_sources", "allocate",
           "calibration_batch", "load_texts", "token_stream"]

# Text no calibration or healing run may train on: the held-out files and their two halves.
EVAL_TEXTS = ("bundled:brown-heldout", "bundled:brown-val", "bundled:brown-test")
# What every function here accepts as "the text": a source string or path, one TextSource, or a mix.
Sources = str | os.PathLike | TextSource | Sequence[str | TextSource]


@dataclass
class CalibSet:
    """Token batches for calibration. ``attention_mask`` is 1 on real tokens, 0 on padding."""

    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def split(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (self.input_ids[i : i + batch_size], self.attention_mask[i : i + batch_size])
            for i in range(0, self.num_samples, batch_size)
        ]


def as_sources(source: Sources) -> list[TextSource]:
    """Any accepted form of "the text" as a list of :class:`TextSource`."""
    if isinstance(source, TextSource):
        return [source]
    if isinstance(source, (str, os.PathLike)):
        return [TextSource(source=str(source))]
    items = [s if isinstance(s, TextSource) else TextSource(source=str(s)) for s in source]
    if not items:
        raise LayercutError("no text source given (an empty list)")
    return items


def _documents(src: TextSource, tokenizer: Any) -> Iterable[str]:
    """``src``'s documents; a one-line error if there are none."""
    docs = documents(src, tokenizer)
    first = next(docs, None)
    if first is None:
        raise LayercutError(f"text source '{src.source}' is empty")
    return chain([first], docs)


def load_texts(source: str | os.PathLike | TextSource, tokenizer: Any = None) -> list[str]:
    """Documents of a text source, in order. Raises :class:`LayercutError` if empty/unreadable.

    ``tokenizer`` is needed only to render conversations (a source with ``chat_template``).
    """
    srcs = as_sources(source)
    if len(srcs) != 1:
        raise LayercutError("load_texts reads one source; calibration_batch mixes several")
    return list(_documents(srcs[0], tokenizer))


def allocate(weights: Sequence[float], samples: int) -> list[int]:
    """``samples`` split in proportion to ``weights`` (largest remainder; ties to the earlier source).

    >>> allocate([0.7, 0.3], 10), allocate([1, 1, 1], 4)
    ([7, 3], [2, 1, 1])
    """
    total = float(sum(weights))
    exact = [w * samples / total for w in weights]
    counts = [int(x) for x in exact]
    rest = samples - sum(counts)
    for i in sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))[:rest]:
        counts[i] += 1
    return counts


def token_stream(tokenizer, docs: Iterable[str], max_tokens: int | None = None) -> torch.Tensor:
    """Concatenate documents into one token stream, EOS-separated when the tokenizer has one.

    Stops once ``max_tokens`` are collected (documents are tokenized lazily).
    """
    eos = tokenizer.eos_token_id
    pieces: list[torch.Tensor] = []
    total = 0
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids = list(ids) + [eos]
        pieces.append(torch.tensor(ids, dtype=torch.long))
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    if not pieces or total == 0:
        raise LayercutError("text produced no tokens")
    stream = torch.cat(pieces)
    return stream[:max_tokens] if max_tokens is not None else stream


def calibration_batch(
    tokenizer,
    source: Sources,
    samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    offset: int | Sequence[int] = 0,
) -> CalibSet:
    """Sample ``samples`` windows of ``seq_len`` tokens deterministically from ``seed``.

    Windows are drawn from the EOS-joined token stream of the source at random start
    positions (``torch.Generator`` seeded with ``seed``). ``offset`` shifts every start,
    so e.g. healing data does not reuse the exact calibration sequences. A source
    shorter than one window yields a right-padded batch whose mask marks the padding.

    Several sources (a list): each gets a share of the windows proportional to its
    weight (:func:`allocate`), drawn from its own stream as above with the same seed
    (``offset``: one int for all, or one per source); the rows are then shuffled with
    ``seed``, so any first rows mix the sources. One source draws exactly as it always has.
    """
    if samples < 1 or seq_len < 2:
        raise LayercutError(f"need samples >= 1 and seq_len >= 2 (got {samples}, {seq_len})")
    srcs = as_sources(source)
    offsets = [offset] * len(srcs) if isinstance(offset, int) else list(offset)
    if len(offsets) != len(srcs):
        raise LayercutError(f"{len(offsets)} offsets for {len(srcs)} text sources")
    if len(srcs) == 1:
        return _windows(tokenizer, _documents(srcs[0], tokenizer), samples, seq_len, seed, offsets[0])
    parts = []
    for src, count, off in zip(srcs, allocate([s.weight for s in srcs], samples), offsets):
        docs = _documents(src, tokenizer)  # every source is checked, even one whose share rounds to 0
        if count:
            parts.append(_windows(tokenizer, docs, count, seq_len, seed, off))
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([p.input_ids for p in parts])[order]
    mask = torch.cat([p.attention_mask for p in parts])[order]
    return CalibSet(ids, mask)


def _windows(tokenizer, docs: Iterable[str], samples: int, seq_len: int, seed: int, offset: int) -> CalibSet:
    """``samples`` windows from one source's documents (see :func:`calibration_batch`)."""
    budget = (samples + 1) * seq_len * 4 + offset + seq_len  # enough to draw from, not the whole corpus
    stream = token_stream(tokenizer, docs, max_tokens=max(budget, 1 << 16))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids = torch.full((samples, seq_len), pad, dtype=torch.long)
    mask = torch.zeros((samples, seq_len), dtype=torch.long)
    usable = stream.numel() - offset
    if usable <= 0:
        raise LayercutError(f"text has {stream.numel()} tokens, fewer than offset {offset}")
    gen = torch.Generator().manual_seed(seed)
    if usable <= seq_len:
        for i in range(samples):
            ids[i, :usable] = stream[offset:]
            mask[i, :usable] = 1
        return CalibSet(ids, mask)
    starts = torch.randint(0, usable - seq_len + 1, (samples,), generator=gen) + offset
    for i, start in enumerate(starts.tolist()):
        ids[i] = stream[start : start + seq_len]
        mask[i] = 1
    return CalibSet(ids, mask)
