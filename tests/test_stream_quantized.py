"""GPTQ checkpoints streamed one block at a time: eval, score and export --dequantize.

Run: ``HF_HUB_OFFLINE=1 python -m pytest -q tests/test_stream_quantized.py``.

Every checkpoint here is a tiny model built from config and quantized for real by layercut's
GPTQ (:func:`layercut.compress.quant.solve.driver.quantize_model` + ``save_quantized``): uniform 4-bit,
mixed (bits, group size) pairs written as ``dynamic`` overrides, and act-order. The streamed
figures must be the whole-model loader's (:func:`layercut.compress.quant.format.loader.load_quantized`),
to the tolerance of tests/test_stream.py (relative 1e-5 on perplexity, 1e-6 absolute on KL).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import build_tiny_model

from layercut.calibrate.capture import run_blocks
from layercut.compress.core.arch import target_linears
from layercut.compress.core.errors import LayercutError
from layercut.compress.eval.evaluate import evaluate_path
from layercut.compress.eval.stream_eval import evaluate_streamed
from layercut.compress.io.lazy import LazyModel
from layercut.compress.quant.format.checkpoint import save_quantized
from layercut.compress.quant.format.qlinear import QuantLinear
from layercut.compress.quant.solve.driver import quantize_model
from tests.plain_solver import plain_solver

KW = dict(text="bundled:brown-calib", ctx=48, max_tokens=300, progress=False)


def _mixed_plan(model) -> dict[str, tuple[int, int]]:
    """Base 4-bit g32; block 1 all 8-bit per channel; block 2's gate/up 3-bit g64; block 4's
    attention 2-bit g16; block 5's down 8-bit g32 (same group size as the base, other bits)."""
    plan = {n: (4, 32) for _, _, n, _ in target_linears(model)}
    plan.update({n: (8, -1) for n in plan if ".layers.1." in n})
    plan.update({n: (3, 64) for n in plan if ".layers.2.mlp." in n and "down" not in n})
    plan.update({n: (2, 16) for n in plan if ".layers.4.self_attn." in n and "o_proj" not in n})
    plan["model.layers.5.mlp.down_proj"] = (8, 32)
    return plan


def _quantize(model, kind, tokenizer, folder):
    from layercut.calibrate.data import calibration_batch

    calib = calibration_batch(tokenizer, "bundled:brown-calib", samples=6, seq_len=32, seed=0)
    cfg = plain_solver(bits=4, group_size=32, act_order=kind == "act-order")
    plan = _mixed_plan(model) if kind == "mixed" else None
    res = quantize_model(model, calib, cfg, plan, batch_size=3, progress=False)
    save_quantized(model, tokenizer, res, folder)
    return folder


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_tokenizer):
    """``quantized(family, kind)`` -> (GPTQ checkpoint, its dense fp32 original), cached per module."""
    cache = {}

    def make(family="llama", kind="4bit"):
        if (family, kind) not in cache:
            root = tmp_path_factory.mktemp(f"q-{family}-{kind}")
            dense = root / "dense"
            build_tiny_model(family).save_pretrained(dense, safe_serialization=True)
            tiny_tokenizer.save_pretrained(dense)
            cache[family, kind] = _quantize(build_tiny_model(family), kind, tiny_tokenizer, root / "q"), dense
        return cache[family, kind]

    return make


@pytest.mark.parametrize("family,kind", [("llama", "4bit"), ("llama", "mixed"), ("llama", "act-order"),
                                         ("gpt2", "4bit")])
def test_streamed_quantized_eval_matches_whole_model(family, kind, quantized):
    """Red if a block were read at the wrong bits or group size (the mixed checkpoint's overrides
    ignored: its shapes would not match, or the codes would dequantize wrongly), if act-order's
    g_idx were not read, or if the streamed path ran other weights than the whole loaded model.
    gpt2: Conv1D linears and a tied head."""
    q, dense = quantized(family, kind)
    if kind == "mixed":
        qc = json.loads((q / "config.json").read_text())["quantization_config"]
        assert len(qc["dynamic"]) >= 4, "the plan must give several per-module overrides"
    whole = evaluate_path(str(q), reference=str(dense), **KW)
    got = evaluate_streamed(str(q), reference=str(dense), **KW)
    assert got.tokens == whole.tokens and got.windows == whole.windows
    assert got.params == whole.params
    assert math.isclose(got.ppl, whole.ppl, rel_tol=1e-5)
    assert math.isclose(got.reference_ppl, whole.reference_ppl, rel_tol=1e-5)
    assert abs(got.kl - whole.kl) < 1e-6
    assert got.kl > 1e-5, "quantization must change the model (else the test compares dense with dense)"


def test_streamed_quantized_blocks_hold_their_own_bits(quantized):
    """Each block's turn reads its packed tensors at the bits and group size of its ``dynamic``
    entry, and only that block's: red on a leaked block (tensors of block i still resident
    while block i+1 runs) or on a block read with the base configuration instead of its own."""
    from layercut.calibrate.data import calibration_batch
    from layercut.compress.io.models import load_tokenizer

    q, _ = quantized("llama", "mixed")
    lazy = LazyModel(q, allow_quantized=True)
    layers = lazy.spec.layers_of(lazy.model)
    plan = _mixed_plan(build_tiny_model("llama"))
    calib = calibration_batch(load_tokenizer(q), "bundled:brown-calib", samples=4, seq_len=24, seed=0)
    seen = []

    def check(run):
        alive = [i for i, block in enumerate(layers)
                 if any(not t.is_meta for t in [*block.parameters(), *block.buffers()])]
        seen.append(alive)
        for name, module in run.block.named_modules():
            if isinstance(module, QuantLinear):
                full = f"{lazy.block_path(run.index)}.{name}"
                assert (module.bits, module.group_size) == plan[full], full
                assert module.qweight.dtype == torch.int32 and not module.qweight.is_meta
                assert module.scales.shape[0] == (1 if plan[full][1] == -1 else module.in_features // plan[full][1])

    run_blocks(lazy.model, calib, [check], batch_size=2, progress=False)
    assert seen == [[i] for i in range(len(layers))]
    assert all(b.is_meta for block in layers for b in block.buffers() if b.dtype == torch.int32), \
        "every block's packed tensors released"


def test_streamed_quantized_refuses_a_config_that_does_not_match(quantized, tmp_path):
    """A dynamic entry's group size edited (tensors unchanged): one clear error naming the layer,
    never a silent read at the wrong layout."""
    q, _ = quantized("llama", "mixed")
    broken = tmp_path / "broken"
    shutil.copytree(q, broken)
    cfg = json.loads((broken / "config.json").read_text())
    dyn = cfg["quantization_config"]["dynamic"]
    key = next(k for k, v in dyn.items() if v["group_size"] == 64)
    dyn[key]["group_size"] = 32
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LayercutError, match="scales is .* group size 32"):
        LazyModel(broken, allow_quantized=True)


def test_quantized_checkpoint_streams_only_when_asked(quantized):
    """Steps that would rewrite a GPTQ checkpoint (prune, a dense copy) must not stream it unnoticed."""
    from layercut.compress.io.lazy import stream_blocker

    q, _ = quantized("llama", "4bit")
    with pytest.raises(LayercutError, match="quantized checkpoint cannot be streamed"):
        LazyModel(q)
    assert stream_blocker(q) == "it is a quantized checkpoint" and stream_blocker(q, quantized=True) is None


def test_eval_stage_streams_a_quantized_checkpoint(quantized, monkeypatch):
    """`layercut eval` of a GPTQ checkpoint streams (the whole-model loader is never called) and
    reports the figures of --whole-model, in the same report format."""
    from layercut.compress.eval.config import EvalConfig
    from layercut.compress.quant.format import loader
    from layercut.compress.workflow.stages.eval import run

    q, dense = quantized("llama", "mixed")
    opts = dict(text="bundled:brown-calib", ctx=48, max_tokens=300, reference=str(dense), dtype="fp32")
    whole = run(EvalConfig(whole_model=True, **opts), str(q))

    def refuse(*args, **kwargs):
        raise AssertionError("the streamed eval loaded the whole quantized model")

    monkeypatch.setattr(loader, "load_quantized", refuse)
    streamed = run(EvalConfig(**opts), str(q))
    assert streamed.keys() == whole.keys() and streamed["model"].keys() == whole["model"].keys()
    assert math.isclose(streamed["model"]["ppl"], whole["model"]["ppl"], rel_tol=1e-5)
    assert abs(streamed["model"]["kl"] - whole["model"]["kl"]) < 1e-6
    assert streamed["model"]["bytes"] == whole["model"]["bytes"]


def test_score_stage_streams_a_quantized_checkpoint(quantized):
    from layercut.compress.select.config import ScoreConfig
    from layercut.compress.workflow.stages.score import run

    q, _ = quantized("llama", "mixed")
    kw = dict(method="angular,block-influence,attn-cosine", drop=2, samples=6, seq_len=32, dtype="fp32")
    streamed = run(ScoreConfig(**kw), str(q))
    whole = run(ScoreConfig(whole_model=True, **kw), str(q))
    assert streamed["selection"] == whole["selection"]
    for method, values in whole["scores"].items():
        if isinstance(values, list):
            assert values == pytest.approx(streamed["scores"][method], rel=1e-5, abs=1e-7), method


@pytest.mark.parametrize("family,kind", [("llama", "mixed"), ("gpt2", "4bit")])
def test_streamed_dequantize_export_equals_whole_model(family, kind, quantized, tmp_path):
    """`layercut export --dequantize` tensor by tensor == dequantize_model + save_pretrained:
    same names, dtypes and values (gpt2: Conv1D weights transposed, tied head not stored)."""
    from safetensors.torch import load_file

    from layercut.export.export import export_checkpoint

    q, _ = quantized(family, kind)
    for save_dtype in (None, "bf16"):
        a, b = tmp_path / f"s-{save_dtype}", tmp_path / f"w-{save_dtype}"
        export_checkpoint(q, a, dequantize=True, save_dtype=save_dtype)
        export_checkpoint(q, b, dequantize=True, save_dtype=save_dtype, stream=False)
        ta = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        tb = {k: v for f in sorted(b.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        assert ta.keys() == tb.keys() and not any(k.endswith(".qweight") for k in ta)
        for name in tb:
            assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
        ca = json.loads((a / "config.json").read_text())
        assert "quantization_config" not in ca and not (a / "quantize_config.json").exists()
        assert (a / "tokenizer.json").is_file() and (a / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dequantize_rows_equals_the_rows_of_the_whole_weight(bits):
    """Red if a vocabulary slice of a quantized head read the zero points of other outputs
    (3-bit zero points straddle int32 words; the last slice is not a multiple of 32)."""
    from layercut.compress.quant.format.loader import dequantize_rows
    from layercut.compress.quant.solve.gptq import rtn_quantize

    torch.manual_seed(bits)
    linear = torch.nn.Linear(64, 200, bias=False)
    r = rtn_quantize(linear.weight.detach(), bits, 16)
    layer = QuantLinear.from_dense(linear, r.q, r.zeros, r.scales, r.g_idx, bits, 16)
    full = layer.dequantize()
    for start, stop in [(0, 64), (32, 96), (96, 200), (160, 161)]:
        assert torch.equal(dequantize_rows(layer, start, stop), full[start:stop]), (start, stop)
    with pytest.raises(LayercutError, match="multiple of 32"):
        dequantize_rows(layer, 3, 40)


def test_a_quantized_head_streams_like_the_whole_model(tiny_tokenizer, tmp_path, monkeypatch):
    """An untied ``lm_head`` stored as GPTQ tensors (``lm_head.qweight`` ...) takes the same
    per-module path: read for the head's turn, dequantized a vocabulary slice at a time
    (:data:`layercut.compress.io.lazy.VOCAB_SLICE` lowered so the head spans several slices)."""
    from safetensors.torch import load_file, save_file

    from layercut.compress.io import lazy as lazy_module
    from layercut.compress.quant.solve.gptq import rtn_quantize

    model = build_tiny_model("llama")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    dense = tmp_path / "dense"
    model.save_pretrained(dense, safe_serialization=True)
    tiny_tokenizer.save_pretrained(dense)
    q = _quantize(model, "4bit", tiny_tokenizer, tmp_path / "q")
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    shard = next(q.glob("*.safetensors"))
    tensors = load_file(str(shard))
    head = torch.nn.Linear(64, tensors["lm_head.weight"].shape[0], bias=False)
    r = rtn_quantize(tensors.pop("lm_head.weight").float(), 8, 32)
    packed = QuantLinear.from_dense(head, r.q, r.zeros, r.scales, r.g_idx, 8, 32).state_dict()
    tensors.update({f"lm_head.{k}": v.contiguous() for k, v in packed.items()})
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((q / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("lm_head.weight")
    index["weight_map"].update({f"lm_head.{k}": shard.name for k in packed})
    (q / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg["quantization_config"]["dynamic"] = {"+:lm_head": {"bits": 8, "group_size": 32}}
    (q / "config.json").write_text(json.dumps(cfg))

    whole = evaluate_path(str(q), reference=str(dense), **KW)
    lazy = LazyModel(q, allow_quantized=True)
    assert "lm_head" in lazy.quantized and "lm_head" in lazy.outside_blocks()
    monkeypatch.setattr(lazy_module, "VOCAB_SLICE", 128)  # 384 outputs: three slices
    got = evaluate_streamed(str(q), reference=str(dense), **KW)
    assert math.isclose(got.ppl, whole.ppl, rel_tol=1e-5) and abs(got.kl - whole.kl) < 1e-6
    assert got.params == whole.params
