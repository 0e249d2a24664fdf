"""Scale tuning (heal --method scales): only the GPTQ scales move, the rest of the checkpoint is
byte-identical, the tuned checkpoint loads and is closer to the teacher, and bad input is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from layercut.cli import main
from layercut.compress.core.errors import LayercutError

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
ARGS = ["--steps", "12", "--seq-len", "24", "--batch", "2", "--data-offset", "0", "--lr", "5e-3", "--teacher-topk", "0"]


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _kl(student, teacher, ids) -> float:
    with torch.no_grad():
        lt = torch.log_softmax(teacher(input_ids=ids).logits.float(), -1)
        ls = torch.log_softmax(student(input_ids=ids).logits.float(), -1)
    return float((lt.exp() * (lt - ls)).sum(-1).mean())


@pytest.fixture(scope="module")
def q3(tiny_model_dir, tmp_path_factory):
    """A tiny llama at 3-bit g32 (GPTQ), and its source."""
    from layercut.compress.workflow.stages.quantize import quantize_checkpoint

    src = tiny_model_dir("llama")
    qdir = tmp_path_factory.mktemp("scales") / "q3"
    quantize_checkpoint(str(src), qdir, bits=3, group_size=32, samples=4, seq_len=32, progress=False)
    return src, qdir


def test_only_scales_change_and_the_teacher_gets_closer(q3, tmp_path, tiny_tokenizer, capsys):
    """Red if any code, zero, g_idx, norm or embedding changed, if the tuned scales were not written
    back (identical to the source's), or if training moved away from the teacher."""
    from layercut.compress.io.models import load_model

    src, qdir = q3
    out = tmp_path / "tuned"
    code = main(["heal", str(qdir), "--method", "scales", "--teacher", str(src), "-o", str(out), *ARGS, "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["targets"] == ["scales"] and not report["merged"] and report["lora_modules"] == 0
    before, after = _tensors(qdir), _tensors(out)
    assert before.keys() == after.keys()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all(k.endswith(".scales") for k in moved)
    assert all(after[k].dtype == torch.float16 and (after[k] > 0).all() for k in moved)
    assert json.loads((out / "config.json").read_text()) == json.loads((qdir / "config.json").read_text())
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) == sum(f.stat().st_size for f in qdir.glob("*.safetensors"))
    assert (out / "HEAL.md").is_file() and json.loads((out / "heal.json").read_text())["steps"] == 12

    teacher, _ = load_model(src, dtype=torch.float32, with_tokenizer=False)
    from layercut.heal.config import HealConfig
    from layercut.heal.data import heal_data

    # the windows it trained on (a random tiny model has nothing to generalise): the optimisation works
    ids = heal_data(tiny_tokenizer, HealConfig(steps=12, seq_len=24, batch_size=2, data_offset=0)).input_ids
    kl = {}
    for name, path in (("source", qdir), ("tuned", out)):
        model, _ = load_model(path, dtype=torch.float32, with_tokenizer=False)
        kl[name] = _kl(model, teacher, ids)
    assert kl["tuned"] < kl["source"], kl


def test_tuned_checkpoint_loads_in_gptqmodel_with_the_same_logits(q3, tmp_path, tiny_tokenizer):
    """The rewritten shards are still GPTQ v1 that GPTQModel reads: red if the scale tensors were
    written in another dtype or layout than the loader expects."""
    pytest.importorskip("gptqmodel")
    from gptqmodel import GPTQModel

    from layercut.compress.quant.format.loader import load_quantized
    from layercut.compress.workflow.stages.heal import run
    from layercut.heal.config import HealConfig

    src, qdir = q3
    out = tmp_path / "tuned"
    run(HealConfig(method="scales", teacher=str(src), steps=4, seq_len=24, batch_size=2, data_offset=0, lr=5e-3,
                   teacher_topk=8), qdir, out)
    ids = tiny_tokenizer("a small test sentence for the loaders", return_tensors="pt").input_ids
    ours = load_quantized(out, dtype=torch.float32)
    theirs = GPTQModel.load(str(out), device="cpu", backend="torch")
    with torch.no_grad():
        a = ours(input_ids=ids).logits.float()
        b = theirs.model(input_ids=ids).logits.float()
    assert torch.allclose(a, b, atol=2e-2, rtol=1e-2), (a - b).abs().max()


def test_scale_tuning_refuses_dense_input_and_resume(tiny_model_dir, q3, tmp_path, capsys):
    src, qdir = q3
    out = tmp_path / "x"
    assert main(["heal", str(src), "--method", "scales", "--teacher", str(src), "-o", str(out), *ARGS]) == 2
    assert "not one: quantize it first" in capsys.readouterr().err and not out.exists()
    assert main(["heal", str(qdir), "--method", "scales", "--teacher", str(src), "-o", str(out),
                 "--checkpoint-every", "2", *ARGS]) == 2
    assert "built for --method lora only" in capsys.readouterr().err and not out.exists()


def test_wrap_scales_starts_where_the_quantized_model_is(q3, tiny_tokenizer):
    """θ = 0 computes what the QuantLinear did; unwrapping with θ = 0 returns the same fp16 scales."""
    from layercut.compress.io.models import load_model
    from layercut.heal.scales import unwrap_scales, wrap_scales

    _, qdir = q3
    model, _ = load_model(qdir, dtype=torch.float32, with_tokenizer=False)
    ids = tiny_tokenizer("some words to run", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    params = wrap_scales(model)
    assert params and all(p.requires_grad for p in params)
    assert not any(p.requires_grad for n, p in model.named_parameters() if not n.endswith("theta"))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, ref, atol=1e-4)
    scales = unwrap_scales(model)
    src = _tensors(qdir)
    assert scales and all(torch.equal(v, src[k]) for k, v in scales.items())
    with pytest.raises(LayercutError, match="no GPTQ layers"):
        wrap_scales(model.model.embed_tokens)


def test_recipe_order_for_scale_tuning():
    from layercut.compress.workflow.recipe import Recipe

    base = {"version": 1, "model": "m"}
    Recipe.model_validate(base | {"stages": [{"quantize": {"bits": 4}}, {"heal": {"method": "scales"}},
                                             {"export": {}}]})
    for stages, words in (([{"heal": {"method": "scales"}}, {"quantize": {"bits": 4}}], "after a quantize stage"),
                          ([{"quantize": {"bits": 4}}, {"heal": {}}], "after 'quantize'")):
        with pytest.raises(Exception, match=words):
            Recipe.model_validate(base | {"stages": stages})


def test_recipe_quantize_then_tune_scales_then_export(tiny_model_dir, tmp_path):
    """The demo's shape on a tiny model: the run writes a GPTQ checkpoint with the quantize stage's
    codes and bytes, the tuned scales, a card that names both stages, and an eval of it."""
    from layercut.compress.workflow.pipeline import run_recipe
    from layercut.compress.workflow.recipe import Recipe

    src = tiny_model_dir("llama")
    stages = [{"quantize": {"bits": 4, "group_size": 32, "samples": 4, "seq_len": 32}},
              {"heal": {"method": "scales", "steps": 4, "samples": 8, "seq_len": 32, "batch_size": 2, "lr": 5e-3}},
              "export", {"eval": {"max_tokens": 128, "ctx": 64}}]
    recipe = Recipe.from_dict({"version": 1, "model": str(src), "seed": 3, "stages": stages})
    out = tmp_path / "run"
    report = run_recipe(recipe, out, progress=False)
    final = out / report["final_model"]
    quant_dir = next(p for p in out.iterdir() if p.name.endswith("quantize")) / "model"
    if not quant_dir.is_dir():
        quant_dir = next(p for p in out.iterdir() if p.name.endswith("quantize"))
    q, f = _tensors(quant_dir), _tensors(final)
    assert q.keys() == f.keys()
    changed = {k for k in q if not torch.equal(q[k], f[k])}
    assert changed and all(k.endswith(".scales") for k in changed)
    assert "quantization_config" in json.loads((final / "config.json").read_text())
    card = (final / "README.md").read_text()
    assert "GPTQ group scales tuned by distillation" in card


def _old_scale_forward(layer, theta, x):
    """The formula ScaleTuned computed before it kept the packed codes: the whole dense weight in float32."""
    from layercut.compress.quant.format.pack import unpack_gptq

    q, z = unpack_gptq(layer.qweight, layer.qzeros, layer.bits, layer.in_features, layer.out_features)
    g = layer.g_idx.long()
    codes = q.to(torch.int16) - z[g].T.to(torch.int16)
    w = (layer.scales.float() * (1 + theta))[g].T * codes.to(torch.float32)
    y = x @ w.to(x.dtype).T
    return y if layer.bias is None else y + layer.bias.float().to(y.dtype)


def _random_qlinear(bits, in_features, out_features, group, act_order, bias, seed=0):
    from layercut.compress.quant.format.qlinear import QuantLinear

    gen = torch.Generator().manual_seed(seed)
    groups = in_features // group
    q = torch.randint(0, 2**bits, (out_features, in_features), generator=gen)
    zeros = torch.randint(1, 2**bits, (groups, out_features), generator=gen)
    scales = torch.rand(groups, out_features, generator=gen) * 0.02 + 0.001
    g_idx = torch.arange(in_features) // group
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=gen)]
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    return QuantLinear.from_dense(linear, q, zeros, scales, g_idx.to(torch.int32), bits, group)


@pytest.mark.parametrize("bits,act_order,bias,cache", [(4, False, False, False), (3, True, True, False),
                                                       (8, False, True, False), (2, True, False, False),
                                                       (4, True, True, True), (8, False, False, True)])
def test_scale_tuned_matches_the_dense_formula(monkeypatch, bits, act_order, bias, cache):
    """The packed forward/backward (several row slices: 100 outputs in slices of 32), and the same from
    cached int8/int16 codes, give the old dense formula's output, θ gradient and input gradient within 1e-5
    relative. Red on a wrong slice of the packed zero points, a wrong group sum (act-order g_idx), a missing
    bias, or cached codes that overflow their integer type (8 bits in int8)."""
    from layercut.heal import scales as sc

    monkeypatch.setattr(sc, "CHUNK_ELEMENTS", 32 * 64)  # 32 rows of 64 inputs per slice
    layer = _random_qlinear(bits, 64, 100, 16, act_order, bias)
    tuned = sc.ScaleTuned(layer, cache_codes=cache)
    assert (tuned.codes is not None) == cache
    with torch.no_grad():
        tuned.theta.copy_(torch.randn(tuned.theta.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    theta_ref = tuned.theta.detach().clone().requires_grad_(True)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2))
    x_new, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_new, y_ref = tuned(x_new), _old_scale_forward(layer, theta_ref, x_ref)
    upstream = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3))
    (y_new * upstream).sum().backward()
    (y_ref * upstream).sum().backward()

    def rel(a, b):
        return float((a - b).detach().norm() / b.detach().norm())

    assert rel(y_new, y_ref) < 1e-5
    assert rel(tuned.theta.grad, theta_ref.grad) < 1e-5
    assert rel(x_new.grad, x_ref.grad) < 1e-5


def test_wrap_scales_holds_nothing_per_weight(q3):
    """After wrap_scales no wrapper holds a tensor of one element per weight (the packed qweight aside), the
    model's tensors grow by θ only, and a forward saves no dense weight for the backward. Red for the old
    ScaleTuned, whose int16 codes (2 bytes per weight), float32 s0 and autograd-saved dense weight were all
    resident."""
    from layercut.compress.io.models import load_model
    from layercut.heal.scales import ScaleTuned, wrap_scales

    _, qdir = q3
    model, _ = load_model(qdir, dtype=torch.float32, with_tokenizer=False)

    def tensor_bytes(m):
        seen = {}
        for mod in m.modules():
            for t in [*mod._parameters.values(), *mod._buffers.values(),
                      *(v for v in vars(mod).values() if isinstance(v, torch.Tensor))]:
                if t is not None:
                    seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    before = tensor_bytes(model)
    params = wrap_scales(model, cache_codes=False)
    theta_bytes = sum(p.numel() * 4 for p in params)
    assert tensor_bytes(model) - before == theta_bytes
    tuned = [m for m in model.modules() if isinstance(m, ScaleTuned)]
    assert len(tuned) == len(params)
    smallest = min(m.in_features * m.out_features for m in tuned)
    for m in tuned:
        held = [t for mod in m.modules()
                for t in [*mod._parameters.values(), *mod._buffers.values(),
                          *(v for v in vars(mod).values() if isinstance(v, torch.Tensor))] if t is not None]
        assert all(t.numel() < m.in_features * m.out_features or t is m.layer.qweight for t in held)
        assert m.layer.qweight.numel() * 32 // m.bits == m.layer.qweight.shape[1] * 32 * m.layer.qweight.shape[0] // m.bits

    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    ids = torch.tensor([[1, 2, 3]])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.sum().backward()
    # the embedding / head aside (vocab x hidden: not a quantized layer), nothing as large as a quantized weight
    emb = model.get_input_embeddings().weight.numel()
    assert not [n for n in saved if smallest <= n and n != emb], sorted(saved)[-5:]
    assert all(p.grad is not None for p in params)


def test_streamed_teacher_cache_matches_the_whole_teacher(tiny_model_dir, tiny_tokenizer, monkeypatch):
    """The teacher's top-k cache read one block at a time (in chunks of samples, positions in slices) equals
    the one from the whole loaded teacher. Red on a chunk or slice boundary that drops or shifts tokens."""
    from layercut.compress.io.models import load_model
    from layercut.heal import data as hd
    from layercut.heal.config import HealConfig

    src = tiny_model_dir("llama")
    cfg = HealConfig(steps=3, seq_len=24, batch_size=2, data_offset=0)
    data = hd.heal_data(tiny_tokenizer, cfg)
    teacher, _ = load_model(src, dtype=torch.float32, with_tokenizer=False)
    whole = hd.build_topk_cache(teacher, data, 8, 1.0, batch_size=2, progress=False)
    monkeypatch.setattr(hd, "POSITION_SLICE", 10)  # 24 positions: slices of 10, 10, 4
    monkeypatch.setattr(hd, "CHUNK_BYTES", 1)  # one micro-batch per chunk: the blocks are streamed 3 times
    streamed = hd.build_topk_cache_streamed(src, data, 8, 1.0, batch_size=2, progress=False)
    assert streamed.logp.shape == whole.logp.shape and streamed.vocab == whole.vocab
    assert torch.allclose(streamed.logp, whole.logp, atol=1e-4)
    assert torch.allclose(streamed.tail_logp, whole.tail_logp, atol=1e-4)
    assert (streamed.idx == whole.idx).float().mean() > 0.99


def test_line_progress_when_stderr_is_not_a_terminal(capsys):
    """Off a terminal, progress is plain lines (about every 5%, and the last), not carriage-return redraws."""
    from layercut.heal.progress import progress_bar

    bar = progress_bar(total=40, desc="heal", unit="step")
    for _ in range(40):
        bar.set_postfix(loss="1.0")
        bar.update(1)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert 10 <= len(lines) <= 21 and all(line.startswith("heal: ") for line in lines)
    assert lines[-1].startswith("heal: 40/40 step (100%)") and "loss=1.0" in lines[-1] and "\r" not in "".join(lines)


def test_codes_cached_on_small_models_only(q3, monkeypatch):
    """wrap_scales' auto choice: codes cached (one byte per weight) when they fit CODES_CACHE_BYTES, packed
    otherwise. Red if the threshold is ignored either way."""
    from layercut.compress.io.models import load_model
    from layercut.heal import scales as sc

    _, qdir = q3
    for limit, cached in ((1 << 30, True), (0, False)):
        monkeypatch.setattr(sc, "CODES_CACHE_BYTES", limit)
        model, _ = load_model(qdir, dtype=torch.float32, with_tokenizer=False)
        sc.wrap_scales(model)
        tuned = [m for m in model.modules() if isinstance(m, sc.ScaleTuned)]
        assert tuned and all((m.codes is not None) == cached for m in tuned)
        if cached:
            assert all(m.codes.dtype == torch.int8 for m in tuned)  # 3-bit codes


def test_embedding_and_head_stay_16_bit_with_float32_logits(q3):
    """train_dtype_except_embeddings: the fp16 embedding (tied head) is not upcast, the rest is float32, and
    logits, θ gradients and the loss match an all-float32 student within float32 rounding. Red if the
    embedding is upcast (1 GiB at 1B), if the head computes in 16 bits, or if the undo leaves the wrappers."""
    from layercut.compress.io.models import load_model
    from layercut.heal import scales as sc

    _, qdir = q3
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    grads, logits = [], []
    for slim in (False, True):
        model, _ = load_model(qdir, dtype=torch.float16 if slim else torch.float32, with_tokenizer=False)
        params = sc.wrap_scales(model)
        if slim:
            emb = model.get_input_embeddings()
            undo = sc.train_dtype_except_embeddings(model, torch.float32)
            assert isinstance(model.get_input_embeddings(), sc.Fp32Embedding)
            assert model.get_input_embeddings().inner.weight.dtype == torch.float16
            assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "embed" not in n
                       and "lm_head" not in n)
        out = model(input_ids=ids).logits
        assert out.dtype == torch.float32
        out.float().logsumexp(-1).sum().backward()
        logits.append(out.detach())
        grads.append(torch.cat([p.grad.flatten() for p in params]))
        if slim:
            undo()
            assert model.get_input_embeddings() is emb
    assert torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-3
