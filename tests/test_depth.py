"""Depth transforms: cores on plain tensors, then drop / sublayer drop / replace / fuse on tiny models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from layercut.calibrate.capture import run_blocks
from layercut.calibrate.data import CalibSet
from layercut.compress.core.arch import arch_for, get_submodule
from layercut.compress.core.errors import LayercutError
from layercut.compress.depth.blocks import drop_blocks
from layercut.compress.depth.cores import (
    cosine_map,
    laco_merge,
    lstsq_map,
    mean_cosine_loss,
    merge_map_into_bias,
    merge_map_into_down,
    runs_of,
)
from layercut.compress.depth.fuse import fuse_blocks
from layercut.compress.depth.replace import fit_linear_maps, linear_replace, merge_maps
from layercut.compress.depth.sublayers import drop_sublayers
from tests.conftest import FAMILIES, build_tiny_model

LLAMA_LIKE = ["llama", "mistral", "qwen2", "qwen3"]
NON_GEMMA = [f for f in FAMILIES if not f.startswith("gemma")]


# -- cores -------------------------------------------------------------------------------
def test_runs_of():
    assert runs_of([9, 3, 4, 5, 4]) == [(3, 5), (9, 9)]
    assert runs_of([0]) == [(0, 0)]


def test_lstsq_map_is_the_least_squares_solution():
    torch.manual_seed(0)
    m = torch.randn(200, 8, dtype=torch.float64)
    z = m @ torch.randn(8, 8, dtype=torch.float64) + 0.01 * torch.randn(200, 8, dtype=torch.float64)
    t = lstsq_map(m.T @ m, m.T @ z, alpha=0.0)
    ref = torch.linalg.lstsq(m, z).solution
    torch.testing.assert_close(t.double(), ref, atol=1e-5, rtol=1e-5)
    # ridge shrinks the solution; a singular Gram is damped instead of failing
    assert lstsq_map(m.T @ m, m.T @ z, alpha=10.0).norm() < t.norm()
    rank1 = torch.ones(8, 8, dtype=torch.float64)
    assert torch.isfinite(lstsq_map(rank1, rank1, alpha=0.0)).all()


def test_cosine_map_recovers_a_linear_map():
    """The target is an exact linear image M R of the inputs, so the fit, started at T = I, must
    find R: the simplified objective fixes it up to scale, the unsimplified one (with the offset
    Y) fixes it exactly. Measured: loss 5e-7 and cos(T, R) 0.9999995 after 150 steps; 0.0010 after
    300 steps with the offset. Red if the fit returned its identity start (loss 0.90), applied
    the map transposed (cos(T, R) 0.38), or ignored the offset (loss 0.060)."""
    torch.manual_seed(0)
    m = torch.randn(512, 8)
    r = torch.randn(8, 8)
    target = m @ r
    assert mean_cosine_loss(m, target) > 0.5  # identity is far from the optimum
    t = cosine_map(m, target, steps=150, lr=2e-2, batch_tokens=256)
    assert mean_cosine_loss(m, target, t) < 1e-4
    assert float(torch.nn.functional.cosine_similarity(t.flatten(), r.flatten(), dim=0)) > 0.999
    # unsimplified objective: cos(Y + M T, L)
    y = torch.randn(512, 8)
    assert mean_cosine_loss(m, y + target, offset=y) > 0.5
    t_full = cosine_map(m, y + target, steps=300, lr=2e-2, batch_tokens=256, offset=y)
    assert mean_cosine_loss(m, y + target, t_full, offset=y) < 0.01


@pytest.mark.parametrize("bias", [False, True])
def test_merge_map_into_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(8, 6, bias=bias)
    t = torch.randn(6, 6)
    x = torch.randn(5, 8)
    want = lin(x) @ t
    with torch.no_grad():
        lin.weight.copy_(merge_map_into_down(lin.weight, t))
        if bias:
            lin.bias.copy_(merge_map_into_bias(lin.bias, t))
    torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)


def test_merge_map_into_conv1d():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(6, 8)  # GPT-2: weight [in=8, out=6]
    nn.init.normal_(conv.bias)
    t = torch.randn(6, 6)
    x = torch.randn(5, 8)
    want = conv(x) @ t
    with torch.no_grad():
        conv.weight.copy_(merge_map_into_down(conv.weight, t, conv1d=True))
        conv.bias.copy_(merge_map_into_bias(conv.bias, t))
    torch.testing.assert_close(conv(x), want, atol=1e-5, rtol=1e-5)


def test_laco_merge_formula():
    base, a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]), torch.tensor([5.0, 4.0])
    # θ_l + Σ_k (θ_k − θ_l) = [1 + 2 + 4, 2 − 2 + 2]
    assert laco_merge(base, [a, b]).tolist() == [7.0, 2.0]
    assert laco_merge(base, [a, b], coeff=0.0).tolist() == [1.0, 2.0]
    assert laco_merge(base, [a, b], coeff=0.5).tolist() == [4.0, 2.0]
    lin = nn.Linear(8, 6)
    assert laco_merge(lin.weight, [lin.weight * 2]).shape == (6, 8)
    with pytest.raises(ValueError):
        laco_merge(base, [torch.zeros(3)])


# -- helpers -----------------------------------------------------------------------------
def _ids(n=2, length=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 380, (n, length), generator=gen)


@torch.no_grad()
def assert_cached_generation_matches(model, steps=4):
    """generate() with a KV cache == argmax of full no-cache forwards, logits included."""
    ids = _ids()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    full = model(out.sequences, use_cache=False).logits
    live = torch.ones(ids.shape[0], dtype=torch.bool)  # rows that have not emitted EOS yet (then padded)
    eos = model.generation_config.eos_token_id
    eos = torch.tensor([] if eos is None else eos if isinstance(eos, list) else [eos], dtype=torch.long)
    for step, logits in enumerate(out.logits):
        pos = ids.shape[1] - 1 + step
        torch.testing.assert_close(logits[live], full[live, pos], atol=2e-4, rtol=2e-4)
        assert torch.equal(out.sequences[live, pos + 1], full[live, pos].argmax(-1))
        live &= ~torch.isin(out.sequences[:, pos + 1], eos)


def _save(model, tmp_path, name="out"):
    path = tmp_path / name
    model.save_pretrained(path, safe_serialization=True)
    return path


def _tensor_names(path):
    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as fh:
            names.update(fh.keys())
    return names


# -- drop blocks ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_drop_blocks_every_family(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_tiny_model(family)
    types_before = list(getattr(model.config, "layer_types", None) or [])
    drop_blocks(model, [1, 4])
    spec = arch_for(model)
    layers = spec.layers_of(model)
    assert len(layers) == model.config.num_hidden_layers == 4
    if types_before:
        assert model.config.layer_types == [types_before[i] for i in (0, 2, 3, 5)]
    for new_index, block in enumerate(layers):
        assert all(m.layer_idx == new_index for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int))
    assert_cached_generation_matches(model)
    path = _save(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()  # stock classes, no remote code
    assert type(loaded) is type(model)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    assert_cached_generation_matches(loaded)


def test_drop_blocks_trims_max_window_layers_as_a_count():
    import transformers as T

    config = T.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=384, use_sliding_window=True, sliding_window=4,
                           max_window_layers=3)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    assert model.config.layer_types[3] == "sliding_attention"
    drop_blocks(model, [0, 4])  # keep 1, 2, 3, 5: two of them were below 3
    assert model.config.max_window_layers == 2
    assert model.config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert_cached_generation_matches(model, steps=6)


def test_drop_blocks_refuses_bad_lists():
    model = build_tiny_model("llama")
    with pytest.raises(LayercutError, match="at least one"):
        drop_blocks(model, range(6))
    with pytest.raises(LayercutError, match="out of range"):
        drop_blocks(model, [4, 5, 6])
    assert len(arch_for(model).layers_of(model)) == 6


# -- sublayer drop ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", LLAMA_LIKE)
@pytest.mark.parametrize("what", ["attention", "mlp"])
def test_drop_sublayers(family, what, tmp_path):
    from transformers import AutoModelForCausalLM, DynamicCache

    model = build_tiny_model(family)
    ids = _ids()
    gone = [0, 3, 4]
    # Reference: the original model with those sublayers' contributions zeroed by hooks.
    spec = arch_for(model)
    path_of = spec.attn if what == "attention" else spec.mlp

    def zero(_m, _i, out):
        return (torch.zeros_like(out[0]), *out[1:]) if isinstance(out, tuple) else torch.zeros_like(out)

    handles = [get_submodule(spec.layers_of(model)[i], path_of).register_forward_hook(zero) for i in gone]
    with torch.no_grad():
        want = model(ids).logits
    for h in handles:
        h.remove()
    pruned = drop_sublayers(model, gone, what)
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids).logits, want, atol=1e-5, rtol=1e-5)
    assert_cached_generation_matches(pruned)
    path = _save(pruned, tmp_path)
    assert (path / "modeling_layercut.py").is_file()
    names = _tensor_names(path)
    for i in gone:
        prefix = f"model.layers.{i}.{'self_attn' if what == 'attention' else 'mlp'}."
        assert not any(n.startswith(prefix) for n in names)
    assert any(n.startswith("model.layers.1.self_attn.") for n in names)
    loaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, pruned(ids).logits, atol=1e-6, rtol=1e-6)
    assert_cached_generation_matches(loaded)
    kinds = [type(layer).__name__ for layer in DynamicCache(config=loaded.config).layers]
    if what == "attention":
        assert [i for i, k in enumerate(kinds) if k == "DummyLayer"] == gone
    else:
        assert "DummyLayer" not in kinds
    with pytest.raises(Exception, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)


def test_drop_sublayers_refuses_other_families_and_all_attention():
    with pytest.raises(LayercutError, match="sublayer removal supports"):
        drop_sublayers(build_tiny_model("gemma2"), [1], "attention")
    with pytest.raises(LayercutError, match="at least one"):
        drop_sublayers(build_tiny_model("llama"), range(6), "attention")


# -- linear replace ----------------------------------------------------------------------------
def _padded(calib):
    padded = CalibSet(calib.input_ids.clone(), calib.attention_mask.clone())
    padded.attention_mask[1, 20:] = 0
    padded.input_ids[1, 20:] = 0
    return padded


def _anchor_streams(model, calib, anchor):
    """(M, Y, block output) at block ``anchor``, concatenated over micro-batches."""
    got = {}

    def grab(run):
        if run.index == anchor:
            _, mlp, outs = run.sublayer_outputs()
            got["m"] = torch.cat(mlp)
            got["out"] = torch.cat(outs)

    run_blocks(model, calib, [grab], batch_size=4, progress=False)
    return got["m"], got["out"] - got["m"], got["out"]


@pytest.mark.parametrize("family", NON_GEMMA)
def test_linear_replace_merges_exactly(family, calib):
    model = build_tiny_model(family)
    padded = _padded(calib)
    layers = [2, 3, 5]  # two spans: anchors 1 and 4, the second ends at the last block
    fits = fit_linear_maps(model, layers, padded, method="lstsq", alpha=0.0, batch_size=4, progress=False)
    assert [(f.first, f.last, f.anchor) for f in fits] == [(2, 3, 1), (5, 5, 4)]
    for f in fits:
        assert f.tokens == int(padded.attention_mask.sum())  # padding excluded
        assert f.rel_err_map < f.rel_err_drop
    m, y, _ = _anchor_streams(model, padded, 1)
    merge_maps(model, fits)
    _, _, out = _anchor_streams(model, padded, 1)
    torch.testing.assert_close(out, y + m @ fits[0].t, atol=1e-4, rtol=1e-4)
    drop_blocks(model, layers)
    assert model.config.num_hidden_layers == 3
    assert_cached_generation_matches(model)


def test_lstsq_fit_equals_direct_solution_on_real_tokens(calib):
    model = build_tiny_model("llama")
    padded = _padded(calib)
    fits = fit_linear_maps(model, [3, 4], padded, alpha=0.0, batch_size=4, progress=False)
    m, y, _ = _anchor_streams(model, padded, 2)
    captured = {}
    run_blocks(model, padded, [lambda r: captured.update(L=torch.cat(r.outputs())) if r.index == 4 else None],
               batch_size=4, progress=False)
    real = padded.attention_mask.bool()
    z = (captured["L"] - y)[real].double()
    ref = torch.linalg.lstsq(m[real].double(), z).solution
    torch.testing.assert_close(fits[0].t.double(), ref, atol=2e-3, rtol=2e-3)


def test_map_fitting_stops_after_the_last_span_with_the_same_maps(calib, monkeypatch):
    """The fitting pass runs blocks 0..3 for spans ending at block 3 (not all 6), and the maps
    equal a full pass's: red if it runs every block, or if stopping early changes a fit."""
    from layercut.compress.depth import replace
    from layercut.compress.depth.replace import SpanFitter, plan_spans

    model = build_tiny_model("llama")
    seen = []
    real = replace.run_blocks
    monkeypatch.setattr(replace, "run_blocks", lambda m, c, cbs, **k: real(
        m, c, [*cbs, lambda r: seen.append(r.index)], **k))
    fits = fit_linear_maps(model, [1, 3], calib, alpha=0.0, batch_size=3, progress=False)
    assert seen == [0, 1, 2, 3]
    full = SpanFitter(plan_spans([1, 3], 6), alpha=0.0, total_tokens=int(calib.attention_mask.sum()))
    real(model, calib, [full], batch_size=3, progress=False)
    for a, b in zip(fits, full.results()):
        assert torch.equal(a.t, b.t)


def test_cosine_replace_and_sequential_stream(calib):
    model = build_tiny_model("llama")
    for target in ("output", "residual"):
        fits = fit_linear_maps(model, [2, 4], calib, method="cosine", cosine_steps=60, cosine_lr=1e-2,
                               cosine_target=target, batch_size=3, progress=False)
        assert all(f.cos_loss_map < f.cos_loss_drop for f in fits)
    orig = fit_linear_maps(model, [2, 4], calib, alpha=0.0, stream="original", progress=False)
    seq = fit_linear_maps(model, [2, 4], calib, alpha=0.0, stream="sequential", progress=False)
    torch.testing.assert_close(orig[0].t, seq[0].t)  # first span: same activations
    assert not torch.allclose(orig[1].t, seq[1].t)  # second span sees the replaced stream
    linear_replace(model, [2, 4], calib, stream="sequential", progress=False)
    assert model.config.num_hidden_layers == 4
    assert_cached_generation_matches(model)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_linear_replace_refuses_post_mlp_norm(family, calib):
    model = build_tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LayercutError, match="post_feedforward_layernorm"):
        linear_replace(model, [2, 3], calib, progress=False)
    assert model.config.num_hidden_layers == 6
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_linear_replace_refuses_span_at_block_0(calib):
    with pytest.raises(LayercutError, match="block 0"):
        fit_linear_maps(build_tiny_model("llama"), [0, 1], calib, progress=False)


# -- fuse ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text"])
def test_fuse_laco_formula(family):
    model = build_tiny_model(family)
    spec = arch_for(model)
    blocks = spec.layers_of(model)
    name = f"{spec.down_proj}.weight"
    expected = blocks[1].get_parameter(name) + sum(blocks[k].get_parameter(name) - blocks[1].get_parameter(name)
                                                   for k in (2, 3))
    expected = expected.detach().clone()
    groups = fuse_blocks(model, [2, 3], progress=False)
    assert groups[0].base == 1 and set(groups[0].coeffs.values()) == {1.0}
    torch.testing.assert_close(spec.layers_of(model)[1].get_parameter(name), expected)
    assert model.config.num_hidden_layers == 4
    assert_cached_generation_matches(model)


def test_fuse_calibrated_groups_and_coefficients(calib):
    """Structure of a calibrated fuse; the fit itself is tested on a known case below."""
    model = build_tiny_model("llama")
    groups = fuse_blocks(model, [0, 3, 4], calib=calib, fit_samples=6, steps=8, batch_size=3, progress=False)
    assert [g.base for g in groups] == [1, 2]  # a run at block 0 folds into the block after it
    for g in groups:
        assert g.loss_fused <= min(g.loss_drop, g.loss_laco) + 1e-9  # the documented floor (best point kept)
        assert len(g.coeffs) == 7  # q k v o gate up down
    assert_cached_generation_matches(model)


@torch.no_grad()
def _fused_cos_loss(model, calib, c_down: float) -> float:
    """Independent objective for fusing block 2 into 1: mean 1 − cos(fused block 1's output, original
    block 2's output) over real tokens, with block 1's down_proj = D1 + c (D2 − D1), by whole-model forwards."""
    ref = model(input_ids=calib.input_ids, attention_mask=calib.attention_mask, output_hidden_states=True)
    fused = copy.deepcopy(model)
    layers = fused.model.layers
    d1, d2 = layers[1].mlp.down_proj.weight, layers[2].mlp.down_proj.weight
    d1.copy_(d1 + c_down * (d2 - d1))
    drop_blocks(fused, [2])
    out = fused(input_ids=calib.input_ids, attention_mask=calib.attention_mask, output_hidden_states=True)
    cos = torch.nn.functional.cosine_similarity(out.hidden_states[2].double(), ref.hidden_states[3].double(), dim=-1)
    return float((1 - cos)[calib.attention_mask.bool()].mean())


def test_fuse_fit_finds_the_known_optimum(calib):
    """Blocks 1 and 2 equal except down_proj (D2 = −D1, D1 scaled ×4 so the MLP dominates): only the
    down_proj coefficient changes the fused block, so the objective is a 1-D curve that a grid maps.
    Its minimum (c ≈ 0.35) lies well inside (0, 1) and well below both starting points, so zero
    fitting steps (or a fit that never moves c) fails here."""
    model = build_tiny_model("llama")
    layers = model.model.layers
    with torch.no_grad():
        layers[2].load_state_dict(layers[1].state_dict())
        layers[1].mlp.down_proj.weight.mul_(4.0)
        layers[2].mlp.down_proj.weight.copy_(-layers[1].mlp.down_proj.weight)
    grid = [i / 40 for i in range(41)]  # c in [0, 1] step 0.025
    curve = [_fused_cos_loss(model, calib, c) for c in grid]
    best = min(range(len(grid)), key=curve.__getitem__)
    c_star, loss_star = grid[best], curve[best]
    start = min(curve[0], curve[-1])  # the fitter starts from the better of drop (c = 0) and LaCo (c = 1)
    assert calib.attention_mask.all() and 0 < best < len(grid) - 1 and loss_star < 0.85 * start  # as claimed

    fused = copy.deepcopy(model)
    g = fuse_blocks(fused, [2], calib=calib, fit_samples=6, batch_size=3, progress=False)[0]
    assert g.loss_drop == pytest.approx(curve[0], rel=1e-4) and g.loss_laco == pytest.approx(curve[-1], rel=1e-4)
    assert abs(g.coeffs["mlp.down_proj"] - c_star) <= 0.05, (g.coeffs, c_star)
    assert g.loss_fused < 0.85 * start and g.loss_fused <= loss_star + 1e-3
    others = {m: c for m, c in g.coeffs.items() if m != "mlp.down_proj"}
    assert set(others.values()) == {0.0 if curve[0] <= curve[-1] else 1.0}  # no gradient: they stay put
    # the returned model carries the fitted coefficient: its loss is the reported one (calib has no padding)
    with torch.no_grad():
        out = fused(input_ids=calib.input_ids, output_hidden_states=True).hidden_states[2]
        ref = model(input_ids=calib.input_ids, output_hidden_states=True).hidden_states[3]
    cos = torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=-1)
    assert float((1 - cos).mean()) == pytest.approx(g.loss_fused, rel=1e-4)


# -- CLI ---------------------------------------------------------------------------------------------
def _cli(*argv):
    from layercut.compress.workflow.cli import main

    return main([str(a) for a in argv])


def test_cli_prune_end_to_end(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir("llama")
    out = tmp_path / "cut"
    rc = _cli("prune", src, "-o", out, "--drop", "2", "--select", "block-influence", "--replace", "lstsq",
              "--samples", "4", "--seq-len", "32", "--json")
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_layers_after"] == 4 and len(result["layers"]) == 2
    plan = json.loads((out / "layercut_prune.json").read_text())
    assert plan["select"] == "block-influence" and plan["scores"]["block_influence"]
    assert plan["spans"] and plan["transform"] == "replace-lstsq"
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and "auto_map" not in config
    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    out2 = tmp_path / "attn"
    assert _cli("prune", src, "-o", out2, "--drop", "2", "--what", "attention", "--select", "gate-norm") == 0
    assert "trust_remote_code=True" in (out2 / "README.md").read_text()
    assert json.loads((out2 / "config.json").read_text())["layercut_drop_attention"]


@pytest.mark.parametrize("args", [
    ["--drop", "2", "--select", "block-influence", "--replace", "lstsq", "--samples", "4", "--seq-len", "32"],
    ["--layers", "1,3"],
    ["--drop", "2", "--what", "attention", "--select", "gate-norm"],
    ["--layers", "2", "--what", "mlp"],
])
def test_dry_run_prints_the_plan_the_run_executes(args, tiny_model_dir, tmp_path, capsys):
    """--dry-run writes nothing and prints the plan; the real run then removes exactly those layers
    and ends at exactly the planned parameter count (maps merge into existing weights)."""
    src = tiny_model_dir("llama")
    assert _cli("prune", src, *args, "--dry-run", "--json") == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["dry_run"] is True and list(tmp_path.iterdir()) == []
    out = tmp_path / "cut"
    assert _cli("prune", src, "-o", out, *args, "--json") == 0
    done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("layers", "transform", "select", "num_layers_after", "params_before", "params_after", "description"):
        assert plan[key] == done[key], key
    assert plan["params_after"] < plan["params_before"]
    # without --dry-run, -o stays required
    assert _cli("prune", src, *args) == 2 and "-o/--output" in capsys.readouterr().err


@pytest.mark.parametrize(
    "family,args,message",
    [
        ("llama", ["--drop", "6", "--select", "block-influence"], "at least one must remain"),
        ("llama", ["--drop", "2", "--select", "bogus"], "unknown selection method"),
        ("llama", ["--layers", "4,5,6"], "out of range"),
        ("llama", ["--drop", "2", "--layers", "1,2", "--replace", "magic"], "--replace: invalid choice: 'magic'"),
        ("gemma2", ["--layers", "2,3", "--replace", "lstsq"], "post_feedforward_layernorm"),
        ("gpt2", ["--layers", "2", "--what", "attention"], "sublayer removal supports"),
    ],
)
def test_cli_bad_inputs_leave_nothing(family, args, message, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = _cli("prune", tiny_model_dir(family), "-o", out, *args, "--samples", "2", "--seq-len", "16")
    assert rc == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no output, no temp sibling


@pytest.mark.slow
def test_real_model_prune_outputs_load(tmp_path):
    """SmolLM2: block drop loads in stock transformers; attention drop (gate-norm) with remote code."""
    from transformers import AutoModelForCausalLM

    from layercut.compress.workflow.stages.prune import prune

    blocks = prune("bundled:smollm2-135m", tmp_path / "blocks", layers="12-17,25,26", progress=False)
    assert blocks["num_layers_after"] == 22
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "blocks").eval()
    assert_cached_generation_matches(model, steps=3)
    attn = prune("bundled:smollm2-135m", tmp_path / "attn", drop=4, select="gate-norm", what="attention",
                 progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "attn", trust_remote_code=True,
                                                 local_files_only=True).eval()
    assert sorted(model.config.layercut_drop_attention) == attn["layers"]
    assert_cached_generation_matches(model, steps=3)
