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
    assert "not built for scale tuning" in capsys.readouterr().err and not out.exists()


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
