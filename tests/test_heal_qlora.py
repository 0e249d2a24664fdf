"""QLoRA heal (heal --method qlora): LoRA over a 4-bit RTN copy of the student, merged into its dense weights
tensor by tensor; the output is a dense checkpoint that differs from the source by exactly the adapters."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from layercut.cli import main
from layercut.compress.core.errors import LayercutError
from tests.conftest import build_tiny_model
from tests.test_heal_scales import _tensors

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
ARGS = ["--steps", "6", "--seq-len", "24", "--batch", "2", "--data-offset", "0", "--lr", "5e-3", "--teacher-topk", "8"]


def test_qlora_merges_exactly_its_adapters_into_the_dense_source(tiny_model_dir, tmp_path, monkeypatch):
    """The output is dense (no quantization_config, the source's dtype and tensor names); only the targeted
    linears' weights moved, each by B·A·alpha/rank of the trained adapter (to the dtype's rounding). Red if
    the merge misses a layer, adds to the wrong tensor, scales the update wrongly, or writes the 4-bit base."""
    from layercut.compress.workflow.stages import heal as stage
    from layercut.compress.workflow.stages.heal import run
    from layercut.heal import qlora as ql
    from layercut.heal.config import HealConfig

    src = tiny_model_dir("llama")
    out = tmp_path / "healed"
    captured = {}
    real = stage.heal_qlora

    def spy(base, *a, **k):
        wrap = stage_wrap = ql.wrap_qlora

        def keep(*wa, **wk):
            wrapped = wrap(*wa, **wk)
            captured["factors"] = {n: (m.lora_A, m.lora_B, m.scaling) for n, m in wrapped.items()}
            return wrapped

        ql.wrap_qlora = keep
        try:
            return real(base, *a, **k)
        finally:
            ql.wrap_qlora = stage_wrap

    monkeypatch.setattr(stage, "heal_qlora", spy)
    report = run(HealConfig(method="qlora", teacher=str(src), steps=6, seq_len=24, batch_size=2, data_offset=0,
                            lr=5e-3, teacher_topk=8, targets="mlp"), src, out)
    assert report["merged"] and report["lora_modules"] == 6 * 3
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    before, after = _tensors(src), _tensors(out)
    assert before.keys() == after.keys()
    factors = captured["factors"]
    assert len(factors) == 18
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved == {f"{n}.weight" for n in factors}
    for name, (a, b, scaling) in factors.items():
        w0, w1 = before[f"{name}.weight"], after[f"{name}.weight"]
        delta = (b.detach() @ a.detach()) * scaling
        assert w1.dtype == w0.dtype and scaling == 2.0  # alpha = 2 x rank by default
        assert torch.equal(w1, (w0.float() + delta).to(w0.dtype)), name
        assert float(delta.norm()) > 0
    assert (out / "HEAL.md").is_file() and "RTN" in (out / "HEAL.md").read_text()


def test_lora_quant_is_the_dequantized_base_plus_the_update():
    """LoraQuant(x) = x·Ŵᵀ + s·x·Aᵀ·Bᵀ with Ŵ the GPTQ layer's dequantized weight; only A and B get gradients.
    Red if the base is not the packed layer's weight, the scaling is off, or the base's scales train."""
    from layercut.compress.quant.format.pack import unpack_gptq
    from layercut.heal.qlora import LoraQuant
    from tests.test_heal_scales import _random_qlinear

    layer = _random_qlinear(4, 64, 96, 32, False, True)
    mod = LoraQuant(layer, rank=4, alpha=8.0, dropout=0.0)
    with torch.no_grad():
        mod.lora_B.normal_()
    q, z = unpack_gptq(layer.qweight, layer.qzeros, 4, 64, 96)
    g = layer.g_idx.long()
    w = layer.scales.float()[g].T * (q.float() - z[g].T.float())
    x = torch.randn(3, 64)
    y = mod(x)
    ref = x @ w.T + layer.bias.float() + 2.0 * (x @ mod.lora_A.T) @ mod.lora_B.T
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
    y.sum().backward()
    assert mod.lora_A.grad is not None and mod.lora_B.grad is not None and mod.base.theta.grad is None
    assert torch.allclose(mod.delta(), 2.0 * mod.lora_B @ mod.lora_A)


def test_qlora_bad_input(tiny_model_dir, tiny_tokenizer, tmp_path, capsys):
    """One line, exit 2, nothing written: a quantized input, --base-bits without qlora, an unsupported base width,
    qlora with resume, a teacher with another vocabulary."""
    from layercut.compress.workflow.stages.quantize import quantize_checkpoint

    src = tiny_model_dir("llama")
    q4 = tmp_path / "q4"
    quantize_checkpoint(str(src), q4, bits=4, group_size=32, samples=2, seq_len=16, progress=False)
    out = tmp_path / "x"
    assert main(["heal", str(q4), "--method", "qlora", "--teacher", str(src), "-o", str(out), *ARGS]) == 2
    assert "already quantized: tune its scales with --method scales" in capsys.readouterr().err
    assert main(["heal", str(src), "--base-bits", "3", "--teacher", str(src), "-o", str(out), *ARGS]) == 2
    assert "base-bits is an option of --method qlora" in capsys.readouterr().err
    assert main(["heal", str(src), "--method", "qlora", "--base-bits", "5", "--teacher", str(src), "-o", str(out),
                 *ARGS]) == 2
    capsys.readouterr()
    assert main(["heal", str(src), "--method", "qlora", "--checkpoint-every", "2", "--teacher", str(src), "-o",
                 str(out), *ARGS]) == 2
    assert "built for --method lora only" in capsys.readouterr().err
    other = tmp_path / "other-tok"  # a teacher whose vocabulary differs: refused for every method
    build_tiny_model("llama").save_pretrained(other)
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_tokens(["<extra-token>"])
    tok.save_pretrained(other)
    for method, student in (("qlora", src), ("scales", q4)):
        assert main(["heal", str(student), "--method", method, "--teacher", str(other), "-o", str(out), *ARGS]) == 2
        assert "different tokenizer" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".x*"))


def test_merge_refuses_a_source_without_the_adapted_tensor(tiny_model_dir, tmp_path):
    from layercut.heal.qlora import merge_into_dense

    src = tiny_model_dir("llama")
    with pytest.raises(LayercutError, match="has no tensor model.layers.99.mlp.up_proj.weight"):
        merge_into_dense(src, {"model.layers.99.mlp.up_proj": lambda: torch.zeros(2, 2)}, tmp_path)
