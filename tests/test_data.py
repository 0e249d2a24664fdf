"""Text sources: bundled Brown splits, local files, deterministic calibration batches."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from layercut.calibrate import DEFAULT_EVAL_TEXT
from layercut.calibrate.data import DATA_DIR, EVAL_TEXTS, calibration_batch, load_texts
from layercut.compress.core.errors import LayercutError


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


def test_val_and_test_halve_the_heldout_files():
    """val / test: disjoint halves of the held-out files, by id and by text, never calibration text."""
    splits = json.loads((DATA_DIR / "brown.json").read_text())["splits"]
    ids = {name: splits[name]["file_ids"] for name in ("calib", "heldout", "val", "test")}
    assert len(ids["val"]) == len(ids["test"]) == 50
    assert not set(ids["val"]) & set(ids["test"])
    assert sorted(ids["val"] + ids["test"]) == sorted(ids["heldout"])
    assert not (set(ids["val"]) | set(ids["test"])) & set(ids["calib"])
    # each genre (the id's letter) is split evenly: alternation over the sorted held-out ids
    for genre in {i[:2] for i in ids["heldout"]}:
        n_val = sum(i.startswith(genre) for i in ids["val"])
        n_test = sum(i.startswith(genre) for i in ids["test"])
        assert abs(n_val - n_test) <= 1, genre
    docs = {name: load_texts(f"bundled:brown-{name}") for name in ids}
    for name in ids:
        assert len(docs[name]) == len(ids[name]) == splits[name]["documents"]
    assert not set(docs["val"]) & set(docs["test"])
    assert not (set(docs["val"]) | set(docs["test"])) & set(docs["calib"])
    # the documents follow the file ids: heldout, filtered to val's (test's) ids, is val (test) in order
    by_id = dict(zip(ids["heldout"], docs["heldout"]))
    assert [by_id[i] for i in ids["val"]] == docs["val"]
    assert [by_id[i] for i in ids["test"]] == docs["test"]


def test_split_rule_matches_the_bundled_files():
    """scripts/build_brown.py's split rule, applied to all 500 ids, gives the ids stored in brown.json."""
    script = Path(__file__).parents[1] / "scripts" / "build_brown.py"
    spec = importlib.util.spec_from_file_location("build_brown", script)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    splits = json.loads((DATA_DIR / "brown.json").read_text())["splits"]
    all_ids = splits["calib"]["file_ids"] + splits["heldout"]["file_ids"]
    stored = {name: splits[name]["file_ids"] for name in ("calib", "heldout", "val", "test")}
    assert build.split_ids(all_ids) == stored


def test_default_eval_text_is_the_test_split():
    assert DEFAULT_EVAL_TEXT == "bundled:brown-test"
    assert set(EVAL_TEXTS) == {"bundled:brown-heldout", "bundled:brown-val", "bundled:brown-test"}


@pytest.mark.parametrize("text", ["bundled:brown-heldout", "bundled:brown-val", " bundled:brown-test "])
def test_heal_data_refuses_every_evaluation_split(tiny_tokenizer, text):
    from layercut.heal.config import HealConfig
    from layercut.heal.data import heal_data

    with pytest.raises(LayercutError, match="evaluation text"):
        heal_data(tiny_tokenizer, HealConfig(data=text, samples=2, seq_len=16))


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


def test_calibration_windows_are_pinned(tiny_tokenizer):
    """The windows of a string source, pinned: computed before sources could be mixed, by weight or
    with chat templates. Benchmarks compare runs across versions on these exact token batches."""
    batch = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=2, seq_len=16, seed=0)
    assert batch.input_ids.tolist() == [
        [278, 284, 79, 277, 339, 298, 281, 335, 81, 273, 291, 224, 5, 80, 72, 326],
        [85, 288, 86, 273, 264, 284, 88, 69, 79, 294, 359, 263, 264, 306, 290, 87],
    ]
    assert batch.attention_mask.all()
    shifted = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=3, seq_len=8, seed=5, offset=300)
    assert shifted.input_ids.tolist() == [[71, 86, 5, 15, 264, 224, 77, 331], [315, 329, 375, 309, 69, 331, 81, 224],
                                          [319, 285, 224, 369, 340, 272, 273, 224]]
