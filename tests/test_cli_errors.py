"""Bad input across the CLI: one clear ``error:`` line, a non-zero exit, no partial output.

Each case runs ``layercut.compress.workflow.cli.main`` in-process (fast) and checks: exit code, exactly one
non-empty stderr line starting with ``error:`` and containing the expected words, empty
stdout, and that the file tree under the test's folder is unchanged apart from what the
case explicitly allows (nothing, for all of them).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from layercut.compress.workflow.cli import main
from layercut.compress.workflow.pipeline import KILL_ENV

REPO = Path(__file__).resolve().parents[1]
GOOD_STAGES = """  - prune: {layers: [2], samples: 2, seq_len: 16}
  - export: {}
  - eval: {max_tokens: 64, ctx: 32}
"""


def recipe_text(model: str, stages: str = GOOD_STAGES, head: str = "version: 1\n") -> str:
    return f"{head}model: {model}\nstages:\n{stages}"


def tree(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


@pytest.fixture()
def ws(tmp_path, tiny_model_dir):
    """A workspace: the tiny model, a valid recipe, an existing run dir, an exported dense checkpoint."""
    model = tiny_model_dir("llama")
    (tmp_path / "ok.yaml").write_text(recipe_text(str(model)))
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "keep.txt").write_text("user data")
    (tmp_path / "a-file").write_text("not a folder")
    export = tmp_path / "exported"
    shutil.copytree(model, export)
    (tmp_path / "notckpt").mkdir()
    (tmp_path / "notckpt" / "x.txt").write_text("x")
    (tmp_path / "noweights").mkdir()
    shutil.copy(model / "config.json", tmp_path / "noweights" / "config.json")
    return tmp_path, model


def write(ws_dir: Path, name: str, text: str) -> str:
    (ws_dir / name).write_text(text)
    return str(ws_dir / name)


def _recipe_case(stages: str, head: str = "version: 1\n"):
    return lambda d, m: ["run", write(d, "r.yaml", recipe_text(str(m), stages, head)), "-o", str(d / "out")]


# (id, argv builder (workspace dir, model dir) -> argv, words the error line must contain)
CASES = [
    ("unknown-stage-key", _recipe_case("  - prune: {layers: [2], replce: lstsq}\n"),
     ["stages[0].prune: unknown key 'replce', did you mean 'replace'?", "allowed:"]),
    ("unknown-top-key", lambda d, m: ["run", write(d, "r.yaml", "version: 1\nmodle: x\nmodel: y\nstages: [export]\n"),
                                      "-o", str(d / "out")], ["unknown key 'modle'", "allowed: version, model"]),
    ("wrong-type", _recipe_case("  - eval: {max_tokens: lots}\n"),
     ["stages[0].eval.max_tokens", "valid integer", "'lots'"]),
    ("quantize-before-prune", _recipe_case("  - quantize: {bits: 4}\n  - prune: {layers: [2]}\n"),
     ["stage order", "'prune' (stages[1]) after 'quantize'"]),
    ("unknown-stage", _recipe_case("  - squeeze: {}\n"), ["unknown stage 'squeeze'"]),
    ("missing-version", _recipe_case(GOOD_STAGES, head=""), ["missing required key 'version'"]),
    ("future-version", _recipe_case(GOOD_STAGES, head="version: 2\n"), ["version 2 is not supported"]),
    ("invalid-yaml", lambda d, m: ["run", write(d, "r.yaml", "version: 1\nstages: [prune\n"), "-o", str(d / "out")],
     ["invalid YAML at line"]),
    ("recipe-missing", lambda d, m: ["run", str(d / "nope.yaml"), "-o", str(d / "out")], ["recipe not found"]),
    ("recipe-empty", lambda d, m: ["run", write(d, "r.yaml", ""), "-o", str(d / "out")], ["empty recipe"]),
    ("recipe-is-list", lambda d, m: ["run", write(d, "r.yaml", "- export\n"), "-o", str(d / "out")],
     ["a recipe is a mapping"]),
    ("stage-after-export", _recipe_case("  - export: {}\n  - prune: {layers: [2]}\n"), ["only eval may follow export"]),
    ("heal-first", _recipe_case("  - heal: {}\n"), ["nothing to heal"]),
    ("gate-without-reference", _recipe_case("  - eval: {reference: null, max_kl: 0.1}\n"),
     ["compare with a reference model"]),
    ("drop-over-100", _recipe_case("  - prune: {drop: 125%, select: angular}\n"), ["drop must be a count"]),
    ("prune-no-selection", _recipe_case("  - prune: {drop: 2}\n"), ["give exactly one of select METHOD or layers"]),
    ("output-exists", lambda d, m: ["run", str(d / "ok.yaml"), "-o", str(d / "existing")],
     ["already exists (pass --resume"]),
    ("output-parent-is-file", lambda d, m: ["run", str(d / "ok.yaml"), "-o", str(d / "a-file" / "out")],
     ["is not a directory"]),
    ("resume-not-a-run", lambda d, m: ["run", str(d / "ok.yaml"), "-o", str(d / "existing"), "--resume"],
     ["not a layercut run directory"]),
    ("model-not-found", lambda d, m: ["run", write(d, "r.yaml", recipe_text(str(d / "missing-model"))), "-o",
                                      str(d / "out")], ["model not found"]),
    ("eval-bad-percent", lambda d, m: ["eval", str(m), "--reference", str(m), "--max-ppl-increase", "5x"],
     ["expected a number or a percentage"]),
    ("eval-gate-no-reference", lambda d, m: ["eval", str(m), "--max-kl", "0.1"],
     ["--max-kl compare with a reference model", "give reference"]),
    ("eval-negative-kl", lambda d, m: ["eval", str(m), "--reference", str(m), "--max-kl", "-1"],
     ["--max-kl must be >= 0 (got -1.0)"]),
    ("eval-model-missing", lambda d, m: ["eval", str(d / "missing-model")], ["model not found"]),
    ("export-input-missing", lambda d, m: ["export", str(d / "missing-model"), "-o", str(d / "out")],
     ["model not found"]),
    ("export-output-exists", lambda d, m: ["export", str(m), "-o", str(d / "existing")], ["already exists"]),
    ("export-dequantize-dense", lambda d, m: ["export", str(m), "-o", str(d / "out"), "--dequantize"],
     ["is not quantized"]),
    ("export-bad-shard-size", lambda d, m: ["export", str(m), "-o", str(d / "out"), "--max-shard-size", "lots"],
     ["--max-shard-size: size 'lots'"]),
    ("export-bad-dtype", lambda d, m: ["export", str(m), "-o", str(d / "out"), "--save-dtype", "int7"],
     ["export: argument --save-dtype: invalid choice: 'int7'", "'bf16', 'fp16', 'fp32'"]),
    ("unknown-flag", lambda d, m: ["quantize", str(m), "-o", str(d / "out"), "--bits", "4", "--group-szie", "64"],
     ["quantize: unknown option --group-szie, did you mean --group-size?"]),
    ("unknown-flag-no-guess", lambda d, m: ["eval", str(m), "--xyzzy"], ["eval: unknown option --xyzzy"]),
    ("unknown-command", lambda d, m: ["qunatize", str(m)], ["invalid choice: 'qunatize'", "did you mean 'quantize'?"]),
    ("flag-wrong-type", lambda d, m: ["eval", str(m), "--max-tokens", "lots"],
     ["argument --max-tokens: expected int, got 'lots'"]),
    ("flag-bad-choice", lambda d, m: ["quantize", str(m), "-o", str(d / "out"), "--bits", "4", "--unit", "layr"],
     ["argument --unit: invalid choice: 'layr'", "did you mean 'layer'?"]),
    ("flag-out-of-bounds", lambda d, m: ["prune", str(m), "-o", str(d / "out"), "--layers", "2", "--samples", "0"],
     ["--samples must be >= 1 (got 0)"]),
    ("flag-rule", lambda d, m: ["quantize", str(m), "-o", str(d / "out"), "--bits", "4", "--avg-bits", "3"],
     ["give exactly one of bits (uniform) or --avg-bits"]),
    ("missing-output", lambda d, m: ["quantize", str(m), "--bits", "4"], ["required: -o/--output"]),
    ("push-invalid-repo-id", lambda d, m: ["push", str(d / "exported"), "--repo-id", "not a repo"],
     ["invalid repo id 'not a repo'"]),
    ("push-folder-missing", lambda d, m: ["push", str(d / "nothing"), "--repo-id", "org/x", "--dry-run"],
     ["is not a directory"]),
    ("push-not-a-checkpoint", lambda d, m: ["push", str(d / "notckpt"), "--repo-id", "org/x", "--dry-run"],
     ["not a model checkpoint (no config.json)"]),
    ("push-no-weights", lambda d, m: ["push", str(d / "noweights"), "--repo-id", "org/x", "--dry-run"],
     ["has no .safetensors weights"]),
    ("push-bad-revision", lambda d, m: ["push", str(d / "exported"), "--repo-id", "org/x", "--revision", "a..b"],
     ["invalid revision 'a..b'"]),
    ("push-offline", lambda d, m: ["push", str(d / "exported"), "--repo-id", "org/x"], ["HF_HUB_OFFLINE is set"]),
    ("push-missing-token", lambda d, m: ["push", str(d / "exported"), "--repo-id", "org/x"],
     ["no Hugging Face token found"]),
]


def check_one_error(capsys, argv: list[str], words: list[str], code: int = 2) -> None:
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == code, (rc, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert out == ""


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, ws, capsys, monkeypatch, tmp_path_factory):
    name, build, words = case
    d, model = ws
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if name == "push-missing-token" else "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path_factory.mktemp("hf") / "token"))
    argv = build(d, model)
    before = tree(d)
    check_one_error(capsys, argv, words)
    assert tree(d) == before  # no partial output anywhere


@pytest.mark.parametrize("argv", [
    ["quantize", "{m}", "-o", "{d}/out", "--bits", "4", "--device", "cuda"],
    ["score", "{m}", "--method", "angular", "--device", "cuda:0"],
    ["prune", "{m}", "-o", "{d}/out", "--drop", "1", "--select", "angular", "--device", "cuda"],
    ["eval", "{m}", "--device", "cuda"],
    ["run", "{d}/dev.yaml", "-o", "{d}/out"],
], ids=["quantize", "score", "prune", "eval", "recipe"])
def test_cuda_device_without_cuda_is_one_line(argv, ws, capsys, monkeypatch):
    """``--device cuda`` on a machine without CUDA: one line before any work, nothing written."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    d, model = ws
    write(d, "dev.yaml", recipe_text(str(model), "  - prune: {layers: [2], samples: 2, seq_len: 16, device: cuda}\n"))
    before = tree(d)
    check_one_error(capsys, [a.format(m=model, d=d) for a in argv], ["--device cuda", "no CUDA device on this machine"])
    assert tree(d) == before


def test_device_value_is_checked(ws, capsys):
    d, model = ws
    check_one_error(capsys, ["eval", str(model), "--device", "gpu"], ["--device", "should match pattern"])


def test_at_least_25_distinct_bad_inputs():
    assert len({c[0] for c in CASES}) == len(CASES) >= 25


def _read_only_dir(path: Path):
    """Make ``path`` unwritable even for root (chattr +i), else by mode; None if impossible."""
    path.mkdir()
    if os.geteuid() == 0:
        if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
            return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
        return None
    path.chmod(0o555)
    return lambda: path.chmod(0o755)


@pytest.mark.parametrize("command", ["run", "export"])
def test_read_only_output_location(command, ws, capsys):
    d, model = ws
    ro = d / "ro"
    undo = _read_only_dir(ro)
    if undo is None:
        pytest.skip("cannot make a read-only folder here (root without chattr)")
    try:
        argv = ["run", str(d / "ok.yaml"), "-o", str(ro / "out")] if command == "run" else \
            ["export", str(model), "-o", str(ro / "out")]
        check_one_error(capsys, argv, ["output location", "is not writable"])
        assert list(ro.iterdir()) == []
    finally:
        undo()


def test_interrupted_write_leaves_no_partial_stage(ws, tmp_path):
    """Ctrl-C while a stage's files are being written: one error line, exit 130, no stage folder."""
    d, _ = ws
    out = d / "interrupted"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", KILL_ENV: "stage-1-written:INT"}
    # SIGINT back to its default in the child: a shell's background job inherits it ignored
    res = subprocess.run([sys.executable, "-m", "layercut.cli", "run", str(d / "ok.yaml"), "-o", str(out), "--json"],
                         capture_output=True, text=True, env=env, timeout=600,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert res.returncode == 130
    errors = [x for x in res.stderr.splitlines() if x.startswith("error")]
    assert errors == ["error: interrupted"], res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["recipe.yaml", "run.log"]  # no stage, no temp folder
    assert res.stdout == ""


@pytest.mark.parametrize("size", ["1TB", "2TiB"])
def test_export_max_shard_size_in_tb_writes(size, tmp_path, tiny_model_dir):
    """``--max-shard-size 1TB`` passed validation, then the shard writer's own parser raised a bare
    ValueError; now validation and writing share one parser."""
    out = tmp_path / "big"
    assert main(["-q", "export", str(tiny_model_dir("llama")), "-o", str(out), "--max-shard-size", size]) == 0
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))


def test_export_bad_max_shard_size_is_one_line(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "bad"
    assert main(["-q", "export", str(tiny_model_dir("llama")), "-o", str(out), "--max-shard-size", "40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not like 500MB" in err[0] and not out.exists()
