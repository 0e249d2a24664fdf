"""Calibration and healing text: hf datasets by field, split slices, chat templates, weighted mixes.

Local datasets are folders of data files (``train.jsonl``) read by ``datasets.load_dataset``
offline, with the datasets cache redirected into the test's tmp_path.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml

from layercut.calibrate.data import calibration_batch, load_texts
from layercut.calibrate.sources import TextSource
from layercut.compress.core.errors import LayercutError

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}")
ROWS = 20


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question number {i}?"},
            {"role": "assistant", "content": f"the answer is {i}."}]


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return tmp_path


@pytest.fixture()
def chat_folder(hf_cache):
    """A local dataset folder: 20 rows with a text column ``body``, conversations ``chat`` and an ``id``."""
    folder = hf_cache / "chat"
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as fh:
        for i in range(ROWS):
            fh.write(json.dumps({"id": i, "body": f"The body of row {i}.", "chat": conversation(i)}) + "\n")
    return folder


@pytest.fixture()
def chat_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHATML
    return tok


def test_hf_text_field_and_slices(chat_folder):
    src = f"hf:{chat_folder}"
    assert load_texts(TextSource(source=src + "@train[:3]", text_field="body")) == \
        [f"The body of row {i}." for i in range(3)]
    assert load_texts(TextSource(source=src + "@train[10%:20%]", text_field="body")) == \
        ["The body of row 2.", "The body of row 3."]
    assert load_texts(TextSource(source=src + "@train[-1:]", text_field="body")) == ["The body of row 19."]


def test_hf_conversations_through_the_chat_template(chat_folder, chat_tokenizer):
    src = TextSource(source=f"hf:{chat_folder}@train[5:7]", messages_field="chat", chat_template=True)
    docs = load_texts(src, chat_tokenizer)
    assert docs == [chat_tokenizer.apply_chat_template(conversation(i), tokenize=False) for i in (5, 6)]
    assert docs[0] == ("<|im_start|>user\nquestion number 5?<|im_end|>\n"
                       "<|im_start|>assistant\nthe answer is 5.<|im_end|>\n")


def test_jsonl_messages(tmp_path, chat_tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(3)))
    docs = load_texts(TextSource(source=str(path), chat_template=True), chat_tokenizer)
    assert len(docs) == 3 and docs[2].startswith("<|im_start|>user\nquestion number 2?")
    with pytest.raises(LayercutError, match="add --chat-template"):  # conversations, but no template asked for
        load_texts(path)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"conv": conversation(7), "text": "plain"}) + "\n")
    assert "answer is 7" in load_texts(TextSource(source=str(other), messages_field="conv", chat_template=True),
                                       chat_tokenizer)[0]
    assert load_texts(other) == ["plain"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "text": "no content key"}]}) + "\n")
    with pytest.raises(LayercutError, match=r"bad.jsonl:1: 'messages': not a list of \{role, content\} dicts"):
        load_texts(TextSource(source=str(bad), chat_template=True), chat_tokenizer)


def test_mixing_draws_each_source_by_weight(tiny_tokenizer, tmp_path):
    """A 3:1 mix of 8 windows is brown's 6 windows and the other text's 2, each as drawn alone, shuffled."""
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"Other document {i}: zebras quietly juggle {i * 7} violet kites." for i in range(300)))
    mix = [TextSource(source="bundled:brown-calib", weight=0.75), TextSource(source=str(other), weight=0.25)]
    batch = calibration_batch(tiny_tokenizer, mix, samples=8, seq_len=16, seed=0)
    alone_a = calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=6, seq_len=16, seed=0)
    alone_b = calibration_batch(tiny_tokenizer, other, samples=2, seq_len=16, seed=0)
    rows = {tuple(r) for r in batch.input_ids.tolist()}
    assert rows == {tuple(r) for r in torch.cat([alone_a.input_ids, alone_b.input_ids]).tolist()}
    assert batch.input_ids.shape == (8, 16) and batch.attention_mask.all()
    again = calibration_batch(tiny_tokenizer, mix, samples=8, seq_len=16, seed=0)
    assert torch.equal(batch.input_ids, again.input_ids)  # deterministic given the seed
    # the rows are shuffled: the second source is not just the last rows
    assert not torch.equal(batch.input_ids[6:], alone_b.input_ids)
    assert not torch.equal(calibration_batch(tiny_tokenizer, mix, samples=8, seq_len=16, seed=1).input_ids,
                           batch.input_ids)
    # a plain string in a list is a weight-1 source; one source draws exactly as the string does
    single = calibration_batch(tiny_tokenizer, [TextSource(source="bundled:brown-calib", weight=9.0)],
                               samples=6, seq_len=16, seed=0)
    assert torch.equal(single.input_ids, alone_a.input_ids)


def test_stage_configs_take_a_string_or_a_weighted_list(chat_folder):
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.recipe import Recipe
    from layercut.heal.config import HealConfig

    entry = {"source": f"hf:{chat_folder}@train[:10]", "messages_field": "chat", "chat_template": True,
             "weight": 0.3}
    cfg = QuantizeConfig(bits=4, calib=["bundled:brown-calib", entry])
    assert [s.weight for s in cfg.text_sources()] == [1.0, 0.3]
    assert cfg.text_label() == [{"source": "bundled:brown-calib", "weight": 1.0}, entry]
    assert QuantizeConfig(bits=4).text_label() == "bundled:brown-calib"  # reports unchanged for a string
    flat = QuantizeConfig(bits=4, calib=f"hf:{chat_folder}", text_field="body")
    assert flat.text_sources() == [TextSource(source=f"hf:{chat_folder}", text_field="body")]
    assert flat.text_label() == {"source": f"hf:{chat_folder}", "text_field": "body"}
    heal = HealConfig(data=[{"source": "bundled:brown-calib", "weight": 0.7}, entry])
    assert heal.source_offsets() == [300_000, 0]  # the bundled text starts past every calibration draw
    # a resumed heal must use the same text: options in the fingerprint, unless at their defaults (old states)
    assert "chat_template" not in HealConfig().fingerprint()
    assert HealConfig(data="c.jsonl", chat_template=True).fingerprint()["chat_template"] is True
    assert heal.fingerprint()["data"][1] == {**entry, "text_field": None}
    recipe = Recipe.from_dict({"version": 1, "model": "m", "stages": [
        {"prune": {"layers": [1], "calib": [{"source": "bundled:brown-calib", "weight": 0.7}, entry]}},
        {"heal": {"data": [entry]}}]})
    assert Recipe.from_dict(yaml.safe_load(recipe.to_yaml())) == recipe
    assert recipe.stages[0].text_sources()[1].messages_field == "chat"


def test_cli_flags_describe_the_string_source():
    import argparse

    from layercut.compress.depth.config import PruneConfig
    from layercut.compress.workflow.cli import build_parser
    from layercut.compress.workflow.stages.flags import config_from_args

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["prune"]
    args = sub.parse_args(["m", "-o", "o", "--layers", "1", "--calib", "hf:/d@train[:10]", "--messages-field",
                           "chat", "--chat-template"])
    cfg = config_from_args(PruneConfig, args)
    assert cfg.text_sources() == [TextSource(source="hf:/d@train[:10]", messages_field="chat", chat_template=True)]
    args = sub.parse_args(["m", "-o", "o", "--layers", "1", "--calib", "hf:/d", "--messages-field", "chat"])
    with pytest.raises(LayercutError, match=r"^--messages-field 'chat' needs --chat-template"):
        config_from_args(PruneConfig, args)


def test_heal_mix_and_its_offsets(tiny_tokenizer, tmp_path):
    from layercut.heal.config import HealConfig
    from layercut.heal.data import heal_data

    one = heal_data(tiny_tokenizer, HealConfig(data="bundled:brown-calib", samples=3, seq_len=16))
    listed = heal_data(tiny_tokenizer, HealConfig(data=[{"source": "bundled:brown-calib"}], samples=3, seq_len=16))
    assert torch.equal(one.input_ids, listed.input_ids)  # the same offset (past calibration) either way
    other = tmp_path / "t.txt"
    other.write_text("\n\n".join(f"document {i} of the other text" for i in range(200)))
    mixed = heal_data(tiny_tokenizer, HealConfig(data=["bundled:brown-calib", str(other)], samples=4, seq_len=16))
    assert mixed.input_ids.shape == (4, 16) and (mixed.input_ids[:, 0] == tiny_tokenizer.bos_token_id).all()
    with pytest.raises(LayercutError, match="evaluation text"):
        heal_data(tiny_tokenizer, HealConfig(data=[str(other), "bundled:brown-test"], samples=2, seq_len=16))


# ---------------------------------------------------------------------------- bad input, one line each
def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


def test_absent_field_names_the_columns(chat_folder):
    with pytest.raises(LayercutError) as info:
        load_texts(f"hf:{chat_folder}@train[:2]")  # no 'text' column
    assert "has no field 'text' (columns: id, body, chat; choose one with --text-field)" in one_line(info)
    with pytest.raises(LayercutError, match="is not text"):
        load_texts(TextSource(source=f"hf:{chat_folder}", text_field="id"))


def test_chat_template_needs_a_tokenizer_with_one(chat_folder, tiny_tokenizer):
    src = TextSource(source=f"hf:{chat_folder}", messages_field="chat", chat_template=True)
    with pytest.raises(LayercutError) as info:
        calibration_batch(tiny_tokenizer, src, samples=2, seq_len=16)
    assert "--chat-template, but the tokenizer has no chat template" in one_line(info)


@pytest.mark.parametrize("split, message", [
    ("train[5000:6000]", "slice 'train[5000:6000]' is outside split 'train' (20 rows)"),
    ("train[10:40]", "slice 'train[10:40]' is outside split 'train' (20 rows)"),
    ("train[7:7]", "the split 'train[7:7]' selects no rows"),
    ("train[50%:50%]", "the split 'train[50%:50%]' selects no rows"),
    ("tran", 'Unknown split "tran"'),
])
def test_slices_outside_the_data(chat_folder, split, message):
    with pytest.raises(LayercutError) as info:
        load_texts(TextSource(source=f"hf:{chat_folder}@{split}", text_field="body"))
    assert message in one_line(info)


def test_messages_that_are_not_conversations(chat_folder, chat_tokenizer):
    with pytest.raises(LayercutError) as info:
        load_texts(TextSource(source=f"hf:{chat_folder}", messages_field="body", chat_template=True), chat_tokenizer)
    assert "field 'body' is not a list of {role, content} dicts" in one_line(info)


@pytest.mark.parametrize("entry, message", [
    ({"source": "bundled:brown-calib", "weight": 0}, "calib[1]: weight must be > 0 (got 0)"),
    ({"source": "bundled:brown-calib", "weight": -1.5}, "calib[1]: weight must be > 0 (got -1.5)"),
    ({"source": "bundled:brown-calib", "wieght": 2}, "calib[1]: unknown key 'wieght', did you mean 'weight'? "
                                                     "(allowed: source, weight, text_field, messages_field, "
                                                     "chat_template)"),
    ({"source": "bundled:brown-calib", "text_field": "x"}, "calib[1]: text_field applies to .jsonl files and hf: "
                                                          "datasets, not to 'bundled:brown-calib'"),
    ({"source": "hf:x", "messages_field": "m"}, "calib[1]: messages_field 'm' needs chat_template (conversations "
                                                "are rendered with the tokenizer's chat template)"),
    ({"weight": 1.0}, "calib[1]: missing required key 'source'"),
    (5, "calib[1]: expected a source string or a mapping with a source key (got 5)"),
])
def test_bad_source_entries_in_a_recipe(entry, message):
    from layercut.compress.workflow.recipe import Recipe

    with pytest.raises(LayercutError) as info:
        Recipe.from_dict({"version": 1, "model": "m", "stages": [
            {"quantize": {"bits": 4, "calib": ["bundled:brown-calib", entry]}}]})
    assert one_line(info) == f"recipe: stages[0].quantize: {message}"


def test_flat_options_with_a_list_are_refused():
    from layercut.compress.select.config import ScoreConfig

    with pytest.raises(ValueError, match="text_field: these describe a single calib source"):
        ScoreConfig(calib=["bundled:brown-calib"], text_field="body")


@pytest.mark.slow
def test_bundled_instruct_template_renders_conversations(hf_cache):
    """The bundled SmolLM2-Instruct's converted tokenizer keeps the GGUF's chat template, and a local
    messages dataset goes through it: role markers in the text, <|im_start|> as one token in the windows."""
    from gguf import GGUFReader

    from layercut.compress.io.models import bundled_gguf_path, load_tokenizer

    tok = load_tokenizer("bundled:smollm2-135m")
    field = GGUFReader(str(bundled_gguf_path("smollm2-135m"))).fields["tokenizer.chat_template"]
    assert tok.chat_template == bytes(field.parts[field.data[0]]).decode("utf-8")
    folder = hf_cache / "msgs"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(50)))
    src = TextSource(source=f"hf:{folder}@train[:40]", chat_template=True)
    docs = load_texts(src, tok)
    assert len(docs) == 40
    assert "<|im_start|>user\nquestion number 0?<|im_end|>" in docs[0]
    assert "<|im_start|>assistant\nthe answer is 0.<|im_end|>" in docs[0]
    batch = calibration_batch(tok, src, samples=4, seq_len=32, seed=0)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert (batch.input_ids == im_start).any(dim=1).all()


# ---------------------------------------------------------------------------- the options reach every stage
def test_score_reads_an_hf_field(tiny_model_dir, chat_folder):
    from layercut.compress.select.config import ScoreConfig
    from layercut.compress.workflow.stages.base import RunEnv
    from layercut.compress.workflow.stages.score import run

    cfg = ScoreConfig(method="block-influence", calib=f"hf:{chat_folder}@train[:12]", text_field="body", samples=2,
                      seq_len=8)
    report = run(cfg, tiny_model_dir("llama"), env=RunEnv(progress=False))
    assert report["scores"]["meta"]["calib"] == {"source": f"hf:{chat_folder}@train[:12]", "text_field": "body"}


@pytest.mark.parametrize("stage", ["score", "prune", "quantize", "heal", "api-score"])
def test_chat_template_reaches_every_stage(stage, tiny_model_dir, chat_folder, tmp_path):
    """Each stage hands the text options to the data loader: the tiny tokenizer has no template, so asking
    for one fails there, before any work."""
    import layercut
    from layercut.compress.workflow.stages import heal, prune, quantize, score
    from layercut.compress.workflow.stages.base import RunEnv

    model_dir = tiny_model_dir("llama")
    opts = {"messages_field": "chat", "chat_template": True}
    env = RunEnv(progress=False)
    with pytest.raises(LayercutError, match="the tokenizer has no chat template"):
        if stage == "score":
            score.run(score.ScoreConfig(method="block-influence", calib=f"hf:{chat_folder}", **opts), model_dir,
                      env=env)
        elif stage == "prune":
            prune.run(prune.PruneConfig(drop=1, select="angular", calib=f"hf:{chat_folder}", **opts), model_dir,
                      tmp_path / "out", env=env)
        elif stage == "quantize":
            quantize.run(quantize.QuantizeConfig(bits=4, calib=[{"source": f"hf:{chat_folder}", **opts}]),
                         model_dir, tmp_path / "out", env=env)
        elif stage == "heal":
            heal.run(heal.HealConfig(loss="lm", teacher=None, data=f"hf:{chat_folder}", steps=1, **opts), model_dir,
                     tmp_path / "out", env=env)
        else:
            model, tok = layercut.load(model_dir)
            layercut.score(model, tok, method="block-influence", calib=f"hf:{chat_folder}", **opts)


def test_cli_bad_field_is_one_line_and_nonzero(tiny_model_dir, chat_folder, capsys):
    from layercut.compress.workflow.cli import main

    code = main(["-q", "score", str(tiny_model_dir("llama")), "--method", "block-influence", "--calib",
                 f"hf:{chat_folder}@train[:4]", "--text-field", "title"])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert err.splitlines()[-1] == f"error: dataset 'hf:{chat_folder}@train[:4]' has no field 'title' (columns: id, " \
        "body, chat; choose one with --text-field)"
