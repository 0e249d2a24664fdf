"""``layercut export --format gguf``: the file is read back by layercut's own GGUF reader and by
transformers' GGUF loader to the source weights within the type's rounding (f16/bf16: exactly
the rounded weights; q8_0: within half a Q8_0 step per block), the logits agree, the tokenizer
survives, a depth-pruned checkpoint works, and bad input is one ``error:`` line with nothing written.
"""

from __future__ import annotations

import pytest
import torch

from layercut.compress.workflow.cli import main

TYPES = ("f16", "bf16", "q8_0")
LOGIT_ATOL = {"f16": 2e-3, "bf16": 2e-2, "q8_0": 3e-2}  # logits of magnitude ~0.6


def _export(src, out, gguf_type):
    assert main(["export", str(src), "-o", str(out), "--format", "gguf", "--gguf-type", gguf_type]) == 0
    path = out / f"model-{gguf_type}.gguf"
    assert sorted(p.name for p in out.iterdir()) == [path.name]  # no card, no leftovers
    return path


def _source_weights(src) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()}


def _check_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], gguf_type: str) -> None:
    """Each weight read back is the source's, rounded as ``gguf_type`` rounds it (1-D tensors: F32)."""
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name].float()
        assert g.shape == w.shape, name
        if w.dim() == 1:
            assert torch.equal(g, w), name
        elif gguf_type == "f16":
            assert torch.equal(g, w.half().float()), name
        elif gguf_type == "bf16":
            assert torch.equal(g, w.bfloat16().float()), name
        else:  # Q8_0: blocks of 32 along a row, scale d = absmax/127 in fp16, codes rounded
            blocks = w.reshape(-1, 32)
            d = blocks.abs().amax(dim=1, keepdim=True) / 127
            err = (g.reshape(-1, 32) - blocks).abs()
            assert bool((err <= d * 0.5 + d * 127 * 2**-11 + 1e-12).all()), name


def _layercut_read(gguf_path, cache, monkeypatch) -> dict[str, torch.Tensor]:
    """The GGUF through layercut's own reader (``resolve_model`` converts it to float32 safetensors)."""
    from safetensors.torch import load_file

    from layercut.compress.io.models import resolve_model

    monkeypatch.setenv("LAYERCUT_CACHE", str(cache))
    folder = resolve_model(gguf_path)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("gguf_type", TYPES)
def test_gguf_reads_back_in_layercut_and_transformers(tiny_model_dir, tmp_path, monkeypatch, gguf_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layercut.compress.io.models import load_model

    src = tiny_model_dir("llama")
    path = _export(src, tmp_path / "gguf", gguf_type)
    want = _source_weights(src)
    _check_weights(_layercut_read(path, tmp_path / "cache", monkeypatch), want, gguf_type)

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    _check_weights({k: v for k, v in theirs.state_dict().items() if k in want}, want, gguf_type)
    ours, _ = load_model(path)  # layercut's loader path for a .gguf (what `layercut eval x.gguf` runs)
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = _logits(ref, ids)
    torch.testing.assert_close(_logits(theirs, ids), expected, atol=LOGIT_ATOL[gguf_type], rtol=0)
    torch.testing.assert_close(_logits(ours, ids), expected, atol=LOGIT_ATOL[gguf_type], rtol=0)

    text = "The quick brown fox, 1234 jumped over <s> the lazy dog.\n  Indented  twice."
    tok, gguf_tok = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert gguf_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert gguf_tok.decode(tok(text)["input_ids"]) == text


def test_a_wrong_rotary_permutation_fails_the_check(tiny_model_dir, tmp_path, monkeypatch):
    """The read-back check above is red when q/k rows are not permuted (llama.cpp's rotary layout)."""
    import layercut.export.gguf as gguf_export

    monkeypatch.setattr(gguf_export, "permute_rotary", lambda weight, n_head: weight)
    src = tiny_model_dir("llama")
    path = _export(src, tmp_path / "gguf", "f16")
    with pytest.raises(AssertionError, match="q_proj|k_proj"):
        _check_weights(_layercut_read(path, tmp_path / "cache", monkeypatch), _source_weights(src), "f16")


def test_depth_pruned_checkpoint(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    pruned = tmp_path / "pruned"
    assert main(["prune", str(tiny_model_dir("llama")), "-o", str(pruned), "--layers", "1,4"]) == 0
    path = _export(pruned, tmp_path / "gguf", "f16")
    from gguf import GGUFReader

    assert GGUFReader(str(path)).fields["llama.block_count"].contents() == 4
    ref = AutoModelForCausalLM.from_pretrained(pruned, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert theirs.config.num_hidden_layers == 4
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(theirs, ids), _logits(ref, ids), atol=LOGIT_ATOL["f16"], rtol=0)


@pytest.fixture(scope="module")
def gptq_dir(tiny_model_dir, tmp_path_factory):
    from layercut.compress.workflow.stages.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("q") / "q4"
    quantize_checkpoint(str(tiny_model_dir("llama")), out, bits=4, group_size=32, samples=4, seq_len=32,
                        progress=False)
    return out


@pytest.mark.parametrize("case, words", [
    ("gptq", ["--format gguf", "GPTQ checkpoint", "--dequantize first"]),
    ("bad-type", ["argument --gguf-type: invalid choice: 'q4_k'"]),
    ("gemma", ["architecture 'gemma3_text' is not mapped", "supported: llama"]),
    ("type-without-gguf", ["--gguf-type applies to --format gguf"]),
    ("dense-to-ct", ["--format compressed-tensors", "dense checkpoint"]),
])
def test_bad_input_is_one_error_line_and_writes_nothing(case, words, tiny_model_dir, gptq_dir, tmp_path, capsys):
    llama = tiny_model_dir("llama")
    argv = {"gptq": [str(gptq_dir), "--format", "gguf"],
            "bad-type": [str(llama), "--format", "gguf", "--gguf-type", "q4_k"],
            "gemma": [str(tiny_model_dir("gemma3_text")), "--format", "gguf"],
            "type-without-gguf": [str(llama), "--gguf-type", "f16"],
            "dense-to-ct": [str(llama), "--format", "compressed-tensors"]}[case]
    work = tmp_path / "work"
    work.mkdir()
    capsys.readouterr()
    assert main(["export", *argv, "-o", str(work / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert all(w in err[0] for w in words), err[0]
    assert list(work.iterdir()) == []  # nothing written, no temporary folder left


def test_sentencepiece_tokenizer_is_refused(tmp_path):
    import json

    from layercut.compress.core.errors import LayercutError
    from layercut.export.gguf_vocab import read_tokenizer_json

    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "byte_fallback": True},
                                                         "decoder": {"type": "Sequence"}}))
    with pytest.raises(LayercutError, match="SentencePiece-style"):
        read_tokenizer_json(tmp_path)


@pytest.mark.slow
def test_smollm2_tokenizer_metadata_matches_the_llama_cpp_gguf(tmp_path):
    """Exported from layercut's conversion of the bundled SmolLM2 GGUF (written by llama.cpp): the
    tokenizer metadata is the original's, except ``pre``, which is gpt-2 because that conversion's
    tokenizer (transformers' GGUF reader) has no digit splitting."""
    from gguf import GGUFReader

    from layercut.compress.io.models import bundled_gguf_path, resolve_model
    from layercut.export.gguf import write_gguf

    path = tmp_path / "smol.gguf"
    write_gguf(resolve_model("bundled:smollm2-135m"), path, "f16")
    a, b = GGUFReader(str(bundled_gguf_path("smollm2-135m"))).fields, GGUFReader(str(path)).fields
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
                "llama.block_count", "llama.rope.freq_base", "llama.attention.head_count_kv", "llama.vocab_size"):
        assert a[key].contents() == b[key].contents(), key
    assert b["tokenizer.ggml.pre"].contents() == "gpt-2"
