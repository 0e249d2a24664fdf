"""Layer-selection scores: formulas, driver vs. model forward, Gate-Norm files, selection, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from layercut.calibrate.data import CalibSet
from layercut.compress.core.arch import arch_for, get_submodule
from layercut.compress.core.errors import LayercutError
from layercut.compress.select import (
    LayerScores,
    compute_scores,
    gate_norm_from_model,
    gate_norm_scores,
    gate_norm_select,
    load_scores,
    plot_scores,
    select_blocks,
    select_sublayers,
    swap_kl_scores,
)
from layercut.compress.select.cores import (
    angular_last,
    angular_tokens,
    best_span,
    cosine_sum,
    gate_norm_qk,
    lowest,
    span_distances,
    split_fused_qkv,
)
from layercut.compress.select.swap_kl import token_kl
from layercut.compress.workflow.cli import main
from tests.conftest import FAMILIES, build_tiny_model

# -- cores on hand-made tensors -------------------------------------------------------------


def _acos_angle(u: torch.Tensor, v: torch.Tensor) -> float:
    cos = float(u.double() @ v.double()) / (float(u.double().norm()) * float(v.double().norm()))
    return math.acos(max(-1.0, min(1.0, cos))) / math.pi


def test_angular_and_cosine_cores_mask_padding():
    torch.manual_seed(0)
    a, b = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).bool()
    b[0, 3:] = 1e6  # garbage on padding must not leak in
    last = [2, 4, 1]
    want = [_acos_angle(a[i, t], b[i, t]) for i, t in enumerate(last)]
    assert angular_last(a, b, mask).tolist() == pytest.approx(want, abs=1e-12)
    real = [(i, t) for i in range(3) for t in range(5) if mask[i, t]]
    assert angular_tokens(a, b, mask).tolist() == pytest.approx([_acos_angle(a[i, t], b[i, t]) for i, t in real])
    s, c = cosine_sum(a, b, mask)
    assert c == 10
    assert s == pytest.approx(sum(math.cos(math.pi * _acos_angle(a[i, t], b[i, t])) for i, t in real))
    # identical / opposite streams: distance 0 / 1
    assert angular_tokens(a, a, mask).max() < 1e-6 and angular_tokens(a, -a, mask).min() > 1 - 1e-6


def test_span_distances_best_span_and_lowest():
    torch.manual_seed(1)
    states = [torch.randn(4, 3) for _ in range(6)]  # h_0..h_5 at T, L = 5
    d2 = span_distances(states, 2)
    assert len(d2) == 4
    for j, d in enumerate(d2):
        want = sum(_acos_angle(states[j][s], states[j + 2][s]) for s in range(4)) / 4
        assert d == pytest.approx(want)
    assert best_span([0.5, 0.2, 0.2, 0.9], 2) == [1, 2]  # first minimum on ties
    assert lowest([0.3, 0.1, 0.1, 0.0, 0.5], 3) == [1, 2, 3]
    with pytest.raises(ValueError):
        span_distances(states, 6)


def _direct_gate_norm(w_q, w_k, heads, kv):
    """sqrt Σ_h ‖W_Q,h W_K,g(h)ᵀ‖_F² with the d×d per-head product formed explicitly."""
    dh, d = w_q.shape[0] // heads, w_q.shape[1]
    q = w_q.double().reshape(heads, dh, d)
    k = w_k.double().reshape(kv, dh, d)
    total = 0.0
    for h in range(heads):
        g = h // (heads // kv)  # repeat_kv: query head h reads key head h // group
        total += float(torch.linalg.norm(q[h].T @ k[g]) ** 2)  # paper layout W_Q,h W_K,gᵀ: [d, d]
    return math.sqrt(total)


def test_gate_norm_gram_equals_direct_product():
    torch.manual_seed(2)
    d, dh = 24, 8
    # one head: exactly ‖W_Q W_Kᵀ‖_F in the paper's layout (q = x W_Q, W_Q = linear.weight.T)
    w_q, w_k = torch.randn(dh, d), torch.randn(dh, d)
    direct = torch.linalg.norm(w_q.T.double() @ w_k.double())
    assert gate_norm_qk(w_q, w_k, 1) == pytest.approx(float(direct), rel=1e-6)
    # several heads, no GQA, and GQA (4 query heads share 2 key heads)
    for heads, kv in ((3, 3), (4, 2), (4, 1)):
        w_q, w_k = torch.randn(heads * dh, d), torch.randn(kv * dh, d)
        assert gate_norm_qk(w_q, w_k, heads, kv) == pytest.approx(_direct_gate_norm(w_q, w_k, heads, kv), rel=1e-6)
    # Per head means cross-head products are not included: the whole-matrix norm differs.
    w_q, w_k = torch.randn(3 * dh, d), torch.randn(3 * dh, d)
    assert abs(gate_norm_qk(w_q, w_k, 3) - float(torch.linalg.norm(w_q.T @ w_k))) > 1e-2
    # bf16 input is converted to fp32; G is a norm: homogeneous of degree 1 in each matrix
    assert gate_norm_qk(2 * w_q, w_k, 3) == pytest.approx(2 * gate_norm_qk(w_q, w_k, 3), rel=1e-6)
    assert gate_norm_qk(w_q.bfloat16(), w_k.bfloat16(), 3) == pytest.approx(gate_norm_qk(w_q, w_k, 3), rel=2e-2)
    with pytest.raises(ValueError):
        gate_norm_qk(torch.randn(3 * dh, d), torch.randn(2 * dh, d), 3, 2)


def test_split_fused_layouts():
    H, kv, dh, d = 4, 2, 3, 5
    w = torch.arange((H + 2 * kv) * dh * d, dtype=torch.float32).reshape(-1, d)
    q, k = split_fused_qkv(w, "stacked", H, kv, dh)
    assert torch.equal(q, w[: H * dh]) and torch.equal(k, w[H * dh : (H + kv) * dh])
    w = torch.arange(3 * H * dh * d, dtype=torch.float32).reshape(-1, d)
    q, k = split_fused_qkv(w, "neox", H, H, dh)
    assert torch.equal(k[dh : 2 * dh], w[4 * dh : 5 * dh])  # head 1's key rows follow head 1's query rows
    q, k = split_fused_qkv(w.T.contiguous(), "conv1d", H, H, dh)
    assert torch.equal(q, w[: H * dh]) and torch.equal(k, w[H * dh : 2 * H * dh])
    with pytest.raises(ValueError):
        split_fused_qkv(w, "zigzag", H, H, dh)


# -- Gate-Norm against each family's own attention -------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_qk_split_matches_model_attention(family):
    """The q / k our split yields are the q / k each model's attention actually computes."""
    from transformers import AttentionInterface

    model = build_tiny_model(family)
    for module in model.modules():
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
        for norm in ("q_norm", "k_norm"):  # Qwen3 / Gemma3 normalise q, k after projection
            if hasattr(module, norm):
                setattr(module, norm, nn.Identity())
    seen: dict[int, tuple] = {}

    def capture(module, q, k, v, attention_mask, **kwargs):
        seen[id(module)] = (q.clone(), k.clone())
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), None

    AttentionInterface.register("layercut_capture", capture)
    model.set_attn_implementation("layercut_capture")
    spec = arch_for(model)
    inputs: dict[int, torch.Tensor] = {}
    handles = [get_submodule(b, spec.attn).register_forward_pre_hook(
        lambda m, args, kwargs: inputs.__setitem__(id(m), (args[0] if args else kwargs["hidden_states"]).clone()),
        with_kwargs=True) for b in spec.layers_of(model)]
    model(input_ids=torch.tensor([[5]]))  # position 0: rotary is the identity
    for h in handles:
        h.remove()
    from layercut.compress.select.gate_norm import FUSED_LAYOUTS, head_counts

    heads, kv, dh = head_counts(model.config.to_dict())
    for block in spec.layers_of(model):
        attn = get_submodule(block, spec.attn)
        x = inputs[id(attn)][0, 0]
        if spec.fused_qkv:
            w_q, w_k = split_fused_qkv(get_submodule(block, spec.fused_qkv).weight, FUSED_LAYOUTS[spec.family],
                                       heads, kv, dh)
        else:
            w_q, w_k = get_submodule(block, spec.q_proj).weight, get_submodule(block, spec.k_proj).weight
        q, k = seen[id(attn)]
        torch.testing.assert_close(q[0, :, 0], (w_q @ x).reshape(heads, dh), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k[0, :, 0], (w_k @ x).reshape(kv, dh), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_gate_norm_from_files_equals_in_memory(family, tiny_model_dir):
    path = tiny_model_dir(family)
    model = build_tiny_model(family)  # same seed as the saved checkpoint
    files, memory = gate_norm_scores(path), gate_norm_from_model(model)
    assert len(files) == model.config.num_hidden_layers
    assert files == pytest.approx(memory, rel=1e-6)
    assert gate_norm_select(path, 2) == lowest(files, 2)


def test_gate_norm_sharded_and_bf16(tmp_path):
    model = build_tiny_model("qwen2")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    assert gate_norm_scores(tmp_path / "sharded") == pytest.approx(gate_norm_from_model(model), rel=1e-6)
    half = model.to(torch.bfloat16)
    half.save_pretrained(tmp_path / "bf16")
    assert gate_norm_scores(tmp_path / "bf16") == pytest.approx(gate_norm_from_model(half), rel=1e-6)


def test_gate_norm_bad_inputs(tmp_path, tiny_model_dir):
    with pytest.raises(LayercutError, match="not found"):
        gate_norm_scores(tmp_path / "nope")
    with pytest.raises(LayercutError, match="attention layers"):
        gate_norm_select(tiny_model_dir("llama"), 6)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model_dir("llama") / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(LayercutError, match="corrupt"):
        gate_norm_scores(broken)


# -- driver scores vs. the model's own hidden states -----------------------------------------


def _padded(calib: CalibSet) -> CalibSet:
    ids, mask = calib.input_ids.clone(), calib.attention_mask.clone()
    mask[1, 20:] = 0
    ids[1, 20:] = 0
    mask[4, 9:] = 0
    ids[4, 9:] = 0
    return CalibSet(ids, mask)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_neox", "gpt2"])
@torch.no_grad()
def test_driver_scores_equal_hidden_state_scores(family, calib):
    model = build_tiny_model(family)
    data = _padded(calib)
    spec = arch_for(model)
    layers = spec.layers_of(model)
    L = len(layers)
    contrib: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for i, block in enumerate(layers):  # an ordinary full forward with hooks, no driver
        handles.append(get_submodule(block, spec.attn_out).register_forward_hook(
            lambda m, a, y, i=i: contrib.__setitem__(("attn", i), y[0] if isinstance(y, tuple) else y)))
        handles.append(get_submodule(block, spec.mlp_out).register_forward_hook(
            lambda m, a, y, i=i: contrib.__setitem__(("mlp", i), y[0] if isinstance(y, tuple) else y)))
    handles.append(layers[-1].register_forward_hook(
        lambda m, a, y: contrib.__setitem__(("raw", L), y[0] if isinstance(y, tuple) else y)))
    out = model(input_ids=data.input_ids, attention_mask=data.attention_mask, output_hidden_states=True)
    for h in handles:
        h.remove()
    hs = list(out.hidden_states[:L]) + [contrib[("raw", L)]]  # hidden_states[-1] is post final norm
    assert not torch.allclose(out.hidden_states[L], hs[L])
    mask = data.attention_mask.bool()

    span = 2
    scores = compute_scores(model, data, span=span, batch_size=4, progress=False)

    def one_minus_cos(x, y):
        s, c = cosine_sum(x, y, mask)
        return 1 - s / c

    assert scores.block_influence == pytest.approx([one_minus_cos(hs[j], hs[j + 1]) for j in range(L)], abs=1e-5)
    attn = [one_minus_cos(hs[j], hs[j] + contrib[("attn", j)]) for j in range(L)]
    post = [hs[j] + contrib[("attn", j)] for j in range(L)]
    mlp = [one_minus_cos(post[j], post[j] + contrib[("mlp", j)]) for j in range(L)]
    assert scores.attn_importance == pytest.approx(attn, abs=1e-5)
    assert scores.mlp_importance == pytest.approx(mlp, abs=1e-5)
    for n in range(1, L):
        want = [float(angular_last(hs[j], hs[j + n], mask).mean()) for j in range(L - n + 1)]
        assert scores.angular_spans[n] == pytest.approx(want, abs=1e-5)
    assert scores.angular == scores.angular_spans[span]
    assert len(scores.angular) == L - span + 1
    want_all = [float(angular_tokens(hs[j], hs[j + span], mask).mean()) for j in range(L - span + 1)]
    assert scores.angular_all == pytest.approx(want_all, abs=1e-5)
    assert scores.tokens == int(mask.sum())
    assert LayerScores.from_dict(json.loads(json.dumps(scores.to_dict()))) == scores


# -- selection ---------------------------------------------------------------------------------


def _scores() -> LayerScores:
    return LayerScores(
        num_layers=6, span=2,
        block_influence=[0.5, 0.1, 0.3, 0.05, 0.4, 0.2],
        attn_importance=[0.3, 0.01, 0.02, 0.2, 0.03, 0.5],
        mlp_importance=[0.4, 0.3, 0.015, 0.6, 0.2, 0.1],
        angular=[0.4, 0.3, 0.1, 0.2, 0.5],
        angular_all=[0.2, 0.4, 0.3, 0.35, 0.1],
        angular_spans={1: [0.3, 0.2, 0.25, 0.05, 0.3, 0.4], 2: [0.4, 0.3, 0.1, 0.2, 0.5]},
        gate_norm=[1.0, 0.2, 0.5, 0.1, 0.9, 0.3],
    )


def test_select_blocks_methods_and_edges():
    s = _scores()
    assert select_blocks(s, 2, "angular") == [2, 3]
    assert select_blocks(s, 1, "angular") == [3]  # last-token table holds every span
    assert select_blocks(s, 2, "angular-all") == [4, 5]
    assert select_blocks(s, 3, "block-influence") == [1, 3, 5]
    for n in (0, 6, 7):
        with pytest.raises(LayercutError, match="cannot drop"):
            select_blocks(s, n, "block-influence")
    with pytest.raises(LayercutError, match="span=3"):
        select_blocks(s, 3, "angular-all")
    with pytest.raises(LayercutError, match="span 3"):
        select_blocks(s, 3, "angular")
    with pytest.raises(LayercutError, match="unknown"):
        select_blocks(s, 2, "random")


def test_select_sublayers_methods_and_edges(tiny_model_dir):
    s = _scores()
    assert select_sublayers(s, 2, "attn-cosine", "attention") == [1, 2]
    assert select_sublayers(s, 2, "cosine", "mlp") == [2, 5]
    assert select_sublayers(s, 3, "joint") == [(1, "attention"), (2, "attention"), (2, "mlp")]
    assert select_sublayers(s, 2, "gate-norm", "attention") == [1, 3]
    path = tiny_model_dir("llama")
    assert select_sublayers(path, 2, "gate-norm") == gate_norm_select(path, 2)
    assert select_sublayers(build_tiny_model("llama"), 2, "gate-norm") == gate_norm_select(path, 2)
    for args, match in [((s, 2, "attn-cosine", "mlp"), "not mlp"), ((s, 2, "gate-norm", "mlp"), "attention"),
                        ((s, 6, "attn-cosine", "attention"), "cannot drop"), ((s, 12, "joint"), "cannot drop"),
                        ((s, 2, "what"), "unknown"), ((s, 2, "cosine", "ffn"), "unknown")]:
        with pytest.raises(LayercutError, match=match):
            select_sublayers(*args)


def test_compute_scores_rejects_bad_methods_and_spans(calib):
    model = build_tiny_model("llama")
    with pytest.raises(LayercutError, match="unknown score method"):
        compute_scores(model, calib, methods=["angular", "bogus"])
    for span in (0, 6):
        with pytest.raises(LayercutError, match="span"):
            compute_scores(model, calib, span=span, methods=["angular"])


@torch.no_grad()
def test_swap_kl_is_zero_for_identical_blocks_and_restores_model(calib):
    model = build_tiny_model("llama")
    layers = arch_for(model).layers_of(model)
    layers[3].load_state_dict(layers[2].state_dict())  # blocks 2 and 3 now compute the same function
    before = [id(b) for b in layers]
    ref = model(input_ids=calib.input_ids, attention_mask=calib.attention_mask).logits
    res = swap_kl_scores(model, calib, samples=3, progress=False)
    assert [id(b) for b in layers] == before
    assert [b.self_attn.layer_idx for b in layers] == list(range(6))
    torch.testing.assert_close(model(input_ids=calib.input_ids, attention_mask=calib.attention_mask).logits, ref)
    assert res["pairs"][2] == [2, 3] and res["interchange"][2] < 1e-9 and res["replacement"][2] < 1e-9
    # The cached-prefix shortcut gives what a plain swapped full-model forward gives.
    ref_logp = torch.log_softmax(ref[:3].double(), dim=-1)
    for i in (0, 4):
        layers[i], layers[i + 1] = layers[i + 1], layers[i]
        swapped = model(input_ids=calib.input_ids[:3], attention_mask=calib.attention_mask[:3]).logits
        layers[i], layers[i + 1] = layers[i + 1], layers[i]
        assert res["interchange"][i] == pytest.approx(token_kl(ref_logp, swapped, calib.attention_mask[:3]), rel=1e-4)
    assert min(res["interchange"][i] for i in (0, 1, 3, 4)) > 1e-7
    assert all(r >= 0 for r in res["replacement"]) and res["tokens"] == 3 * calib.seq_len


def test_plot_and_load_scores(tmp_path):
    png = plot_scores(_scores(), tmp_path / "s.png", highlight={"block_influence": [1, 3]})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(LayercutError, match=".png"):
        plot_scores(_scores(), tmp_path / "s.jpg")
    (tmp_path / "s.json").write_text(json.dumps({"scores": _scores().to_dict()}))
    assert load_scores(tmp_path / "s.json") == _scores()


# -- CLI ---------------------------------------------------------------------------------------


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_score_all_json_plot_output(tiny_model_dir, tmp_path, capsys):
    path = tiny_model_dir("llama")
    out, png = tmp_path / "o" / "scores.json", tmp_path / "scores.png"
    rc = main(["score", str(path), "--method", "all,swap-kl", "--span", "2", "--samples", "4", "--seq-len", "16",
               "--batch-size", "2", "--swap-samples", "2", "--json", "--plot", str(png), "-o", str(out)])
    assert rc == 0
    res = _last_json(capsys)
    sel = res["selection"]
    assert len(sel["angular"]) == 2 and sel["angular"][1] == sel["angular"][0] + 1
    assert len(sel["block-influence"]) == 2 and len(sel["gate-norm"]) == 2 and len(sel["joint"]) == 2
    assert res["scores"]["gate_norm"] == pytest.approx(gate_norm_scores(path))
    assert len(res["scores"]["swap_kl"]["interchange"]) == 5
    assert json.loads(out.read_text())["selection"] == sel
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["o", "scores.json", "scores.png"]


def test_cli_gate_norm_needs_no_data(tiny_model_dir, tmp_path, capsys):
    path = tiny_model_dir("phi3")
    rc = main(["score", str(path), "--method", "gate-norm", "--drop", "2", "--calib", str(tmp_path / "none.txt"),
               "--json"])
    assert rc == 0
    res = _last_json(capsys)
    assert res["selection"] == {"gate-norm": gate_norm_select(path, 2)}
    assert "capture_s" not in res["timings"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "nonsense"], "unknown score method"),
        (["--method", "angular", "--span", "6"], "span 6"),
        (["--method", "angular", "--span", "0"], "--span must be"),
        (["--method", "block-influence", "--drop", "6"], "cannot drop 6"),
        (["--method", "angular-all", "--span", "2", "--drop", "3"], "--span 3"),
        (["--method", "gate-norm", "--plot", "x.jpg"], ".png"),
    ],
)
def test_cli_bad_inputs_write_nothing(tiny_model_dir, tmp_path, capsys, extra, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["score", str(tiny_model_dir("llama")), *extra, "-o", "plan.json", "--plot", "p.png"]
              if "--plot" not in extra else ["score", str(tiny_model_dir("llama")), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_missing_model(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["score", str(tmp_path / "absent"), "--method", "gate-norm", "-o", str(out)]) == 2
    assert "model not found" in capsys.readouterr().err
    assert not out.exists()
