"""The GPTQ stage, sensitivities, GPTQ v1 checkpoints and the three loaders that read them.

Loaders (tiny llama, CPU): uniform bits through stock ``AutoModelForCausalLM``
(transformers + optimum + gptqmodel), mixed bits through ``GPTQModel.load`` (torch
backend), both through layercut's ``load_quantized``; all logits agree with the in-memory
quantized model within fp16 tolerance. Bad input fails before any work, writing nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest
import torch

from layercut.calibrate.data import CalibSet, calibration_batch
from layercut.compress.core.arch import target_linears
from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.format.checkpoint import dynamic_overrides, resolve_dynamic, save_quantized
from layercut.compress.quant.format.loader import load_quantized
from layercut.compress.quant.format.pack import dequantize_gptq
from layercut.compress.quant.format.qlinear import QuantLinear
from layercut.compress.quant.search.allocate import budget_bits, unit_cost
from layercut.compress.quant.search.sensitivity import (
    allocation_units,
    expand_bits,
    measure_sensitivity,
    rank_correlation,
)
from layercut.compress.quant.solve.driver import quantize_model
from layercut.compress.workflow.cli import main
from layercut.compress.workflow.stages.quantize import quantize_checkpoint
from tests.conftest import tiny_config
from tests.plain_solver import plain_solver

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
ATOL = 5e-3  # logits of magnitude ~1: fp16 embeddings/norms (and GPTQModel's fp16 compute)
ATOL_BF16 = 3e-2  # gptqmodel's TorchAtenLinear (the stock CPU path) computes in bfloat16
GS = 32


def small_model(family: str = "llama", layers: int = 3):
    """The conftest tiny model of ``family`` with fewer layers (tests here run many passes)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    setattr(cfg, "n_layer" if family == "gpt2" else "num_hidden_layers", layers)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("small-llama")
    small_model().save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _calib(tok, n=8, L=32) -> CalibSet:
    return calibration_batch(tok, "bundled:brown-calib", samples=n, seq_len=L, seed=0)


def _probe(tok) -> torch.Tensor:
    return calibration_batch(tok, "bundled:brown-heldout", samples=2, seq_len=24, seed=1).input_ids


def _mixed_bits(model) -> dict[str, int]:
    """Layer 1 at 8 bits, layer 2's MLP gate/up at 2, everything else at the base 4."""
    bits = {n: 8 for _, _, n, _ in target_linears(model) if ".layers.1." in n}
    bits.update({n: 2 for _, _, n, _ in target_linears(model) if ".layers.2.mlp." in n and "down" not in n})
    return bits


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_tokenizer):
    """Uniform 4-bit and mixed-bit checkpoints of the tiny llama, plus the in-memory logits."""
    out = {}
    probe = _probe(tiny_tokenizer)
    for kind in ("uniform", "mixed"):
        model = small_model("llama")
        bits = _mixed_bits(model) if kind == "mixed" else {}
        res = quantize_model(model, _calib(tiny_tokenizer), plain_solver(bits=4, group_size=GS), bits,
                             batch_size=4, progress=False)
        path = tmp_path_factory.mktemp("q") / kind
        save_quantized(model, tiny_tokenizer, res, path)
        with torch.no_grad():
            logits = model(probe).logits
        out[kind] = (path, logits, model, res)
    return out, probe


# ------------------------------------------------------------------- the stage


def test_weights_in_place_equal_packed_dequant(quantized):
    (entries, _) = quantized
    _, _, model, res = entries["mixed"]
    for name, ql in res.layers.items():
        W = dequantize_gptq(ql.tensors["qweight"], ql.tensors["qzeros"], ql.tensors["scales"],
                            ql.tensors["g_idx"], ql.bits)
        assert torch.equal(W, model.get_submodule(name).weight.detach()), name
    assert res.layers["model.layers.1.self_attn.q_proj"].bits == 8
    assert res.layers["model.layers.2.mlp.up_proj"].bits == 2
    assert res.layers["model.layers.2.mlp.down_proj"].bits == 4


def test_rtn_stage_matches_core(tiny_tokenizer):
    from layercut.compress.quant.solve.gptq import rtn_quantize

    model, ref = small_model("llama"), small_model("llama")
    quantize_model(model, None, plain_solver(bits=3, group_size=GS, method="rtn"), progress=False)
    for (_, _, name, m), (_, _, _, r) in zip(target_linears(model), target_linears(ref)):
        assert torch.equal(m.weight, rtn_quantize(r.weight, 3, GS).dequant), name
    assert len(list(target_linears(model))) == 3 * 7


def _out_err(model, ref, probe) -> float:
    with torch.no_grad():
        return float((model(probe).logits - ref(probe).logits).square().mean())


def test_sequential_modes_and_gptq_beats_rtn(tiny_tokenizer):
    """"linear" re-collects the Hessian after each group: qkv of layer 0 sees the same inputs
    in both modes, o_proj does not. On its calibration data GPTQ's logits error is below RTN's
    (a random tiny model: held-out text would say little)."""
    calib, fp = _calib(tiny_tokenizer), small_model()
    probe = calib.input_ids
    runs = {}
    for seq in ("block", "linear"):
        model = small_model()
        res = quantize_model(model, calib, plain_solver(bits=3, group_size=GS, sequential=seq), batch_size=4,
                             progress=False)
        assert len(res.layers) == 3 * 7 and res.tokens == int(calib.attention_mask.sum())
        runs[seq] = (model, res)
    q0 = "model.layers.0.self_attn.q_proj"
    assert torch.equal(runs["block"][1].layers[q0].tensors["qweight"], runs["linear"][1].layers[q0].tensors["qweight"])
    o0 = "model.layers.0.self_attn.o_proj"
    assert not torch.equal(runs["block"][1].layers[o0].tensors["qweight"], runs["linear"][1].layers[o0].tensors["qweight"])
    rtn = small_model()
    quantize_model(rtn, None, plain_solver(bits=3, group_size=GS, method="rtn"), progress=False)
    assert _out_err(runs["block"][0], fp, probe) < _out_err(rtn, fp, probe)


@pytest.mark.parametrize("family", ["gpt2", "phi3"])
def test_other_families_roundtrip(family, tiny_tokenizer, tmp_path):
    """Conv1D (GPT-2, weights transposed) and fused qkv/gate_up (Phi-3) save and load."""
    model = small_model(family)
    res = quantize_model(model, _calib(tiny_tokenizer), plain_solver(bits=4, group_size=GS), batch_size=4,
                         progress=False)
    save_quantized(model, tiny_tokenizer, res, tmp_path / "q")
    probe = _probe(tiny_tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(tmp_path / "q")(probe).logits, model(probe).logits,
                                   atol=ATOL, rtol=0)


# --------------------------------------------------------------- the checkpoint


def test_checkpoint_layout(quantized):
    from safetensors import safe_open

    (entries, _) = quantized
    path = entries["mixed"][0]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq" and qc["bits"] == 4
    assert qc["group_size"] == GS and qc["sym"] is False and qc["desc_act"] is False
    assert qc["dynamic"] == {
        "+:model\\.layers\\.1\\..*": {"bits": 8, "group_size": GS},
        "+:model\\.layers\\.2\\.mlp\\.(gate_proj|up_proj|gate_up_proj)$": {"bits": 2, "group_size": GS},
    }
    assert json.loads((path / "quantize_config.json").read_text()) == qc
    index = json.loads((path / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert "model.layers.0.self_attn.q_proj.qweight" in keys and "model.layers.0.self_attn.q_proj.weight" not in keys
    assert ("lm_head.weight" in keys) != small_model().config.tie_word_embeddings
    for shard in set(index["weight_map"].values()):
        with safe_open(str(path / shard), "pt") as fh:
            assert fh.metadata() == {"format": "pt"}
            for k in fh.keys():
                t = fh.get_tensor(k)
                assert torch.isfinite(t.float()).all() if t.is_floating_point() else True
                if k.endswith(".scales"):
                    assert t.dtype == torch.float16
                if k.endswith((".qweight", ".qzeros", ".g_idx")):
                    assert t.dtype == torch.int32
    q = entries["mixed"][3].layers["model.layers.1.mlp.down_proj"]
    with safe_open(str(path / index["weight_map"]["model.layers.1.mlp.down_proj.qweight"]), "pt") as fh:
        assert fh.get_tensor("model.layers.1.mlp.down_proj.qweight").shape == (q.in_features * 8 // 32, q.out_features)


def test_dynamic_regexes_match_hf_and_fused_names():
    model = small_model("llama", layers=6)
    bits = {n: 4 for _, _, n, _ in target_linears(model)}
    bits.update({n: 3 for n in bits if ".layers.4.self_attn." in n and "o_proj" not in n})
    bits.update({n: 8 for n in bits if ".layers.5." in n})
    dyn = dynamic_overrides(model, bits, 4, 64)
    assert resolve_dynamic(dyn, "model.layers.4.self_attn.k_proj") == {"bits": 3, "group_size": 64}
    assert resolve_dynamic(dyn, "model.layers.4.self_attn.qkv_proj") == {"bits": 3, "group_size": 64}  # vLLM
    assert resolve_dynamic(dyn, "model.layers.4.self_attn.o_proj") is None
    assert resolve_dynamic(dyn, "model.layers.5.mlp.down_proj")["bits"] == 8
    assert resolve_dynamic(dyn, "model.layers.50.mlp.down_proj") is None
    assert resolve_dynamic({"-:model\\.layers\\.0\\..*": {}}, "model.layers.0.mlp.up_proj") is False
    bad = dict(bits, **{"model.layers.0.mlp.gate_proj": 2})
    with pytest.raises(LayercutError, match="mixes bit widths"):
        dynamic_overrides(model, bad, 4, 64)


# ------------------------------------------------------------------ the loaders


def test_layercut_loader_uniform_and_mixed(quantized):
    (entries, probe) = quantized
    for kind in ("uniform", "mixed"):
        path, logits, _, res = entries[kind]
        model = load_quantized(path)
        assert {n for n, m in model.named_modules() if isinstance(m, QuantLinear)} == set(res.layers)
        assert model.get_submodule("model.layers.1.self_attn.v_proj").bits == (8 if kind == "mixed" else 4)
        with torch.no_grad():
            torch.testing.assert_close(model(probe).logits, logits, atol=ATOL, rtol=0)


def test_stock_transformers_loads_uniform(quantized):
    """transformers 5 + optimum 2 + gptqmodel on CPU: no device_map, no extra flags needed.

    gptqmodel picks TorchAtenLinear there, which computes in bfloat16: the tolerance is
    bf16's, and the logits must be much closer to the quantized model than it is to fp.
    """
    from transformers import AutoModelForCausalLM

    (entries, probe) = quantized
    path, logits, _, _ = entries["uniform"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(model.model.layers[0].self_attn.q_proj).__module__.startswith("gptqmodel.")
    with torch.no_grad():
        got = model(probe).logits.float()
        fp = small_model("llama")(probe).logits
    torch.testing.assert_close(got, logits, atol=ATOL_BF16, rtol=0)
    assert (got - logits).abs().mean() < 0.2 * (fp - logits).abs().mean()


def test_gptqmodel_loads_mixed(quantized):
    from gptqmodel import BACKEND, GPTQModel

    (entries, probe) = quantized
    path, logits, _, _ = entries["mixed"]
    model = GPTQModel.load(str(path), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    layers = model.model.model.layers
    assert layers[1].mlp.down_proj.bits == 8 and layers[2].mlp.up_proj.bits == 2 and layers[2].mlp.down_proj.bits == 4
    with torch.no_grad():
        torch.testing.assert_close(model.model(probe).logits.float(), logits, atol=ATOL, rtol=0)


def test_load_model_routes_to_layercut_loader(quantized):
    from layercut.compress.io.models import load_model

    (entries, _) = quantized
    model, tok = load_model(entries["mixed"][0])
    assert isinstance(model.model.layers[2].mlp.gate_proj, QuantLinear) and tok is not None


def test_loader_rejects_config_that_disagrees_with_tensors(quantized, tmp_path):
    (entries, _) = quantized
    path = tmp_path / "bad"
    shutil.copytree(entries["mixed"][0], path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]["dynamic"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LayercutError, match="does not match the tensors"):
        load_quantized(path)


# ------------------------------------------------------------ sensitivity


def test_sensitivity_units_and_model_unchanged(tiny_tokenizer):
    model = small_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calib = _calib(tiny_tokenizer, n=4)
    groups = allocation_units(model, "group")
    assert [u.name for u in groups[:4]] == ["model.layers.0.qkv", "model.layers.0.o", "model.layers.0.gate_up",
                                           "model.layers.0.down"]
    n_total = sum(m.weight.numel() for *_, m in target_linears(model))
    assert sum(u.n_weights for u in groups) == n_total
    units = allocation_units(model, "layer")
    assert sum(u.n_weights for u in units) == n_total and len(units) == 3
    table = measure_sensitivity(model, calib, units, (2, 8), plain_solver(group_size=GS),
                                methods=("output", "loss", "kl"), batch_size=4, progress=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for method in ("output", "loss", "kl"):
        for u in units:
            d = table.by_method[method][u.name]
            assert all(v >= 0 for v in d.values()) and d[2] > d[8], (method, u.name, d)
    assert table.delta == table.by_method["output"]
    assert expand_bits(units, {u.name: 3 for u in units}) == {n: 3 for _, _, n, _ in target_linears(model)}


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)


# ------------------------------------------------------------------- the command


def test_cli_avg_bits_writes_allocation(small_dir, tmp_path, capsys):
    out = tmp_path / "mix"
    code = main(["quantize", str(small_dir), "-o", str(out), "--avg-bits", "3.7", "--group-size", "32",
                 "--candidates", "2,4", "--unit", "group", "--samples", "4", "--seq-len", "32",
                 "--sensitivity-samples", "2", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["avg_bits"] <= 3.7 + 1e-9 and report["avg_bits"] > report["uniform_avg_bits"]["2g32"]
    assert report["baseline"] == "2g32" and report["written"] == "mixed", report["fallback"]
    # (mixed beating uniform 2-bit at 3.7 bits/weight says little: any mix of 2 and 4 bits should)
    assert report["fallback"]["kept"] == ("mixed" if report["fallback"]["kl_mixed"] < report["fallback"]["kl_uniform"]
                                          else "uniform")
    alloc = json.loads((out / "allocation.json").read_text())
    assert {u["bits"] for u in alloc["units"]} == {2, 4} and len(alloc["units"]) == 3 * 4
    # Which units got 4 bits: the written choice is the exact optimum of the table it reports
    # (brute force over the 2^12 choices under the budget), and that table is the loss
    # sensitivity the report names. Red if the stage allocated on another table than it saved
    # (e.g. unit names shuffled against their Δ, or the Δs of 2 and 4 bits swapped) or the solver
    # returned a feasible but suboptimal pick.
    units = alloc["units"]
    assert {u["name"]: u["delta"] for u in units} == alloc["sensitivity"]["by_method"]["loss"]
    cost = [[unit_cost(u["n_weights"], b, 32) for b in (2, 4)] for u in units]
    budget = budget_bits(3.7, sum(u["n_weights"] for u in units))
    feasible = [(sum(u["delta"][f"{b}g32"] for u, b in zip(units, pick)), pick)
                for pick in itertools.product((2, 4), repeat=len(units))
                if sum(c[b == 4] for c, b in zip(cost, pick)) <= budget]
    best, best_pick = min(feasible)
    assert tuple(u["bits"] for u in units) == best_pick
    assert report["predicted_delta"] == pytest.approx(best, rel=1e-9)
    assert alloc["avg_bits"] == pytest.approx(report["avg_bits"])  # the cost model = the bytes written
    assert (out / "allocation.png").stat().st_size > 1000
    model = load_quantized(out)
    for u in alloc["units"]:
        assert all(model.get_submodule(n).bits == u["bits"] for n in u["linears"])


def _tree(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("args, words", [
    (["--bits", "5"], "bits must be one of"),
    (["--bits", "4", "--group-size", "48"], "does not divide in_features=64"),
    (["--avg-bits", "2.0", "--candidates", "2,3,4"], "below the smallest candidate"),
    # in_features 64 (qkv, o, gate_up) and 128 (down): 48 divides neither (red if such a pair were dropped silently)
    (["--avg-bits", "3.5", "--candidates", "3g48,4g32"], "candidate 3g48: group size 48 divides the input size of no unit"),
    # 2g128 fits down only: a mix costs >= 3.83 bits/weight, uniform 4ch 4.28; no uniform baseline fits 4.0
    (["--avg-bits", "4.0", "--candidates", "2g128,4ch"], "fits the --avg-bits 4.0 budget uniformly"),
    (["--avg-bits", "3.7", "--candidates", "3x64"], "expected e.g. 3g64"),
    (["--avg-bits", "3", "--candidates", "3,5"], "--candidates must be among"),
    (["--bits", "4", "--method", "rtn", "--damp", "0"], "damp must be > 0"),
])
def test_cli_bad_input(small_dir, tmp_path, capsys, args, words):
    model = small_dir
    code = main(["quantize", str(model), "-o", str(tmp_path / "out"), "--group-size", "32", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error:") and words in err[-1], err
    assert _tree(tmp_path) == []


def test_already_quantized_input_is_refused(quantized, tmp_path):
    (entries, _) = quantized
    with pytest.raises(LayercutError, match="already quantized"):
        quantize_checkpoint(entries["uniform"][0], tmp_path / "again", bits=4, group_size=GS)
    assert not (tmp_path / "again").exists()
    model = load_quantized(entries["uniform"][0])
    with pytest.raises(LayercutError, match="already quantized"):
        quantize_model(model, None, plain_solver(method="rtn", group_size=GS))


def test_non_finite_hessian_fails_cleanly(tiny_tokenizer, tmp_path):
    src = tmp_path / "nan-model"
    model = small_model()
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight[3] = float("inf")  # MLP inputs blow up
    model.save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    with pytest.raises(LayercutError, match="Hessian of model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj has NaN/Inf"):
        quantize_checkpoint(src, tmp_path / "out", bits=4, group_size=GS, samples=2, seq_len=16, progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_fused_group_must_share_bits():
    model = small_model("llama")
    with pytest.raises(LayercutError, match="must share one bit width"):
        quantize_model(model, None, plain_solver(method="rtn", group_size=GS), {"model.layers.0.self_attn.q_proj": 8})


@pytest.mark.gpu
def test_gpu_quantize_and_load_match_cpu(quantized, tiny_tokenizer):
    """device="cuda": blocks are solved on the GPU and go back home; the GPU-loaded checkpoint
    (CUDA kernels in fp16) gives the CPU loader's logits."""
    calib = _calib(tiny_tokenizer)
    cfg = plain_solver(bits=4, group_size=GS)
    cpu = quantize_model(small_model(), calib, cfg, batch_size=4, progress=False)
    model = small_model()
    gpu = quantize_model(model, calib, cfg, batch_size=4, device="cuda", progress=False)
    assert next(model.parameters()).device.type == "cpu"
    for name, ql in cpu.layers.items():  # float32 on two devices: rounding ties may flip a few codes
        same = (ql.tensors["qweight"] == gpu.layers[name].tensors["qweight"]).float().mean()
        assert same > 0.95, name
    (entries, probe) = quantized
    path, logits, _, _ = entries["mixed"]
    on_gpu = load_quantized(path, dtype=torch.float16, device="cuda")
    with torch.no_grad():
        got = on_gpu(probe.cuda()).logits.float().cpu()
    torch.testing.assert_close(got, logits, atol=2e-2, rtol=0)


def test_default_act_order_with_static_groups_keeps_natural_g_idx(small_dir, tmp_path):
    """The command's default order (act-order, static groups) writes g_idx = i // gs and desc_act false."""
    from safetensors import safe_open

    out = tmp_path / "q"
    report = quantize_checkpoint(str(small_dir), out, bits=4, group_size=GS, samples=4, seq_len=32, progress=False)
    assert report["act_order"] is True and report["static_groups"] is True
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is False and qc["static_groups"] is True
    n = 0
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as fh:
            for k in (k for k in fh.keys() if k.endswith(".g_idx")):
                g = fh.get_tensor(k)
                assert torch.equal(g, torch.arange(g.numel(), dtype=torch.int32) // GS), k
                n += 1
    assert n == 7 * 3  # 7 linears per block, 3 blocks
