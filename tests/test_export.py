"""``layercut export``: sharded layout with index, format=pt metadata, dtype cast, card, and
dense-from-GPTQ (dequantize) that stock transformers loads with the quantized model's outputs."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard

from layercut.compress.workflow.cli import main
from layercut.export.export import INDEX, check_pt_metadata


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_export_dense_float16_with_index_and_card(tiny_model_dir, tmp_path, capsys):
    src = tiny_model_dir("llama")
    out = tmp_path / "release"
    assert main(["export", str(src), "-o", str(out), "--save-dtype", "fp16", "--max-shard-size", "200KB",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0].startswith("model-00001-of-")
    index = json.loads((out / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert check_pt_metadata(out) == []
    assert "README.md" in result["files"] and (out / "README.md").read_text().startswith("---\n")

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float16
    src_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    for name, t in src_model.state_dict().items():  # each tensor is the source's, rounded to fp16
        assert torch.equal(model.state_dict()[name], t.half()), name


def test_single_shard_gets_an_index(tiny_model_dir, tmp_path):
    from layercut.export.export import export_checkpoint

    res = export_checkpoint(tiny_model_dir("llama"), tmp_path / "one")
    assert "model-00001-of-00001.safetensors" in res.files and INDEX in res.files
    assert not (tmp_path / "one" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    from layercut.compress.workflow.stages.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("q") / "q4"
    quantize_checkpoint(str(tiny_model_dir("llama")), out, bits=4, group_size=32, samples=4, seq_len=32,
                        progress=False)
    return out


def test_dequantize_matches_the_quantized_model(quantized, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from layercut.compress.io.models import load_model

    out = tmp_path / "dense"
    assert main(["export", str(quantized), "-o", str(out), "--dequantize", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["quantized"] and result["dequantized"]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and not (out / "quantize_config.json").exists()
    assert "dequantized to dense" in (out / "README.md").read_text()
    use = ModelCard.load(out / "README.md").text.split("## Use")[1]  # dense now: stock transformers loads it
    assert "AutoModelForCausalLM.from_pretrained(" in use and "gptqmodel" not in use.lower()
    dense = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    qmodel, _ = load_model(quantized)
    ids = torch.randint(4, 300, (2, 16))
    torch.testing.assert_close(_logits(dense, ids), _logits(qmodel, ids), rtol=1e-3, atol=1e-3)


def test_quantized_export_copies_bytes(quantized, tmp_path):
    from layercut.export.export import export_checkpoint

    export_checkpoint(quantized, tmp_path / "copy")
    for f in quantized.glob("*.safetensors"):
        assert (tmp_path / "copy" / f.name).read_bytes() == f.read_bytes()
    with pytest.raises(Exception, match="keeps its packing"):
        export_checkpoint(quantized, tmp_path / "bad", save_dtype="fp16")
    assert not (tmp_path / "bad").exists()


def test_card_of_an_exported_gptq_checkpoint_loads_it_with_transformers(quantized, tmp_path):
    """One bit width everywhere: the card's snippet is stock transformers (through optimum + gptqmodel)."""
    from layercut.export.card_usage import folder_kind

    out = tmp_path / "q"
    assert main(["export", str(quantized), "-o", str(out)]) == 0
    assert folder_kind(out) == "gptq"
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and "base_model" not in card.data.to_dict()  # a bare path
    use = card.text.split("## Use")[1]
    assert "AutoModelForCausalLM.from_pretrained(" in use and "optimum" in use and "GPTQModel.load" not in use


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("save", [None, "fp16", "bf16"])
def test_streamed_dense_export_equals_the_whole_model_path(tiny_model_dir, tmp_path, save, monkeypatch):
    """A dense export is a tensor-by-tensor copy (one tensor in memory), equal to load + save_pretrained."""
    import layercut.export.export

    src = tiny_model_dir("llama")
    flags = ["--save-dtype", save] if save else []
    calls = []
    real = layercut.export.export.load_model
    monkeypatch.setattr(layercut.export.export, "load_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert main(["export", str(src), "-o", str(tmp_path / "streamed"), "--no-card", *flags]) == 0
    assert calls == []  # the streamed path never builds the model
    assert main(["export", str(src), "-o", str(tmp_path / "whole"), "--no-card", "--whole-model", *flags]) == 0
    assert calls
    a, b = _tensors(tmp_path / "streamed"), _tensors(tmp_path / "whole")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == {None: torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[save]
        assert torch.equal(a[k], b[k]), k
    ca, cb = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("streamed", "whole"))
    assert ca["dtype"] == cb["dtype"] and ca["num_hidden_layers"] == cb["num_hidden_layers"]
    assert not (tmp_path / "streamed" / "README.md").exists()


def test_export_keeps_a_bf16_source_in_bf16(tiny_model_dir, tmp_path):
    """--dtype auto (default): a bf16 checkpoint is not doubled to fp32 on the way out."""
    from safetensors import safe_open

    from tests.conftest import build_tiny_model

    src = tmp_path / "bf16"
    model = build_tiny_model("llama").to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(src)
    (src / "tokenizer.json").write_bytes((tiny_model_dir("llama") / "tokenizer.json").read_bytes())
    assert main(["export", str(src), "-o", str(tmp_path / "out")]) == 0
    with safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
