"""``layercut run``: run directory layout, reports, gates, and kill/resume byte identity.

The kill tests run the CLI in a subprocess and SIGKILL it, either at named points
(``LAYERCUT_KILL_AT``, see ``layercut.compress.workflow.pipeline._hook``) or at random times (slow), then
``--resume`` and compare the final checkpoint with an uninterrupted in-process run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layercut.compress.core.errors import GateFailed, LayercutError
from layercut.compress.workflow.pipeline import KILL_ENV, run_recipe
from layercut.compress.workflow.recipe import Recipe

REPO = Path(__file__).resolve().parents[1]
SPEED_ROW = "| tokens/s"


def tiny_recipe(model_dir: Path, **eval_opts) -> Recipe:
    stages: list = [
        {"prune": {"layers": [2, 3], "replace": "lstsq", "samples": 4, "seq_len": 32, "batch_size": 4}},
        {"heal": {"steps": 2, "samples": 4, "seq_len": 32, "batch_size": 2}},
        {"quantize": {"avg_bits": 6.0, "candidates": [4, 8], "group_size": 32, "samples": 4, "seq_len": 32,
                      "sensitivity_samples": 2}},
        "export", {"eval": {"max_tokens": 128, "ctx": 64, **eval_opts}}]
    return Recipe.from_dict({"version": 1, "model": str(model_dir), "seed": 7, "stages": stages})


def final_files(run_dir: Path) -> dict[str, bytes]:
    report = json.loads((run_dir / "report.json").read_text())
    folder = run_dir / report["final_model"]
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    files["README.md"] = files["README.md"].replace(str(folder.resolve()).encode(), b"FOLDER")  # the card loads it
    return files


def assert_identical(a: dict[str, bytes], b: dict[str, bytes]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        if name == "README.md":  # identical except the measured speed row
            la, lb = a[name].decode().splitlines(), b[name].decode().splitlines()
            assert len(la) == len(lb)
            assert [x for x in la if not x.startswith(SPEED_ROW)] == [x for x in lb if not x.startswith(SPEED_ROW)]
        else:
            assert a[name] == b[name], f"{name} differs"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("ref") / "run"
    report = run_recipe(tiny_recipe(model_dir), out, progress=False)
    return model_dir, out, report


def test_run_directory_layout_and_report(reference_run):
    model_dir, out, report = reference_run
    recipe = tiny_recipe(model_dir)
    assert (out / "recipe.yaml").read_text() == recipe.to_yaml()
    assert report["complete"] and json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    names = [f"{i:02d}-{s.stage}" for i, s in enumerate(recipe.stages, 1)]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == names
    for rec, name in zip(report["stages"], names):
        assert rec["dir"] == name and (out / name / "stage.json").is_file() and (out / name / "log.txt").is_file()
        assert rec["wall_s"] > 0 and rec["peak_rss_mb"] > 0
    assert not list(out.glob(".*"))  # no temp folders left
    prune = report["stages"][0]["report"]
    assert prune["removed_blocks"] == [2, 3] and prune["num_layers_after"] == 4
    final = out / report["final_model"]
    assert report["final_model"].endswith("-export/model")
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "recipe.yaml", "report.json",
                 "README.md"):
        assert (final / name).is_file(), name
    inner = json.loads((final / "report.json").read_text())
    assert "wall_s" not in json.dumps(inner) and "tokens_per_s" not in json.dumps(inner)
    # the card's numbers are the eval stage's numbers
    ev = report["stages"][-1]["report"]
    card = (final / "README.md").read_text()
    assert f"| perplexity | {ev['baseline']['ppl']:.3f} | {ev['model']['ppl']:.3f} |" in card
    assert f"| KL to source | 0 | {ev['model']['kl']:.4f} |" in card
    assert "blocks [2, 3] of 6 replaced by a least-squares linear map" in card
    assert [r["stage"] for r in report["stages"]] == ["prune", "heal", "quantize", "export", "eval"]
    assert report["stages"][2]["report"]["bits_per_layer"] and report["stages"][1]["report"]["steps"] == 2

    # the final (GPTQ) checkpoint loads with 4 decoder layers and computes finite logits
    import torch

    from layercut.compress.io.models import load_model
    from layercut.compress.quant.format.qlinear import QuantLinear

    model, tokenizer = load_model(final)
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * 7
    logits = model(**tokenizer("The jury said", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


def _cli(args: list[str], kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop(KILL_ENV, None)
    if kill_at:
        env[KILL_ENV] = kill_at
    return subprocess.run([sys.executable, "-m", "layercut.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_sigkill_at_each_point_then_resume_is_byte_identical(reference_run, tmp_path):
    model_dir, ref_out, _ = reference_run
    recipe = tiny_recipe(model_dir)
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe.to_yaml())
    out = tmp_path / "run"
    n = len(recipe.stages)
    export_index = next(i for i, s in enumerate(recipe.stages, 1) if s.stage == "export")

    res = _cli(["run", str(path), "-o", str(out)], kill_at="stage-1-written")
    assert res.returncode == -signal.SIGKILL
    assert not (out / "01-prune").exists() and list(out.glob(".01-prune.tmp-*")), "temp folder, never renamed"

    res = _cli(["run", str(path), "-o", str(out)])  # no --resume: refused, nothing touched
    assert res.returncode == 2 and "already exists (pass --resume" in res.stderr

    res = _cli(["run", str(path), "-o", str(out), "--resume"], kill_at=f"stage-{export_index}-renamed")
    assert res.returncode == -signal.SIGKILL
    assert not list(out.glob(".01-prune.tmp-*")) and (out / f"{export_index:02d}-export" / "stage.json").is_file()

    res = _cli(["run", str(path), "-o", str(out), "--resume"], kill_at="finalize")
    assert res.returncode == -signal.SIGKILL
    assert not json.loads((out / "report.json").read_text())["complete"]

    res = _cli(["run", str(path), "-o", str(out), "--resume", "--json"])
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["complete"] and len(report["stages"]) == n
    assert_identical(final_files(out), final_files(ref_out))


def test_resume_of_a_complete_run_changes_nothing(reference_run, tmp_path):
    model_dir, ref_out, _ = reference_run
    before = final_files(ref_out)
    run_recipe(tiny_recipe(model_dir), ref_out, resume=True, progress=False)
    assert_identical(final_files(ref_out), before)


def test_existing_output_and_changed_recipe(reference_run):
    model_dir, ref_out, _ = reference_run
    with pytest.raises(LayercutError, match="already exists"):
        run_recipe(tiny_recipe(model_dir), ref_out)
    changed = tiny_recipe(model_dir, ctx=32)
    with pytest.raises(LayercutError, match=r"stage \d \(eval\) already ran with other settings "
                                            r"\(stages\[\d\]\.eval\.ctx: 64 -> 32\)"):
        run_recipe(changed, ref_out, resume=True)
    reseeded = Recipe.from_dict({**tiny_recipe(model_dir).to_dict(), "seed": 8})
    with pytest.raises(LayercutError, match="seed: 7 -> 8"):
        run_recipe(reseeded, ref_out, resume=True)


def test_fix_a_failing_stage_and_resume(tiny_model_dir, tmp_path):
    """A stage that fails leaves the finished ones; fixing a later stage and resuming reuses them."""
    model = str(tiny_model_dir("llama"))
    prune = {"prune": {"layers": [4], "samples": 2, "seq_len": 16}}
    broken = Recipe.from_dict({"version": 1, "model": model, "stages": [
        prune, {"eval": {"text": str(tmp_path / "missing.txt"), "max_tokens": 64, "ctx": 32}}]})
    out = tmp_path / "run"
    with pytest.raises(LayercutError, match="missing.txt"):
        run_recipe(broken, out, progress=False)
    stage_json = out / "01-prune" / "stage.json"
    first = stage_json.stat().st_mtime_ns
    assert not (out / "02-eval").exists() and not list(out.glob(".*tmp*"))
    fixed = Recipe.from_dict({"version": 1, "model": model, "stages": [prune, {"eval": {"max_tokens": 64, "ctx": 32}}]})
    report = run_recipe(fixed, out, resume=True, progress=False)
    assert report["complete"] and stage_json.stat().st_mtime_ns == first
    assert (out / "recipe.yaml").read_text() == fixed.to_yaml()


def test_failed_gate_writes_everything_and_raises(tiny_model_dir, tmp_path):
    recipe = Recipe.from_dict({"version": 1, "model": str(tiny_model_dir("llama")), "stages": [
        {"prune": {"layers": [4], "samples": 2, "seq_len": 16}},
        {"eval": {"max_tokens": 64, "ctx": 32, "max_kl": 0.0, "max_ppl_increase": "1000%"}}]})
    with pytest.raises(GateFailed, match="max_kl") as info:
        run_recipe(recipe, tmp_path / "gated", progress=False)
    assert info.value.exit_code == 3
    report = json.loads((tmp_path / "gated" / "report.json").read_text())
    ev = report["stages"][-1]["report"]
    assert ev["failed_gates"] == ["max_kl"] and report["complete"]
    assert [g["passed"] for g in ev["gates"]] == [True, False]


@pytest.mark.slow
def test_sigkill_at_random_times_then_resume(reference_run, tmp_path):
    """Kill the run at random moments (not only at hooks), resume, compare: three times."""
    model_dir, ref_out, ref_report = reference_run
    path = tmp_path / "recipe.yaml"
    path.write_text(tiny_recipe(model_dir).to_yaml())
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "layercut.cli", "run", str(path), "-o", str(out), "--json"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(4.0, 4.0 + ref_report["total_wall_s"] * 1.5))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        res = _cli(["run", str(path), "-o", str(out), "--resume", "--json"])
        assert res.returncode == 0, res.stderr
        assert_identical(final_files(out), final_files(ref_out))


def test_card_front_matter_and_tables(tmp_path):
    """Provenance is copied where known; bits per layer and numbers come from the reports."""
    import yaml

    from layercut.export.card import card_facts, render_card

    source = tmp_path / "src"
    source.mkdir()
    (source / "layercut_source.json").write_text(json.dumps({"source": "Org/Base-1B", "license": "apache-2.0"}))
    ev = {"model": {"ppl": 12.5, "kl": 0.0421, "params": 9e8, "bytes": 5 * 2**20, "tokens_per_s": 50.0,
                    "text": "bundled:brown-heldout", "tokens": 4096, "ctx": 512},
          "baseline": {"ppl": 10.0, "params": 1.2e9, "bytes": 20 * 2**20, "tokens_per_s": 40.0},
          "gates": [{"name": "max_kl", "limit": 0.1, "value": 0.0421, "passed": True}]}
    report = {"model": "org/base", "stages": [
        {"stage": "prune", "dir": "01-prune", "report": {"description": "blocks [3, 4] of 8 dropped"}},
        {"stage": "quantize", "dir": "02-quantize", "report": {"avg_bits": 3.5, "bits_per_layer": {"0": 4, "1": 3}}},
        {"stage": "export", "dir": "03-export", "report": {"quantized": True}},
        {"stage": "eval", "dir": "04-eval", "report": ev}]}
    text = render_card(card_facts(report, source), ["prune_scores.png"])
    meta = yaml.safe_load(text.split("---")[1])
    assert meta.pop("model-index")[0]["results"][0]["metrics"][0] == {
        "type": "perplexity", "value": 12.5, "name": "perplexity", "args": {"context": 512, "scored_tokens": 4096}}
    assert meta == {"base_model": "Org/Base-1B", "base_model_relation": "quantized", "library_name": "transformers",
                    "pipeline_tag": "text-generation", "license": "apache-2.0",
                    "tags": ["layercut", "compressed", "pruned", "depth-pruning", "gptq", "mixed-precision"]}
    assert "| perplexity | 10.000 | 12.500 |" in text and "| KL to source | 0 | 0.0421 |" in text
    assert "| weights on disk | 20.0 MiB | 5.0 MiB |" in text and "| parameters | 1200.0 M | 900.0 M |" in text
    assert "| tokens/s (this run's machine) | 40 | 50 |" in text
    assert "| 0 | 4 |" in text and "| 1 | 3 |" in text and "blocks [3, 4] of 8 dropped" in text
    assert "![prune_scores](prune_scores.png)" in text
    # unknown provenance: no base_model / license invented
    bare = yaml.safe_load(render_card(card_facts({"stages": []}, tmp_path)).split("---")[1])
    assert "base_model" not in bare and "license" not in bare
    # consecutive layers with equal bits share a row; a gap or a change starts a new one
    runs = render_card(card_facts({"stages": [{"stage": "quantize", "dir": "q", "report": {"bits_per_layer": {
        "model.layers.0": 4, "model.layers.1": 4, "model.layers.2": 4, "model.layers.3": 8, "model.layers.5": 8,
        "lm_head": 8}}}]}, tmp_path))
    assert "| model.layers.0–2 | 4 |" in runs and "| model.layers.3 | 8 |" in runs
    assert "| model.layers.5 | 8 |" in runs and "| lm_head | 8 |" in runs


def test_peak_rss_is_per_block():
    import mmap

    import psutil

    from layercut.compress.core.resources import PeakRSS

    def touched(mb: int) -> mmap.mmap:
        """Fresh anonymous pages, every one written: resident whatever the heap already holds
        (a numpy array could reuse free heap pages and leave RSS flat in a long test process)."""
        buf = mmap.mmap(-1, mb * 2**20)
        for offset in range(0, mb * 2**20, mmap.PAGESIZE):
            buf[offset] = 1
        return buf

    before_mb = psutil.Process().memory_info().rss / 2**20
    big = touched(320)  # touched, then freed before the block
    big.close()
    with PeakRSS() as quiet:
        pass
    with PeakRSS() as busy:
        data = touched(200)
        time.sleep(0.3)  # held long enough for the sampling fallback to see it
        data.close()
    assert busy.peak_mb - quiet.peak_mb > 150
    if quiet.method == "vmhwm":  # the 320 MB before the block do not count
        assert quiet.peak_mb < before_mb + 150
