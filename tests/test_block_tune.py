"""Block-wise reconstruction after GPTQ (compress/quant/solve/block_tune.py): the hand-written backward,
what a tuned block may change (codes one step, scales, nothing else), that it lowers the block's
output error and the model's KL, the float-stream target, the checkpoint it writes (streamed equals
in memory; stock transformers and layercut's loader read it), and bad input."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from layercut.calibrate.capture import run_blocks
from layercut.calibrate.data import CalibSet
from layercut.compress.quant.format.result import QuantizeResult
from layercut.compress.quant.solve.block_tune import (
    BlockTune,
    TunedLinear,
    channel_weights,
    masked_mse,
    tune_block,
)
from layercut.compress.quant.solve.driver import _BlockTuner, quantize_model
from layercut.compress.quant.solve.gptq import gptq_quantize, hessian_update
from tests.plain_solver import plain_solver
from tests.test_cli_errors import check_one_error, tree
from tests.test_quantize import small_model


def _calib(model, n: int = 16, length: int = 32, seed: int = 1) -> CalibSet:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0  # some padding: it must not count in the loss
    return CalibSet(ids, mask)


def _kl(ref_model, model, ids) -> float:
    with torch.no_grad():
        p = ref_model(ids).logits.log_softmax(-1)
        q = model(ids).logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _solved_linear(seed: int = 0, bits: int = 3, gs: int = 16):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(24, 48, generator=g)
    x = torch.randn(200, 48, generator=g)
    H, _ = hessian_update(None, 0, x)
    return W, x, gptq_quantize(W, H, bits, gs, act_order=True, static_groups=True)


def test_backward_matches_autograd_of_the_same_formula():
    """The custom backward (weight rebuilt, not saved) against autograd through the same formula
    with the straight-through rounding written out; a wrong scale or group index turns it red."""
    _, x, res = _solved_linear()
    lin = TunedLinear(res, bias=torch.randn(24))
    with torch.no_grad():
        lin.v.uniform_(-0.7, 0.7)
        lin.t.uniform_(-0.1, 0.1)
    x = x.clone().requires_grad_(True)
    y = lin(x)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()

    v = lin.v.detach().clone().requires_grad_(True)
    t = lin.t.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    c = res.q.float() + v
    c = c + (c.round().clamp(0, 2**res.bits - 1) - c).detach()
    gi = res.g_idx.long()
    W = (res.scales * (1 + t)).T[:, gi] * (c - res.zeros.T.float()[:, gi])
    ((x2 @ W.T + lin.bias) * gy).sum().backward()
    torch.testing.assert_close(y, x2 @ W.T + lin.bias)
    torch.testing.assert_close(lin.v.grad, v.grad)
    torch.testing.assert_close(lin.t.grad, t.grad)
    torch.testing.assert_close(x.grad, x2.grad)


def test_tuned_result_keeps_the_format():
    """Codes within one step of GPTQ's and in range, zeros and g_idx unchanged, float16 scales,
    and the dequant identity the packer and every loader rely on."""
    _, _, res = _solved_linear(bits=2)
    lin = TunedLinear(res, bias=None)
    with torch.no_grad():
        lin.v.uniform_(-1, 1)
        lin.t.uniform_(-0.2, 0.2)
    out = lin.result(res)
    assert out.q.dtype == torch.int32 and int(out.q.min()) >= 0 and int(out.q.max()) <= 3
    assert int((out.q - res.q).abs().max()) == 1
    assert torch.equal(out.zeros, res.zeros) and torch.equal(out.g_idx, res.g_idx)
    assert torch.equal(out.scales, out.scales.half().float()) and not torch.equal(out.scales, res.scales)
    gi = out.g_idx.long()
    assert torch.equal(out.dequant, out.scales.T[:, gi] * (out.q - out.zeros.T[:, gi]).float())


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_tuning_lowers_block_error_and_model_kl(family):
    """2-bit on a tiny model: every block's output error on the calibration set goes down (or the
    block keeps GPTQ's result), and the model's KL to the float model on other tokens goes down."""
    ref = small_model(family)
    calib = _calib(ref)
    probe = _calib(ref, n=8, seed=7).input_ids
    kls = {}
    for tune in (None, BlockTune(steps=60, lr=0.01)):
        model = copy.deepcopy(ref)
        result = quantize_model(model, calib, plain_solver(bits=2, group_size=32, tune=tune), batch_size=4,
                                progress=False)
        kls[tune is not None] = _kl(ref, model, probe)
        if tune is not None:
            reps = result.tune_reports
            assert sorted(reps) == [0, 1, 2]
            assert all(r.loss_tuned < r.loss_gptq and r.kept for r in reps.values())
            assert all(r.codes_changed > 0 for r in reps.values())
    assert kls[True] < 0.97 * kls[False], kls


def test_float_target_follows_the_float_model():
    """target="float": each block's target is the float model's own hidden state (the block's
    float output on the float stream), not the quantized stream's."""
    model = small_model("llama")
    calib = _calib(model, n=4)
    tuner = _BlockTuner(BlockTune(target="float"), QuantizeResult(config=plain_solver()))
    seen = []

    def on_block(run):
        tuner.start(run)
        seen.append(torch.cat(tuner.targets))
        with torch.no_grad():  # perturb the block after its target: the float stream must not see it
            for p in run.block.parameters():
                p.add_(0.05)
        run.invalidate()

    ref = small_model("llama")
    run_blocks(model, calib, [on_block], batch_size=2, progress=False)
    with torch.no_grad():
        hs = ref(calib.input_ids, attention_mask=calib.attention_mask, output_hidden_states=True).hidden_states
    for i, got in enumerate(seen[:-1]):  # the last hidden state is after the final norm
        mask = calib.attention_mask.bool()
        torch.testing.assert_close(got[mask], hs[i + 1][mask], atol=1e-4, rtol=1e-4)


def test_tuning_never_keeps_a_worse_block():
    """A learning rate far too large for the data: the block keeps GPTQ's result exactly."""
    ref = small_model("llama", layers=1)
    calib = _calib(ref, n=4)
    plain, tuned = copy.deepcopy(ref), copy.deepcopy(ref)
    quantize_model(plain, calib, plain_solver(bits=3, group_size=32), batch_size=2, progress=False)
    r = quantize_model(tuned, calib, plain_solver(bits=3, group_size=32,
                                                  tune=BlockTune(steps=4, lr=50.0, scale_lr=5.0,
                                                                 norm_lr=5.0)),
                       batch_size=2, progress=False)
    assert not r.tune_reports[0].kept
    for a, b in zip(plain.parameters(), tuned.parameters()):  # the norms trained too, and were put back
        assert torch.equal(a, b)


def test_masked_mse_ignores_padding():
    y, t = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    t[1, 2] = 100.0
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert float(masked_mse(y, t, mask)) > 0
    mask[1, 2] = False
    assert float(masked_mse(y, t, mask)) == 0


def test_tune_block_puts_the_modules_back():
    model = small_model("llama", layers=1)
    block = model.model.layers[0]
    before = {n: type(m) for n, m in block.named_modules()}
    grads = {n: p.requires_grad for n, p in block.named_parameters()}
    W = block.mlp.down_proj.weight.detach()
    H, _ = hessian_update(None, 0, torch.randn(64, W.shape[1]))
    res = gptq_quantize(W, H, 4, 32)
    x = [torch.randn(2, 8, model.config.hidden_size)]
    targets = [block.mlp(x[0]).detach()]
    tune_block(block, lambda i, rows: block.mlp(x[i]), targets, [torch.ones(2, 8, dtype=torch.bool)],
               {"mlp.down_proj": (res, None)}, BlockTune(steps=3))
    assert {n: type(m) for n, m in block.named_modules()} == before
    assert {n: p.requires_grad for n, p in block.named_parameters()} == grads


@pytest.fixture(scope="module")
def tuned_dirs(tmp_path_factory, tiny_tokenizer):
    """The small llama quantized with block tuning through the CLI: streamed (the default for a
    checkpoint) and whole-model."""
    from layercut.compress.workflow.cli import main

    root = tmp_path_factory.mktemp("block-tune")
    src = root / "src"
    small_model("llama").save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    args = ["--bits", "3", "--group-size", "32", "--samples", "8", "--seq-len", "32", "--block-tune",
            "--block-tune-steps", "20"]
    for name, extra in (("streamed", []), ("whole", ["--whole-model"])):
        assert main(["-q", "quantize", str(src), "-o", str(root / name), *args, *extra]) == 0
    return src, root / "streamed", root / "whole"


def test_streamed_equals_whole_model_and_the_report_says_so(tuned_dirs):
    from safetensors.torch import load_file

    _, streamed, whole = tuned_dirs
    a = load_file(str(next(streamed.glob("*.safetensors"))))
    b = {}
    for f in whole.glob("*.safetensors"):
        b.update(load_file(str(f)))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rep = json.loads((streamed / "quantize.json").read_text())
    assert rep["block_tune"]["steps"] == 20 and rep["block_tune"]["blocks"] == 3
    assert 0 < rep["block_tune"]["loss_ratio"] < 1 and rep["block_tune"]["codes_moved"] > 0
    per_block = rep["block_tune"]["block_ratios"]
    assert len(per_block) == 3 and all(0 < x <= 1 for x in per_block)
    geo = math.exp(sum(math.log(x) for x in per_block) / 3)
    assert geo == pytest.approx(rep["block_tune"]["loss_ratio"], rel=1e-3)
    assert "block tuning" in rep["description"]


def test_mixed_bits_tune_the_allocated_blocks(tuned_dirs, tmp_path):
    """``--avg-bits`` with ``--block-tune``: the allocation is chosen on GPTQ's losses (the same as
    without tuning), then every block of it is tuned; the report says so. Turns red if the mixed
    path drops the tuning (same codes) or loses its report."""
    from safetensors.torch import load_file

    from layercut.compress.workflow.cli import main

    src = tuned_dirs[0]
    args = ["--avg-bits", "3.5", "--samples", "8", "--seq-len", "32", "--no-fallback-check"]
    assert main(["-q", "quantize", str(src), "-o", str(tmp_path / "plain"), *args]) == 0
    assert main(["-q", "quantize", str(src), "-o", str(tmp_path / "tuned"), *args, "--block-tune",
                 "--block-tune-steps", "20"]) == 0
    rep = {n: json.loads((tmp_path / n / "quantize.json").read_text()) for n in ("plain", "tuned")}
    assert rep["tuned"]["bits_per_layer"] == rep["plain"]["bits_per_layer"]
    assert len(set(rep["tuned"]["bits_per_layer"].values())) > 1  # really mixed
    assert rep["tuned"]["block_tune"]["blocks"] == 3 and rep["tuned"]["block_tune"]["codes_moved"] > 0
    assert "block tuning" in rep["tuned"]["description"] and "block tuning" not in rep["plain"]["description"]
    a, b = (load_file(str(next((tmp_path / n).glob("*.safetensors")))) for n in ("plain", "tuned"))
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith(".qweight"))


def test_stock_transformers_and_layercut_load_it_alike(tuned_dirs):
    from transformers import AutoModelForCausalLM

    from layercut.compress.quant.format.loader import load_quantized

    src, streamed, _ = tuned_dirs
    ours = load_quantized(streamed)
    stock = AutoModelForCausalLM.from_pretrained(streamed, dtype=torch.float32)
    assert type(stock.model.layers[0].self_attn.q_proj).__module__.startswith("gptqmodel.")
    probe = _calib(ours, n=2, seed=3).input_ids
    with torch.no_grad():
        a, b = ours(probe).logits.float(), stock(probe).logits.float()
        fp = AutoModelForCausalLM.from_pretrained(src)(probe).logits
    torch.testing.assert_close(a, b, atol=3e-2, rtol=0)  # gptqmodel's CPU kernel computes in bf16
    assert (a - b).abs().mean() < 0.2 * (fp - a).abs().mean()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_norm_tuning_moves_the_norms_and_nothing_else_unquantized(family):
    """norm_lr > 0: the block's norm weights (gemma's post-norms and q/k norms included) train with
    its codes; the other unquantized tensors (embeddings, the final norm) stay the model's."""
    from layercut.compress.quant.solve.block_tune import norm_weights

    ref = small_model(family, layers=2)
    calib = _calib(ref, n=8)
    losses = {}
    for norm_lr in (0.0, 0.01):
        model = copy.deepcopy(ref)
        r = quantize_model(model, calib, plain_solver(bits=2, group_size=32, tune=BlockTune(steps=30, lr=0.01,
                                                                                          norm_lr=norm_lr)),
                           batch_size=4, progress=False)
        losses[norm_lr] = sum(rep.loss_tuned for rep in r.tune_reports.values())
        for i, block in enumerate(model.model.layers):
            ref_norms = norm_weights(ref.model.layers[i])
            assert len(ref_norms) == (6 if family == "gemma3_text" else 2)
            moved = [not torch.equal(a, b) for a, b in zip(norm_weights(block), ref_norms)]
            assert all(moved) if norm_lr and r.tune_reports[i].kept else not any(moved), (i, moved)
        assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
        assert torch.equal(model.model.norm.weight, ref.model.norm.weight)
    assert losses[0.01] < losses[0.0], losses


def test_the_checkpoint_carries_the_tuned_norms(tmp_path, tiny_tokenizer):
    """Streamed quantize writes the block's tuned norm weights (not the source's)."""
    from safetensors.torch import load_file

    from layercut.compress.workflow.cli import main

    src = tmp_path / "src"
    small_model("llama").save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    args = ["--bits", "3", "--group-size", "32", "--samples", "8", "--seq-len", "32", "--block-tune",
            "--block-tune-steps", "20", "--block-tune-norm-lr", "0.01"]
    assert main(["-q", "quantize", str(src), "-o", str(tmp_path / "q"), *args]) == 0
    a = load_file(str(next(src.glob("*.safetensors"))))
    b = load_file(str(next((tmp_path / "q").glob("*.safetensors"))))
    norms = [k for k in a if "layers." in k and "norm" in k]
    assert norms and all(not torch.equal(a[k].to(b[k].dtype), b[k]) for k in norms)
    assert torch.equal(a["model.norm.weight"].to(b["model.norm.weight"].dtype), b["model.norm.weight"])


@pytest.mark.parametrize("extra,words", [
    (["--block-tune", "--method", "rtn"], ["--block-tune starts from GPTQ's codes", "method rtn"]),
    (["--block-tune", "--block-tune-steps", "0"], ["--block-tune-steps must be > 0"]),
    (["--block-tune", "--block-tune-lr", "-1"], ["--block-tune-lr must be > 0"]),
    (["--block-tune-lr", "0.1"], ["--block-tune-lr set without --block-tune"]),
])
def test_bad_input(extra, words, tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama")
    before = tree(tmp_path)
    capsys.readouterr()  # the fixture's own progress output
    check_one_error(capsys, ["quantize", str(model), "-o", str(tmp_path / "out"), "--bits", "4", *extra], words)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen2", "gpt2"])
def test_a_subset_of_sequences_runs_like_the_whole_micro_batch(family):
    """BlockRun.call(i, rows) slices the batch-shaped call arguments (masks, per-sequence rotary
    tables) with the inputs: its output equals those rows of the whole micro-batch's output."""
    model = small_model(family, layers=2)
    calib = _calib(model, n=8)
    seen = []

    def on_block(run):
        rows = torch.tensor([3, 0])
        assert run.sliceable(0)
        with torch.no_grad():
            seen.append((run.call(0, rows), run.call(0)[rows]))

    run_blocks(model, calib, [on_block], batch_size=4, progress=False)
    for part, whole in seen:
        torch.testing.assert_close(part, whole, atol=1e-5, rtol=1e-5)


def test_channel_loss_weighs_every_channel_alike():
    """loss="channel": a channel 100x larger than the others (a residual stream's massive
    activation) counts as much as any other, and padding does not enter the weights."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(2, 16, 8, generator=gen)
    t[..., 3] *= 100.0
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 10:] = False
    t[1, 10:] = 1e6  # padding
    w = channel_weights([t], [mask])
    assert w.shape == (8,) and abs(float(w.mean()) - 1) < 1e-5
    per_channel = (t[mask].pow(2).mean(0) * w)
    torch.testing.assert_close(per_channel, per_channel.mean().expand(8), rtol=2e-3, atol=0)  # eps: 1e-6 of the mean
    # The same relative error on the big channel and on a small one costs the same.
    big, small = t.clone(), t.clone()
    big[..., 3] *= 1.1
    small[..., 0] *= 1.1
    a, b = (float(masked_mse(x, t, mask, w)) for x in (big, small))
    assert abs(a - b) < 0.35 * max(a, b)  # plain MSE: ~10,000x apart
    assert float(masked_mse(big, t, mask)) > 100 * float(masked_mse(small, t, mask))


def test_channel_loss_tunes_a_model():
    ref = small_model("llama", layers=1)
    calib = _calib(ref, n=4)
    model = copy.deepcopy(ref)
    r = quantize_model(model, calib, plain_solver(bits=2, group_size=32, tune=BlockTune(steps=30, lr=0.01,
                                                                                      loss="channel")),
                       batch_size=2, progress=False)
    assert r.tune_reports[0].kept and r.tune_reports[0].loss_tuned < r.tune_reports[0].loss_gptq


@pytest.mark.parametrize("bad", [dict(optimizer="sgd"), dict(init="rtn"), dict(target="fp"), dict(batch=0),
                                 dict(loss="l1"),
                                 dict(scale_lr=float("nan")), dict(norm_lr=-1.0)])
def test_python_api_refuses_bad_settings(bad):
    from layercut.compress.core.errors import LayercutError

    with pytest.raises(LayercutError, match="block tuning"):
        BlockTune(**bad).check()
