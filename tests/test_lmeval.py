"""``layercut eval --tasks``: lm-eval task evals on models held in memory, and the shipped task.

Fast tests run the shipped ``brown_cloze`` task with a small ``limit`` on tiny random
models built from config (dense, depth-pruned in a recipe, GPTQ-packed); the slow one
checks the real signal on the bundled SmolLM2. lm-eval comes from the ``eval`` extra:
without it these tests skip locally and fail under CI (see ``tests.conftest.import_extra``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layercut.compress.eval.config import EvalConfig
from layercut.compress.eval.lmeval import INSTALL_HINT, TASK_DIR
from layercut.compress.workflow.cli import main
from layercut.compress.workflow.stages.eval import run
from tests.conftest import import_extra

REPO = Path(__file__).resolve().parents[1]
DATA = TASK_DIR / "brown_cloze" / "brown_cloze.jsonl"
FIGURES = {"metrics", "num_fewshot", "limit", "samples", "dataset", "task_version"}
FAST = dict(max_tokens=64, ctx=32, reference=None)


@pytest.fixture(scope="module")
def lm_eval():
    return import_extra("lm_eval")


def rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]


def test_shipped_task_data_is_well_formed_and_rebuilt_exactly():
    """The jsonl is what scripts/make_brown_task.py makes, and every item's label points at its answer."""
    items = rows()
    assert 300 <= len(items) <= 500
    for item in items:
        assert len(item["choices"]) == 4 == len(set(item["choices"]))
        assert item["choices"][item["label"]] == item["answer"]
        assert len(item["context"].split()) >= 20 and not item["context"].endswith(" ")
    assert len({item["id"] for item in items}) == len(items)
    assert 0.15 < sum(item["label"] == 0 for item in items) / len(items) < 0.35  # answer position drawn
    spec = importlib.util.spec_from_file_location("make_brown_task", REPO / "scripts" / "make_brown_task.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0


def own_accuracy(model, tokenizer, items: list[dict]) -> tuple[float, float]:
    """acc and acc_norm computed here, as lm-eval defines them: the choice with the largest summed
    log-probability of `' ' + choice` after the context (acc_norm: divided by the choice's length)."""
    hits = norm_hits = 0
    for item in items:
        ctx = tokenizer(item["context"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in item["choices"]:
            ids = tokenizer(item["context"] + " " + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].double(), -1)
            cont = range(len(ctx), len(ids))
            scores.append(sum(float(logp[i - 1, ids[i]]) for i in cont))
        hits += max(range(4), key=lambda k: scores[k]) == item["label"]
        norm_hits += max(range(4), key=lambda k: scores[k] / len(item["choices"][k])) == item["label"]
    return hits / len(items), norm_hits / len(items)


def test_tasks_report_shape_and_values_match_a_direct_computation(lm_eval, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    out = tmp_path / "eval.json"
    report = run(EvalConfig(**FAST, tasks="brown_cloze", limit=12), model_dir, out)
    assert report["model"]["ppl"] > 1  # the perplexity pass still runs
    task = report["tasks"]["brown_cloze"]
    assert set(task) == FIGURES and list(report["tasks"]) == ["brown_cloze"]
    assert set(task["metrics"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert task["limit"] == 12 and task["samples"] == 12 and task["num_fewshot"] == 0
    assert task["dataset"] == "brown_cloze.jsonl" and task["task_version"] == 1.0
    assert report["lm_eval_version"] == lm_eval.__version__
    assert json.loads(out.read_text())["tasks"] == report["tasks"]  # the written report holds them too

    from layercut.compress.io.models import load_model

    model, tokenizer = load_model(model_dir)
    acc, acc_norm = own_accuracy(model, tokenizer, rows()[:12])
    assert task["metrics"]["acc"] == pytest.approx(acc) and task["metrics"]["acc_norm"] == pytest.approx(acc_norm)
    assert 0 < task["metrics"]["acc_stderr"] < 0.2


def test_num_fewshot_reaches_the_task(lm_eval, tiny_model_dir):
    report = run(EvalConfig(**FAST, tasks=["brown_cloze"], limit=3, num_fewshot=2), tiny_model_dir("llama"))
    assert report["tasks"]["brown_cloze"]["num_fewshot"] == 2


def test_tasks_on_a_depth_pruned_model_in_a_recipe(lm_eval, tiny_model_dir, tmp_path):
    """The recipe's eval stage takes the same options; the tasks land in eval.json and report.json."""
    from layercut.compress.workflow.pipeline import run_recipe
    from layercut.compress.workflow.recipe import Recipe

    recipe = Recipe.from_dict({"version": 1, "model": str(tiny_model_dir("llama")), "stages": [
        {"prune": {"layers": [4], "samples": 2, "seq_len": 16}},
        {"eval": {**FAST, "tasks": ["brown_cloze"], "limit": 4}}]})
    out = tmp_path / "run"
    run_recipe(recipe, out, progress=False)
    stage = json.loads((out / "report.json").read_text())["stages"][-1]["report"]
    assert stage["tasks"]["brown_cloze"]["samples"] == 4 and stage["lm_eval_version"]
    assert 0 <= stage["tasks"]["brown_cloze"]["metrics"]["acc"] <= 1
    assert "brown_cloze" in (out / "recipe.yaml").read_text()  # the resolved recipe keeps them


def test_tasks_on_a_gptq_checkpoint_run_its_quantlinear_layers(lm_eval, tiny_model_dir, tmp_path, monkeypatch):
    import layercut.compress.workflow.stages.eval as eval_stage
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.quant.format.qlinear import QuantLinear
    from layercut.compress.workflow.stages.quantize import run as quantize

    q = tmp_path / "q4"
    quantize(QuantizeConfig(bits=4, group_size=32, method="rtn"), tiny_model_dir("llama"), q)
    seen = {}
    original = eval_stage.run_tasks  # lmeval's, as the stage calls it

    def spy(model, *args, **kwargs):
        seen["quantlinear"] = sum(isinstance(m, QuantLinear) for m in model.modules())
        return original(model, *args, **kwargs)

    monkeypatch.setattr(eval_stage, "run_tasks", spy)
    report = run(EvalConfig(**FAST, tasks="brown_cloze", limit=4), q)
    assert seen["quantlinear"] == 6 * 7  # every linear of the 6 blocks
    assert report["tasks"]["brown_cloze"]["samples"] == 4


USER_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""


def test_a_user_task_folder_with_local_data(lm_eval, tiny_model_dir, tmp_path):
    """--include-path: the offline route for one's own tasks (datasets' json builder on a local file)."""
    folder = tmp_path / "my_tasks"
    folder.mkdir()
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()[:5]))
    (folder / "mine.yaml").write_text(USER_TASK.format(name="my_cloze", data=data))
    report = run(EvalConfig(**FAST, tasks="my_cloze,brown_cloze", limit=5, include_path=str(folder)),
                 tiny_model_dir("llama"))
    assert list(report["tasks"]) == ["my_cloze", "brown_cloze"]  # the shipped tasks stay available
    mine = report["tasks"]["my_cloze"]
    assert mine["dataset"] == "items.jsonl" and mine["samples"] == 5 and set(mine["metrics"]) == {"acc", "acc_stderr"}
    # the same items, the same model: the same accuracy as through the shipped task
    assert mine["metrics"]["acc"] == report["tasks"]["brown_cloze"]["metrics"]["acc"]


def test_task_data_that_cannot_load_fails_before_any_work(lm_eval, tiny_model_dir, tmp_path, capsys):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "b.yaml").write_text(USER_TASK.format(name="broken_task", data=tmp_path / "missing.jsonl"))
    line = one_error_line(capsys, ["eval", str(tiny_model_dir("llama")), "--tasks", "broken_task",
                                   "--include-path", str(folder)])
    assert "cannot load task(s) broken_task" in line  # and stdout is empty: no perplexity pass ran


def test_cli_json_carries_the_tasks(lm_eval, tiny_model_dir, capsys):
    assert main(["eval", str(tiny_model_dir("llama")), "--max-tokens", "64", "--ctx", "32",
                 "--tasks", "brown_cloze", "--limit", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["tasks"]["brown_cloze"]["samples"] == 2 and printed["lm_eval_version"]


def one_error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (["--tasks", "brown_cloez"], ["unknown task 'brown_cloez'", "close: brown_cloze"]),
    (["--tasks", "brown_cloze", "--include-path", "{tmp}/nope"], ["include path not found", "nope"]),
])
def test_bad_task_input_is_one_line(lm_eval, tiny_model_dir, capsys, tmp_path, args, words):
    line = one_error_line(capsys, ["eval", str(tiny_model_dir("llama")), *[a.format(tmp=tmp_path) for a in args]])
    assert all(w in line for w in words), line


@pytest.mark.parametrize("args, words", [
    (["--tasks", "brown_cloze", "--limit", "0"], ["--limit must be >= 1 (got 0)"]),
    (["--tasks", "brown_cloze", "--num-fewshot", "33"], ["--num-fewshot must be <= 32 (got 33)"]),
    (["--limit", "5"], ["--limit applies to task evals: give tasks"]),
    (["--tasks", ","], ["expected task names"]),
])
def test_bad_task_options_are_one_line(tiny_model_dir, capsys, args, words):
    line = one_error_line(capsys, ["eval", str(tiny_model_dir("llama")), *args])
    assert all(w in line for w in words), line


def test_tasks_without_lm_eval_is_one_clear_line_before_any_work(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    line = one_error_line(capsys, ["eval", str(tiny_model_dir("llama")), "--tasks", "brown_cloze"])
    assert line == f"error: {INSTALL_HINT}"
    assert INSTALL_HINT == "task evals need lm-eval: pip install 'layercut[eval]'"


def test_layercut_and_eval_help_do_not_import_lm_eval():
    code = ("import sys, layercut, layercut.compress.eval.lmeval, layercut.compress.workflow.stages.eval\n"
            "from layercut.compress.workflow.cli import main\n"
            "main(['eval', '--help'])\n"
            "print('lm_eval' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--tasks" in res.stdout and "whole" in res.stdout  # the help says tasks hold the whole model
    assert res.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow
def test_real_model_is_well_above_chance_and_a_random_one_is_not(lm_eval, tiny_model_dir):
    real = run(EvalConfig(**FAST, tasks="brown_cloze", limit=100), "bundled:smollm2-135m")
    # Pinned: measured 0.90 (90 of the first 100 items; chance is 0.25), one item of slack for a
    # near-tie flipping on another machine. Red, for example, if lm-eval's context were cut to
    # the last 24 tokens (HFLM max_length=24): 0.87, which the old "> 0.6" let pass.
    assert real["tasks"]["brown_cloze"]["metrics"]["acc"] == pytest.approx(0.90, abs=0.015)
    rand = run(EvalConfig(**FAST, tasks="brown_cloze"), tiny_model_dir("llama"))
    acc = rand["tasks"]["brown_cloze"]["metrics"]["acc"]
    assert rand["tasks"]["brown_cloze"]["samples"] == len(rows())
    assert abs(acc - 0.25) < 0.08, acc
