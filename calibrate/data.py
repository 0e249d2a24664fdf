"""Text sources and calibration batches.

Usage::

    from calibrate.data import load_texts, calibration_batch
    docs = load_texts("bundled:brown-calib")          # list[str]
    calib = calibration_batch(tokenizer, "bundled:brown-calib", samples=128, seq_len=512, seed=0)
    calib.input_ids, calib.attention_mask             # [N, L] each

Sources: the bundled Brown corpus, split by file id (``calibrate/data/brown.json`` lists
every split's file ids): ``bundled:brown-calib`` (400 files, calibration and healing),
``bundled:brown-val`` (50 held-out files, for choosing defaults), ``bundled:brown-test``
(the other 50 held-out files, for reporting results) and ``bundled:brown-heldout`` (val +
test, what results before the split were measured on); a local ``.txt`` file (documents
separated by blank lines), a local ``.jsonl`` file (a ``"text"`` field per line), or
``hf:NAME[:CONFIG][@SPLIT]`` through ``datasets.load_dataset`` (offline-friendly:
local dataset folders and cached datasets work without a network).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.errors import LayercutError

DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED_TEXTS = {name: f"{name}.txt.gz"
                 for name in ("brown-calib", "brown-heldout", "brown-val", "brown-test")}
# Text no calibration or healing run may train on: the held-out files and their two halves.
EVAL_TEXTS = ("bundled:brown-heldout", "bundled:brown-val", "bundled:brown-test")


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


def _read_text_file(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LayercutError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _split_documents(text: str) -> list[str]:
    return [d.strip() for d in text.replace("\r\n", "\n").split("\n\n") if d.strip()]


def load_texts(source: str | Path) -> list[str]:
    """Documents of a text source, in order. Raises :class:`LayercutError` if empty/unreadable."""
    text = str(source)
    if text.startswith("bundled:"):
        name = text.split(":", 1)[1]
        if name not in BUNDLED_TEXTS:
            raise LayercutError(
                f"unknown bundled text '{text}' (known: {', '.join('bundled:' + k for k in BUNDLED_TEXTS)})"
            )
        docs = _split_documents(_read_text_file(DATA_DIR / BUNDLED_TEXTS[name]))
    elif text.startswith("hf:"):
        docs = _load_hf_dataset(text[3:])
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            raise LayercutError(f"text source not found: {path}")
        if path.name.endswith((".jsonl", ".jsonl.gz")):
            docs = _load_jsonl(path)
        else:
            docs = _split_documents(_read_text_file(path))
    if not docs:
        raise LayercutError(f"text source '{text}' is empty")
    return docs


def _load_jsonl(path: Path) -> list[str]:
    docs = []
    for lineno, line in enumerate(_read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LayercutError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise LayercutError(f"{path}:{lineno}: each line needs a string 'text' field")
        if record["text"].strip():
            docs.append(record["text"].strip())
    return docs


def _load_hf_dataset(spec: str) -> list[str]:
    import datasets

    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as exc:  # datasets raises many types; report one line
        raise LayercutError(f"cannot load dataset '{spec}': {str(exc).splitlines()[0]}") from exc
    if "text" not in ds.column_names:
        raise LayercutError(f"dataset '{spec}' has no 'text' column (columns: {ds.column_names})")
    return [t for t in ds["text"] if isinstance(t, str) and t.strip()]


def token_stream(tokenizer, docs: list[str], max_tokens: int | None = None) -> torch.Tensor:
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
    source: str | Path,
    samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    offset: int = 0,
) -> CalibSet:
    """Sample ``samples`` windows of ``seq_len`` tokens deterministically from ``seed``.

    Windows are drawn from the EOS-joined token stream of the source at random start
    positions (``torch.Generator`` seeded with ``seed``). ``offset`` shifts every start,
    so e.g. healing data does not reuse the exact calibration sequences. A source
    shorter than one window yields a right-padded batch whose mask marks the padding.
    """
    if samples < 1 or seq_len < 2:
        raise LayercutError(f"need samples >= 1 and seq_len >= 2 (got {samples}, {seq_len})")
    docs = load_texts(source)
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
