"""The one GPTQ checkpoint writer (compress/quant/format/checkpoint.py), the one dtype table
(compress/core/dtypes.py) and the one quantized test (compress/core/hfconfig.py).

``layercut quantize`` writes a checkpoint block by block (streamed: ``write_block_fn`` +
``write_rest``) or from the whole model in memory (``--whole-model``: ``write_quantized_into``); both
store what one set of rules decides. Run: ``HF_HUB_OFFLINE=1 python -m pytest -q tests/test_gptq_writer.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from layercut.compress.core.dtypes import (
    OPTION_NAMES,
    SAFETENSORS_CODES,
    Dtype,
    SaveDtype,
    option_dtype,
    option_name,
    parse_dtype,
    safetensors_code,
    safetensors_dtype,
)
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.core.shards import ShardWriter
from layercut.compress.workflow.cli import main
from tests.conftest import tiny_config

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
ARGS = ["--bits", "4", "--group-size", "32", "--samples", "8", "--seq-len", "32", "--json"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_tokenizer):
    """Two-layer tiny models: an untied llama (its head quantized too) and a gpt2 (tied head,
    Conv1D linears with biases: the fp16 bias of a quantized linear)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for family in ("llama", "gpt2"):
        cfg = tiny_config(family)
        setattr(cfg, "n_layer" if family == "gpt2" else "num_hidden_layers", 2)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"writer-{family}")
        AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)
        out[family] = path
    return out


@pytest.mark.parametrize("family,extra", [("llama", ["--quantize-head", "8g32"]), ("gpt2", [])])
def test_streamed_and_whole_model_writes_are_one_checkpoint(family, extra, sources, tmp_path, capsys):
    """The streamed checkpoint is the whole-model one: config.json, quantize_config.json and the
    index byte for byte, and every shard's tensors, laid out as safetensors' save_file lays out a
    file (the whole-model writer's layout), byte for byte its shard. Red if the two writers
    disagreed on a tensor's name or dtype (an fp32 bias, a dense head kept beside its packed
    tensors, a tied copy stored), or on the config."""
    outs = {}
    for how in ("streamed", "whole"):
        outs[how] = tmp_path / how
        argv = ["quantize", str(sources[family]), "-o", str(outs[how]), *ARGS, *extra]
        assert main(argv + (["--whole-model"] if how == "whole" else [])) == 0, capsys.readouterr().err
    capsys.readouterr()
    streamed, whole = outs["streamed"], outs["whole"]
    for name in ("config.json", "quantize_config.json", "model.safetensors.index.json"):
        assert (streamed / name).read_bytes() == (whole / name).read_bytes(), name
    shards = sorted(p.name for p in whole.glob("*.safetensors"))
    assert shards == sorted(p.name for p in streamed.glob("*.safetensors"))
    for shard in shards:
        tensors = load_file(str(streamed / shard))
        relaid = tmp_path / f"relaid-{shard}"
        writer = ShardWriter(relaid, always_index=True)
        writer.add_shard(tensors)
        writer.close()
        assert (relaid / "model-00001-of-00001.safetensors").read_bytes() == (whole / shard).read_bytes(), shard
    stored = load_file(str(whole / shards[0]))
    packed = {k.rpartition(".")[0] for k in stored if k.endswith(".qweight")}
    assert packed and not any(f"{m}.weight" in stored for m in packed), "a dense weight beside its packed tensors"
    assert all(stored[f"{m}.bias"].dtype == torch.float16 for m in packed if f"{m}.bias" in stored)
    if family == "llama":
        assert "lm_head.qweight" in stored and "lm_head.weight" not in stored
    else:
        assert any(k.endswith(".bias") and k.rpartition(".")[0] in packed for k in stored)
        assert "lm_head.weight" not in stored, "the tied head is not stored"


def test_one_writer_module():
    """The streamed writer lives with the whole-model one; the old second module is gone."""
    import importlib.util

    from layercut.compress.quant.format import checkpoint

    assert importlib.util.find_spec("layercut.compress.quant.format.stream") is None
    for name in ("write_block_fn", "write_rest", "discard_block", "cast_in_place", "save_quantized",
                 "write_quantized_into", "stored_tensors", "packed_tensors", "write_config_files"):
        assert callable(getattr(checkpoint, name)), name


def test_cast_in_place_reuses_the_buffer_only_when_sizes_match():
    from layercut.compress.quant.format.checkpoint import cast_in_place

    src = torch.randn(1000, dtype=torch.float32).to(torch.bfloat16)
    want = src.to(torch.float16)
    got = cast_in_place(src.clone(), torch.float16, chunk=64)
    assert got.dtype == torch.float16 and torch.equal(got, want)
    owned = src.clone()
    assert cast_in_place(owned, torch.float16).untyped_storage().data_ptr() == owned.untyped_storage().data_ptr()
    wide = torch.randn(10)
    assert torch.equal(cast_in_place(wide, torch.float16), wide.to(torch.float16))


# ---------------------------------------------------------------------- the dtype table


def test_dtype_table():
    assert {n: option_dtype(n) for n in OPTION_NAMES} == {"fp32": torch.float32, "fp16": torch.float16,
                                                          "bf16": torch.bfloat16}
    assert list(OPTION_NAMES) == ["fp32", "fp16", "bf16"]  # export's error message lists them so
    assert set(OPTION_NAMES) == set(SaveDtype.__args__) == set(Dtype.__args__) - {"auto"}
    assert option_name("bfloat16") == "bf16" and option_name("float64") is None
    with pytest.raises(KeyError):
        option_dtype("int7")
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    assert parse_dtype("fp16") is torch.float16 and parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype(torch.float64) is torch.float64
    with pytest.raises(LayercutError, match=r"unknown dtype 'fp8' \(choose from auto, bf16, fp16, fp32\)"):
        parse_dtype("fp8")
    for name, code in SAFETENSORS_CODES.items():
        assert safetensors_code(getattr(torch, name)) == code and safetensors_dtype(code) is getattr(torch, name)
    assert safetensors_dtype("F8_E4M3") is None


def test_options_stay_torch_free():
    """``layercut --help`` imports options.py, which reads the dtype table: no torch at import."""
    code = "import sys, layercut.compress.options, layercut.compress.core.dtypes, layercut.compress.core.hfconfig\n" \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ----------------------------------------------------------------------- is_quantized


def test_is_quantized_reads_every_form(tmp_path):
    from transformers import LlamaConfig

    qc = {"quant_method": "gptq", "bits": 4}
    dense, quant = tmp_path / "dense", tmp_path / "quant"
    for folder, cfg in ((dense, {"model_type": "llama"}), (quant, {"model_type": "llama", "quantization_config": qc})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
    assert not is_quantized(dense) and is_quantized(quant) and is_quantized(str(quant))
    assert not is_quantized({}) and not is_quantized({"quantization_config": None})
    assert is_quantized({"quantization_config": qc})
    config = LlamaConfig()
    assert not is_quantized(config)
    config.quantization_config = qc
    assert is_quantized(config)

    class Model:
        pass

    model = Model()
    model.config = config
    assert is_quantized(model)
    model.config = LlamaConfig()
    assert not is_quantized(model)
    with pytest.raises(LayercutError, match="has no config.json"):
        is_quantized(tmp_path)
