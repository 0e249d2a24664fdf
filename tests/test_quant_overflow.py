"""Quantized checkpoints of families whose activations leave fp16's range stay finite.

Gemma-3's residual stream (post-norms, embeddings scaled by sqrt(hidden)) grows past 65,504
on real checkpoints. A quantized checkpoint stores its unquantized tensors in fp16 by default
(the GPTQ convention), so a loader that computes in the stored dtype overflowed and every
figure came out NaN. The tiny model here is scaled until its fp32 activations pass fp16's
largest value, which the first assertion checks, so the test is red whenever a quantized
model computes in fp16 on CPU.
"""

from __future__ import annotations

import math

import torch

from tests.conftest import build_tiny_model

FP16_MAX = torch.finfo(torch.float16).max


def _loud_gemma3(path, tokenizer):
    model = build_tiny_model("gemma3_text")
    with torch.no_grad():
        for block in model.model.layers:  # Gemma's norms scale by (1 + weight): loud post-norms
            block.post_feedforward_layernorm.weight.fill_(20000.0)
    ids = tokenizer("The jury said the election was conducted well.", return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    assert max(float(h.abs().max()) for h in hidden) > FP16_MAX  # the stream leaves fp16's range
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def test_quantized_gemma3_with_large_activations_evaluates_finite(tmp_path, tiny_tokenizer):
    from layercut.compress.eval.config import EvalConfig
    from layercut.compress.workflow.stages.eval import run as evaluate
    from layercut.compress.workflow.stages.quantize import quantize_checkpoint

    src = _loud_gemma3(tmp_path / "src", tiny_tokenizer)
    out = tmp_path / "q4"
    quantize_checkpoint(str(src), out, bits=4, group_size=32, samples=4, seq_len=32, progress=False)
    report = evaluate(EvalConfig(max_tokens=96, ctx=32, reference=str(src)), out)
    assert math.isfinite(report["model"]["ppl"]), report["model"]
    assert math.isfinite(report["model"]["kl"]) and report["model"]["kl"] >= 0
