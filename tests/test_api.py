"""The ``layercut`` Python API and the CLI's manners.

- in memory and on disk, a stage computes the same model (one shared core);
- every module is importable under one name only (the torch.library op registers once);
- the README's "Python API" block runs as written (slow: the bundled model);
- ``--version``, ``-q``/``-v``, ``--help`` without torch, no root log handlers from the library.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layercut
from layercut.compress.core.errors import LayercutError

REPO = Path(__file__).resolve().parents[1]


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_prune_in_memory_equals_prune_on_disk(tiny_model_dir, tmp_path):
    """layercut.prune (memory) and the prune stage's run (disk) give the same weights: one core."""
    from layercut.compress.depth.config import PruneConfig
    from layercut.compress.workflow.stages.prune import run

    src = tiny_model_dir("llama")
    config = PruneConfig(drop=2, select="block-influence", replace="lstsq", samples=4, seq_len=32, batch_size=2)
    model, tokenizer = layercut.load(src)
    root_handlers = list(logging.getLogger().handlers)
    pruned = layercut.prune(model, tokenizer, config=config)
    assert pruned.config.num_hidden_layers == 4
    report = run(config, src, tmp_path / "disk")
    on_disk, _ = layercut.load(tmp_path / "disk")
    assert report["num_layers_after"] == 4 and report["select"] == "block-influence"
    mem, disk = _state(pruned), _state(on_disk)
    assert sorted(mem) == sorted(disk)
    for name in mem:
        assert torch.equal(mem[name], disk[name]), name
    assert logging.getLogger().handlers == root_handlers  # the library installs no root handler


def test_score_in_memory_equals_score_on_disk(tiny_model_dir):
    from layercut.compress.select.config import ScoreConfig
    from layercut.compress.workflow.stages.score import run

    src = tiny_model_dir("llama")
    config = ScoreConfig(method="block-influence,angular,gate-norm", drop=2, samples=4, seq_len=32, batch_size=2)
    model, tokenizer = layercut.load(src)
    memory = layercut.score(model, tokenizer, config=config)
    disk = run(config, src)
    assert memory["selection"] == disk["selection"] and set(memory["selection"]) == {
        "block-influence", "angular", "gate-norm"}
    assert memory["scores"]["block_influence"] == disk["scores"]["block_influence"]
    assert memory["scores"]["gate_norm"] == pytest.approx(disk["scores"]["gate_norm"], rel=1e-5)  # files vs memory


def test_quantize_in_memory_equals_the_checkpoint(tiny_model_dir, tmp_path):
    """layercut.quantize leaves each linear holding exactly what the stage's checkpoint decodes to."""
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.format.qlinear import QuantLinear
    from layercut.compress.workflow.stages.base import RunEnv
    from layercut.compress.workflow.stages.quantize import run

    src = tiny_model_dir("llama")
    config = QuantizeConfig(avg_bits=6.0, candidates=[4, 8], group_size=32, samples=4, seq_len=32, batch_size=2,
                            sensitivity_samples=2)
    model, tokenizer = layercut.load(src)
    layercut.quantize(model, tokenizer, config=config)
    report = run(config, src, tmp_path / "q", RunEnv(progress=False))
    assert sorted(set(report["unit_bits"].values())) == [4, 8]  # a mixed allocation, as stored
    packed, _ = layercut.load(tmp_path / "q")
    checked = 0
    for name, module in packed.named_modules():
        if isinstance(module, QuantLinear):
            assert torch.equal(module.dequantize(), model.get_submodule(name).weight), name
            checked += 1
    assert checked == 6 * 7


def test_api_heal_merges_into_dense_weights(tiny_model_dir):
    teacher, tokenizer = layercut.load(tiny_model_dir("llama"))
    student, _ = layercut.load(tiny_model_dir("llama"))
    layercut.prune(student, tokenizer, layers=[2])
    before = _state(student)
    healed = layercut.heal(student, tokenizer, teacher, steps=2, seq_len=16, batch_size=2, rank=4, data_offset=0,
                           gradient_checkpointing=False)
    after = _state(healed)
    assert sorted(after) == sorted(before)  # merged: no LoRA tensors left
    assert any(not torch.equal(before[k], after[k]) for k in before if k.endswith("proj.weight"))
    with pytest.raises(LayercutError, match="needs a teacher"):
        layercut.heal(student, tokenizer, None, steps=1, seq_len=16, batch_size=2)


def test_api_evaluate_export_and_options(tiny_model_dir, tmp_path):
    model, tokenizer = layercut.load(tiny_model_dir("llama"))
    base = layercut.evaluate(model, tokenizer, max_tokens=96, ctx=32)
    layercut.prune(model, tokenizer, layers=[4])
    after = layercut.evaluate(model, tokenizer, max_tokens=96, ctx=32)
    assert base["tokens"] == after["tokens"] == 96 and base["ppl"] != after["ppl"]
    out = layercut.export(model, tokenizer, tmp_path / "five", save_dtype="bf16")
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is not cast
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 5
    assert (out / "model.safetensors.index.json").is_file()
    again, _ = layercut.load(out, dtype="auto")  # auto: the checkpoint's own dtype
    assert next(again.parameters()).dtype == torch.bfloat16
    # the same evaluation through a config object; an option overrides a config's field
    cfg = layercut.EvalConfig(max_tokens=96, ctx=32, reference=None)
    assert layercut.evaluate(model, tokenizer, config=cfg)["ppl"] == after["ppl"]
    assert layercut.evaluate(model, tokenizer, config=cfg, max_tokens=64)["tokens"] == 64
    with pytest.raises(LayercutError, match="unknown key 'replce', did you mean 'replace'"):
        layercut.prune(model, tokenizer, layers=[1], replce="lstsq")
    with pytest.raises(LayercutError, match=r"max_tokens: Input should be a valid integer \(got '64'\)"):
        layercut.evaluate(model, tokenizer, max_tokens="64")


def test_dtype_reaches_the_loader(tiny_model_dir):
    """--dtype is the load/compute dtype of every stage: bf16 evaluates close to, not equal to, fp32."""
    from layercut.compress.eval.config import EvalConfig
    from layercut.compress.workflow.stages.eval import run

    src = tiny_model_dir("llama")
    assert next(layercut.load(src, dtype="bf16")[0].parameters()).dtype == torch.bfloat16
    fp32, bf16 = (run(EvalConfig(max_tokens=96, ctx=32, reference=None, dtype=d), src)["model"]["ppl"]
                  for d in ("fp32", "bf16"))
    assert fp32 != bf16 and abs(bf16 / fp32 - 1) < 0.05


def test_api_run_recipe(tiny_model_dir, tmp_path):
    recipe = layercut.Recipe(model=str(tiny_model_dir("llama")), stages=[
        layercut.PruneConfig(layers=[4]), layercut.EvalConfig(max_tokens=64, ctx=32)])
    report = layercut.run(recipe, tmp_path / "run", progress=False)
    assert report["complete"] and report["stages"][-1]["report"]["model"]["kl"] > 0
    path = tmp_path / "r.yaml"
    path.write_text(recipe.to_yaml())
    assert layercut.run(path, tmp_path / "run", resume=True, progress=False)["complete"]


def test_every_module_has_one_name_and_the_op_registers_once():
    """Every module of the checkout loads once, under ``layercut.``: a module imported twice would
    run its ``torch.library.custom_op`` twice. A bare ``import compress`` from the checkout (whose
    folders sit on sys.path) refuses with one line instead of loading a second copy."""
    import layercut.compress.kernels.ops as ops

    code = ("import sys, layercut, layercut.compress.kernels.ops, layercut.compress.quant.format.qlinear\n"
            "import layercut.heal.train, layercut.export.export, layercut.compress.workflow.cli, layercut.compress.workflow.pipeline\n"
            "files = {}\n"
            "for name, m in list(sys.modules.items()):\n"
            "    f = getattr(m, '__file__', None)\n"
            "    if f and f.startswith(sys.argv[1]) and 'site-packages' not in f:\n"
            "        files.setdefault(f, []).append(name)\n"
            "print(sorted(v for v in files.values() if len(v) > 1))\n"
            "print(sorted(n for v in files.values() for n in v if n.split('.')[0] != 'layercut'))\n"
            "print(len(files) > 30)\n")
    res = subprocess.run([sys.executable, "-c", code, str(REPO) + os.sep], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["[]", "[]", "True"]
    # the op the package uses is the one registered under layercut::gptq_matmul
    assert sum(m is ops for m in sys.modules.values()) == 1
    assert torch.ops.layercut.gptq_matmul.default is ops.gptq_matmul._opoverload    # (a second import under another name would re-run custom_op and replace this registration)
    for bare in ("compress", "calibrate", "heal", "export"):
        res = subprocess.run([sys.executable, "-c", f"import {bare}"], capture_output=True, text=True, cwd=REPO,
                             timeout=120)
        assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == (
            f"ImportError: import layercut.{bare}, not {bare}: layercut installs one top-level package "
            "(pip install -e . from the checkout)")


def test_the_config_names_come_from_the_stage_table():
    """``layercut.<Name>Config`` is the stage table's class (one table: stages.CONFIGS), and every
    stage's config is exported."""
    from layercut.compress.workflow.stages import CONFIGS, STAGES

    assert STAGES == ("score", "prune", "heal", "quantize", "export", "eval")
    for cls in CONFIGS.values():
        assert cls.__name__ in layercut.__all__ and getattr(layercut, cls.__name__) is cls


def test_heal_and_export_are_the_api_functions_and_the_subpackages():
    """``layercut.export``/``layercut.heal`` stay callable after their subpackages are imported."""
    import layercut.export.card  # noqa: F401 (binds layercut.export to the subpackage)
    import layercut.heal.train  # noqa: F401

    assert callable(layercut.export) and callable(layercut.heal)
    assert layercut.export.card.__name__ == "layercut.export.card"
    with pytest.raises(layercut.LayercutError, match="max_shard"):
        layercut.export(None, None, "unused", max_shard="1GB")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layercut.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=300)


def test_version_and_help_do_not_load_torch():
    res = _cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"layercut {layercut.__version__}"
    code = ("import sys\nfrom layercut.compress.workflow.cli import main\n"
            "for argv in (['--help'], ['quantize', '--help'], ['eval', '--help'], ['run', '--help']):\n"
            "    assert main(argv) == 0\n"
            "import layercut\n"
            "print('torch' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "False"  # what keeps `--help` under half a second
    assert "examples:\n  layercut eval" in res.stdout and "(default: 16384)" in " ".join(res.stdout.split())


def test_quiet_and_verbose(tiny_model_dir, capsys):
    from layercut.compress.workflow.cli import main

    model = str(tiny_model_dir("llama"))
    root = list(logging.getLogger().handlers)
    level = logging.getLogger().level
    assert main(["-v", "eval", model, "--max-tokens", "64", "--ctx", "32", "--json"]) == 0
    assert logging.getLogger().level == level
    assert main(["-q", "eval", model, "--max-tokens", "64", "--ctx", "32"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^ppl\s+\d", out, re.M) and "eval:" not in err  # -q: no progress bar
    assert logging.getLogger().handlers == root  # the CLI's handler is gone after main()


README_SECTION = "## Python API"


def readme_python_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert README_SECTION in text, f"README.md has no '{README_SECTION}' section"
    section = text.split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, f"README.md's '{README_SECTION}' section has no ```python block"
    return found.group(1)


@pytest.mark.slow
def test_readme_python_block_runs(tmp_path, monkeypatch, capsys):
    """The README's Python example, exactly as written, on the bundled model."""
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_python_block(), "README.md:Python API", "exec"), {"__name__": "__readme__"})
    assert "perplexity" in capsys.readouterr().out
