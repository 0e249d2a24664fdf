"""Model inputs: shard writer, shard-index checks, Hub ids from the local hub cache, GGUF conversion.

Run: ``HF_HUB_OFFLINE=1 python -m pytest -q tests/test_models.py [--runslow]``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.shards import INDEX, SINGLE, ShardWriter
from layercut.compress.core.units import check_size, parse_size
from layercut.compress.io.models import check_weights, load_model, resolve_model


def _save_sharded(model, tokenizer, folder: Path, max_bytes: int) -> list[Path]:
    folder.mkdir(parents=True)
    with ShardWriter(folder, max_bytes) as writer:
        for name, tensor in model.state_dict().items():
            if name != "lm_head.weight" or not model.config.tie_word_embeddings:
                writer.add(name, tensor)
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sorted(folder.glob("*.safetensors"))


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("64KiB") == 64 * 1024
    assert parse_size(123) == 123
    assert parse_size("1TB") == 10**12 and parse_size("1.5 GiB") == 3 * 2**29


@pytest.mark.parametrize("text", ["1TB", "2TiB", "500mb", "1.5 GB", "64KiB", "7B"])
def test_every_size_that_validates_is_one_the_writer_reads(text, tmp_path):
    """``--max-shard-size 1TB`` passed validation, then the shard writer's own parser raised."""
    assert check_size(text) == text.strip()
    with ShardWriter(tmp_path / text.replace(" ", ""), text) as writer:
        assert writer.max_bytes == parse_size(text) > 0
        writer.add("w", torch.zeros(2))


@pytest.mark.parametrize("text", ["40", "2 GBs", "-1GB", "0MB", "1.2.3GB", "GB"])
def test_malformed_sizes_are_rejected_by_both(text):
    with pytest.raises(ValueError, match="is not like 500MB"):
        check_size(text)
    if not text.isdigit():
        with pytest.raises(ValueError):
            parse_size(text)


def test_shard_writer_round_trip(tmp_path, tiny_tokenizer):
    """Several shards + index load in stock transformers with every tensor equal."""
    from transformers import AutoModelForCausalLM

    model = build_tiny_model("llama")
    shards = _save_sharded(model, tiny_tokenizer, tmp_path / "m", max_bytes=64 * 1024)
    assert len(shards) > 2, "the 64 KiB limit must split the tiny model"
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)]
    index = json.loads((tmp_path / "m" / INDEX).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert not list((tmp_path / "m").glob(".shard-*")), "provisional names must be gone"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", use_safetensors=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_shard_writer_single_file_and_errors(tmp_path):
    with ShardWriter(tmp_path / "one", "1GB") as writer:
        writer.add("a", torch.ones(3))
        writer.add("b", torch.zeros(2, 2))
        with pytest.raises(ValueError, match="added twice"):
            writer.add("a", torch.ones(1))
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [SINGLE]
    with pytest.raises(ValueError, match="no tensors"):
        ShardWriter(tmp_path / "empty").close()


@pytest.fixture()
def sharded_dir(tmp_path, tiny_tokenizer) -> Path:
    _save_sharded(build_tiny_model("llama"), tiny_tokenizer, tmp_path / "m", max_bytes=64 * 1024)
    return tmp_path / "m"


def test_missing_shard_named_in_index(sharded_dir):
    victim = sorted(sharded_dir.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(LayercutError, match=f"shard {victim.name} .* is missing"):
        load_model(sharded_dir, with_tokenizer=False)


def test_index_names_tensor_no_shard_holds(sharded_dir):
    index = json.loads((sharded_dir / INDEX).read_text())
    first = sorted(index["weight_map"].values())[0]
    index["weight_map"]["model.layers.99.mlp.up_proj.weight"] = first
    (sharded_dir / INDEX).write_text(json.dumps(index))
    with pytest.raises(LayercutError, match="names tensor model.layers.99.mlp.up_proj.weight"):
        check_weights(sharded_dir)


def test_truncated_shard(sharded_dir):
    victim = sorted(sharded_dir.glob("model-*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(LayercutError, match="corrupt safetensors"):
        load_model(sharded_dir, with_tokenizer=False)


# ------------------------------------------------------------------ Hub ids, offline hub cache
def _hub_cache(root: Path, repo: str, source: Path, revision: str = "main") -> Path:
    """Lay ``source``'s files out as huggingface_hub's cache does: blobs, snapshots/<commit>, refs."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for file in source.iterdir():
        blob = repo_dir / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snap / file.name).symlink_to(Path("../../blobs") / blob.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / revision).write_text(commit)
    return snap


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root


def test_hub_id_resolves_from_local_cache(hub_cache, tiny_model_dir):
    snap = _hub_cache(hub_cache, "tiny-org/tiny-llama", tiny_model_dir("llama"))
    assert resolve_model("tiny-org/tiny-llama") == snap
    assert resolve_model("tiny-org/tiny-llama@main") == snap
    model, tok = load_model("tiny-org/tiny-llama")
    assert model.config.num_hidden_layers == 6 and tok is not None


def test_hub_id_not_cached_offline_is_one_clear_error(hub_cache):
    with pytest.raises(LayercutError, match="not in the local hub cache and HF_HUB_OFFLINE is set"):
        resolve_model("nobody/not-cached")
    with pytest.raises(LayercutError, match="not in the local hub cache"):
        resolve_model("tiny-org/tiny-llama@v9")  # revision that the cache has no ref for


def test_local_path_wins_over_hub_id(hub_cache, tiny_model_dir, tmp_path, monkeypatch):
    _hub_cache(hub_cache, "org/model", tiny_model_dir("llama"))
    local = tmp_path / "org" / "model"
    shutil.copytree(tiny_model_dir("qwen2"), local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/model").resolve() == local.resolve()


def test_not_a_path_nor_hub_id():
    with pytest.raises(LayercutError, match="model not found"):
        resolve_model("no/such/deep/path")


# ------------------------------------------------------------------ GGUF
def test_gguf_unsupported_architecture(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), arch="notanarch")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LayercutError, match="GGUF architecture 'notanarch' is not supported"):
        resolve_model(path)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or not any(models.iterdir()), "nothing half-written in the cache"


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(LayercutError, match="GGUF"):
        resolve_model(path)


@pytest.mark.slow
def test_streamed_gguf_conversion_matches_transformers(tmp_path, monkeypatch):
    """The one-tensor-at-a-time conversion equals transformers' whole-model GGUF load, bit for bit (fp32)."""
    from transformers import AutoModelForCausalLM

    from layercut.compress.io.models import bundled_gguf_path

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path))
    gguf = bundled_gguf_path("smollm2-135m")
    path = resolve_model("bundled:smollm2-135m")
    assert path.name == "smollm2-135m-float32"
    assert resolve_model("bundled:smollm2-135m") == path  # cached: no second conversion
    ours = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=torch.float32).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32).state_dict()
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    del ours, theirs
    bf16 = resolve_model("bundled:smollm2-135m", convert_dtype=torch.bfloat16)
    assert bf16.name == "smollm2-135m-bfloat16" and bf16 != path
    from safetensors import safe_open

    with safe_open(str(bf16 / "model.safetensors"), framework="pt") as fh:
        assert fh.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.bfloat16


def test_add_shard_writes_what_save_file_writes(tmp_path):
    """A shard from ``add_shard`` is byte for byte safetensors' ``save_file`` of the same tensors
    (dtype order, then names), so the GPTQ checkpoint writer kept its files when it moved onto ShardWriter."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool)
    tensors = {f"{name}.{i}": torch.randn(3, 5, generator=g).mul(9).to(dt)
               for i, dt in enumerate(dtypes) for name in ("b", "A", "a")}
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.float16)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    writer = ShardWriter(tmp_path / "w", always_index=True)
    writer.add_shard(tensors)
    writer.add_shard({"z": torch.ones(2)})
    writer.close()
    assert (tmp_path / "w" / "model-00001-of-00002.safetensors").read_bytes() == \
        (tmp_path / "ref.safetensors").read_bytes()
