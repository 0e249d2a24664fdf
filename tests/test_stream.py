"""Streaming one block at a time: LazyModel, the driver's lazy path, streamed perplexity and KL.

Run: ``HF_HUB_OFFLINE=1 python -m pytest -q tests/test_stream.py [--runslow]``.

The streamed evaluation must give the in-memory evaluation's numbers. They are not bit
for bit equal: the head runs on 128-position slices of one window instead of a batch of
windows, and float32 matmuls of different shapes sum in different orders, so the
tolerance is relative 1e-5 on perplexity and 1e-6 absolute on KL (about 100 float32
ulps of the summed NLL; measured differences are ~1e-6 relative).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_tiny_model

from layercut.calibrate.capture import run_blocks
from layercut.compress.core.errors import LayercutError
from layercut.compress.eval.evaluate import evaluate_path
from layercut.compress.eval.stream_eval import evaluate_streamed
from layercut.compress.io.lazy import LazyModel, TensorIndex


def _save(model, tokenizer, path, dtype=None):
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "gpt_neox"])
def test_streamed_eval_matches_in_memory(family, tiny_model_dir, tiny_tokenizer, tmp_path):
    """gemma2: logit softcapping; gpt2: tied head; gpt_neox: head stored under another name."""
    model = tiny_model_dir(family)
    other = _save(build_tiny_model(family, seed=1), tiny_tokenizer, tmp_path / "other")
    kw = dict(text="bundled:brown-calib", ctx=48, max_tokens=300, progress=False)
    ref = evaluate_path(str(model), reference=str(other), **kw)
    got = evaluate_streamed(str(model), reference=str(other), **kw)
    assert got.tokens == ref.tokens and got.windows == ref.windows
    assert got.params == ref.params
    assert math.isclose(got.ppl, ref.ppl, rel_tol=1e-5)
    assert math.isclose(got.reference_ppl, ref.reference_ppl, rel_tol=1e-5)
    assert abs(got.kl - ref.kl) < 1e-6 and got.kl > 1e-3  # two different random models disagree


def test_bf16_checkpoint_streams_in_float32(tiny_tokenizer, tmp_path):
    """A bf16 checkpoint: blocks upcast for their turn give what loading it whole in fp32 gives."""
    path = _save(build_tiny_model("qwen3"), tiny_tokenizer, tmp_path / "bf16", dtype=torch.bfloat16)
    lazy = LazyModel(path)
    assert lazy.storage_dtype == torch.bfloat16
    assert lazy.block(0).mlp.down_proj.weight.dtype == torch.float32
    kw = dict(text="bundled:brown-calib", ctx=40, max_tokens=200, progress=False)
    assert math.isclose(evaluate_streamed(str(path), **kw).ppl, evaluate_path(str(path), **kw).ppl, rel_tol=1e-5)


def test_driver_holds_one_block_at_a_time(tiny_model_dir, calib):
    lazy = LazyModel(tiny_model_dir("llama"))
    layers = lazy.spec.layers_of(lazy.model)
    seen = []

    def count(run):
        alive = [i for i, block in enumerate(layers) if not next(block.parameters()).is_meta]
        seen.append(alive)
        assert run.block is layers[run.index]

    run_blocks(lazy.model, calib, [count], batch_size=3, progress=False)
    assert seen == [[i] for i in range(len(layers))]
    assert all(p.is_meta for block in layers for p in block.parameters()), "every block released"


def test_driver_releases_the_block_when_a_callback_raises(tiny_model_dir, calib):
    lazy = LazyModel(tiny_model_dir("llama"))
    layers = lazy.spec.layers_of(lazy.model)

    def fail_at_1(run):
        if run.index == 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_blocks(lazy.model, calib, [fail_at_1], batch_size=3, progress=False)
    assert all(p.is_meta for block in layers for p in block.parameters()), "the failing block was released"


def test_lazy_driver_outputs_equal_in_memory(tiny_model_dir, calib):
    from layercut.compress.io.models import load_model

    model, _ = load_model(tiny_model_dir("gemma3_text"), with_tokenizer=False)
    expected = run_blocks(model, calib, [], batch_size=3, progress=False)
    got = run_blocks(LazyModel(tiny_model_dir("gemma3_text")).model, calib, [], batch_size=3, progress=False)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_tensor_index_reads_and_refuses(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file

    src = tiny_model_dir("llama")
    index = TensorIndex(src)
    stored = load_file(str(src / "model.safetensors"))
    name = "model.layers.2.mlp.up_proj.weight"
    assert torch.equal(index.get(name), stored[name])
    with pytest.raises(LayercutError, match="no tensor named nope"):
        index.get("nope")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(LayercutError, match="corrupt safetensors|truncated"):
        LazyModel(broken)


@pytest.mark.slow
def test_streamed_eval_on_bundled_model():
    kw = dict(text="bundled:brown-heldout", ctx=512, max_tokens=1024, progress=False)
    ref = evaluate_path("bundled:smollm2-135m", **kw)
    got = evaluate_streamed("bundled:smollm2-135m", **kw)
    assert got.tokens == ref.tokens == 1024
    assert math.isclose(got.ppl, ref.ppl, rel_tol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "gpt2", "gpt_neox"])
def test_streamed_block_drop_equals_in_memory_drop(family, tiny_model_dir, tmp_path):
    """Same tensors, same config as drop_blocks + save_pretrained, with no model built."""
    import json

    from transformers import AutoModelForCausalLM

    from layercut.compress.depth.blocks import drop_blocks
    from layercut.compress.depth.stream_drop import drop_blocks_streamed
    from layercut.compress.io.models import load_model

    src = tiny_model_dir(family)
    summary = drop_blocks_streamed(src, tmp_path / "streamed", [1, 3], max_shard_size=40_000)
    assert summary["layers_after"] == 4
    assert len(list((tmp_path / "streamed").glob("model-*.safetensors"))) > 1
    model, tok = load_model(src)
    drop_blocks(model, [1, 3]).save_pretrained(tmp_path / "memory", safe_serialization=True)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed", use_safetensors=True).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "memory", use_safetensors=True).state_dict()
    assert a.keys() == b.keys()
    for name in b:
        assert torch.equal(a[name], b[name]), name
    ca, cb = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("streamed", "memory"))
    for key in ("num_hidden_layers", "n_layer", "layer_types", "max_window_layers"):
        assert ca.get(key) == cb.get(key), key
    assert (tmp_path / "streamed" / "tokenizer.json").is_file()


def test_streamed_block_drop_refuses_bad_input(tiny_model_dir, tmp_path):
    from layercut.compress.depth.stream_drop import drop_blocks_streamed

    with pytest.raises(LayercutError, match="out of range"):
        drop_blocks_streamed(tiny_model_dir("llama"), tmp_path / "x", [9])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_streamed_replace_equals_in_memory(family, tiny_model_dir, calib, tmp_path):
    """lstsq maps fitted over the lazy driver and folded while copying == linear_replace in memory."""
    from transformers import AutoModelForCausalLM

    from layercut.compress.depth.replace import linear_replace
    from layercut.compress.depth.stream_drop import replace_streamed
    from layercut.compress.io.models import load_model

    src = tiny_model_dir(family)
    _, fits = replace_streamed(src, tmp_path / "streamed", [2, 3], calib, batch_size=3, progress=False)
    model, _ = load_model(src)
    ref_fits = linear_replace(model, [2, 3], calib, batch_size=3, progress=False)
    assert torch.equal(fits[0].t, ref_fits[0].t)
    model.save_pretrained(tmp_path / "memory", safe_serialization=True)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed", use_safetensors=True).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "memory", use_safetensors=True).state_dict()
    assert a.keys() == b.keys()
    for name in b:
        assert torch.equal(a[name], b[name]), name
    down = "model.layers.1.mlp.down_proj.weight" if family == "llama" else "transformer.h.1.mlp.c_proj.weight"
    original = AutoModelForCausalLM.from_pretrained(src, use_safetensors=True).state_dict()[down]
    assert not torch.equal(a[down], original), "the map must be folded into the anchor's down projection"


@pytest.mark.parametrize("replace", ["none", "lstsq"])
def test_prune_stage_streams_and_matches_whole_model(replace, tiny_model_dir, tmp_path):
    """`layercut prune` streams block removal by default; --whole-model gives the same tensors and report."""
    import json

    from safetensors.torch import load_file

    from layercut.compress.depth.config import PruneConfig
    from layercut.compress.workflow.stages.prune import run

    src = tiny_model_dir("qwen2")
    kw = dict(drop=2, select="block-influence", replace=replace, samples=6, seq_len=32, batch_size=3)
    streamed = run(PruneConfig(**kw), str(src), tmp_path / "s")
    whole = run(PruneConfig(whole_model=True, **kw), str(src), tmp_path / "w")
    assert streamed["layers"] == whole["layers"] and streamed["num_layers_after"] == 4
    assert streamed["params_after"] == whole["params_after"]
    a = {k: v for f in sorted((tmp_path / "s").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    b = {k: v for f in sorted((tmp_path / "w").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys()
    for name in b:
        assert torch.equal(a[name], b[name]), name
    ja, jb = (json.loads((tmp_path / d / "layercut_prune.json").read_text()) for d in "sw")
    assert ja == jb


def test_streamed_prune_keeps_a_bf16_checkpoint_bf16(tiny_tokenizer, tmp_path):
    from safetensors import safe_open

    from layercut.compress.depth.config import PruneConfig
    from layercut.compress.workflow.stages.prune import run

    src = _save(build_tiny_model("llama"), tiny_tokenizer, tmp_path / "bf16", dtype=torch.bfloat16)
    run(PruneConfig(layers=[2]), str(src), tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert size(tmp_path / "out") < size(src), "a bf16 input never doubles on disk"


def test_score_stage_streams_and_matches_whole_model(tiny_model_dir):
    from layercut.compress.select.config import ScoreConfig
    from layercut.compress.workflow.stages.score import run

    kw = dict(method="angular,block-influence,attn-cosine", drop=2, samples=6, seq_len=32)
    streamed = run(ScoreConfig(**kw), str(tiny_model_dir("llama")), env=None)
    whole = run(ScoreConfig(whole_model=True, **kw), str(tiny_model_dir("llama")))
    assert streamed["scores"] == whole["scores"] and streamed["selection"] == whole["selection"]


@pytest.mark.parametrize("family,method", [("llama", "gptq"), ("gpt2", "gptq"), ("llama", "rtn")])
def test_quantize_stage_streams_and_matches_whole_model(family, method, tiny_model_dir, tmp_path):
    """Uniform-bit GPTQ or RTN block by block (written and freed at each block's turn) == the whole-model path."""
    from safetensors.torch import load_file

    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.format.loader import load_quantized
    from layercut.compress.workflow.stages.quantize import run

    src = tiny_model_dir(family)
    kw = dict(bits=4, group_size=32, samples=6, seq_len=32, batch_size=3, method=method)
    streamed = run(QuantizeConfig(**kw), str(src), tmp_path / "s")
    whole = run(QuantizeConfig(whole_model=True, **kw), str(src), tmp_path / "w")
    assert streamed["avg_bits"] == whole["avg_bits"] and streamed["linears"] == whole["linears"]
    a = {k: v for f in sorted((tmp_path / "s").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    b = {k: v for f in sorted((tmp_path / "w").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys() and any(k.endswith(".qweight") for k in a)
    for name in b:
        assert torch.equal(a[name], b[name]), name
    assert (tmp_path / "s" / "model.safetensors.index.json").is_file()
    ids = torch.randint(4, 300, (1, 12))
    la = load_quantized(tmp_path / "s")(input_ids=ids).logits
    lb = load_quantized(tmp_path / "w")(input_ids=ids).logits
    assert torch.equal(la, lb)
