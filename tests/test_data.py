"""Text sources: bundled Brown splits, local files, deterministic calibration batches."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from calibrate.data import DATA_DIR, calibration_batch, load_texts
from compress.errors import LayercutError


def test_bundled_brown_split_is_disjoint_and_documented():
    meta = json.loads((DATA_DIR / "brown.json").read_text())
    calib_ids = meta["splits"]["calib"]["file_ids"]
    held_ids = meta["splits"]["heldout"]["file_ids"]
    assert len(calib_ids) == 400 and len(held_ids) == 100
    assert not set(calib_ids) & set(held_ids)
    calib, held = load_texts("bundled:brown-calib"), load_texts("bundled:brown-heldout")
    assert len(calib) == 400 and len(held) == 100
    assert "/" not in held[0].split()[0]  # POS tags stripped
    assert not set(calib) & set(held)


def test_calibration_batch_is_deterministic(tiny_tokenizer):
    a = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=4, seq_len=16, seed=3)
    b = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=4, seq_len=16, seed=3)
    c = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=4, seq_len=16, seed=4)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.attention_mask.all()
    shifted = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=4, seq_len=16, seed=3, offset=7)
    assert not torch.equal(a.input_ids, shifted.input_ids)


def test_short_text_is_padded_with_mask(tiny_tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("A very short text.")
    batch = calibration_batch(tiny_tokenizer, path, samples=2, seq_len=64)
    n = int(batch.attention_mask[0].sum())
    assert 0 < n < 64
    assert (batch.input_ids[0, n:] == tiny_tokenizer.pad_token_id).all()


def test_local_sources(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("first doc\nline two\n\nsecond doc\n")
    assert load_texts(txt) == ["first doc\nline two", "second doc"]
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_texts(jl) == ["one", "two"]
    gz = tmp_path / "b.txt.gz"
    gz.write_bytes(gzip.compress(b"zipped\n"))
    assert load_texts(gz) == ["zipped"]


@pytest.mark.parametrize(
    "content, message",
    [(b"", "empty"), (b"\n\n  \n", "empty"), (b"caf\xe9 latin-1", "not UTF-8")],
)
def test_bad_text_files(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(LayercutError, match=message):
        load_texts(path)


def test_bad_sources(tmp_path):
    with pytest.raises(LayercutError, match="unknown bundled text"):
        load_texts("bundled:nope")
    with pytest.raises(LayercutError, match="not found"):
        load_texts(tmp_path / "missing.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(LayercutError, match="string 'text' field"):
        load_texts(bad)
