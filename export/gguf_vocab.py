"""A checkpoint's tokenizer as GGUF metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``).

Usage::

    from gguf import GGUFWriter
    from layercut.export.gguf_vocab import add_tokenizer
    add_tokenizer(writer, Path("ckpt"), vocab_size=49152)   # before the writer's header is written

Byte-level BPE tokenizers only (``tokenizer.json`` with a ``BPE`` model and a ``ByteLevel``
decoder: GPT-2, Llama 3, SmolLM2, Qwen2 ...), written as llama.cpp's ``convert_hf_to_gguf.py``
writes them (``_set_vocab_gpt2``): the token list padded to the model's vocabulary with
``[PADi]`` (type UNUSED), added tokens marked CONTROL when special (or when they look it:
``<|...|>``), else USER_DEFINED, the merges, special token ids, ``add_bos``/``add_eos`` and the
chat template through the ``gguf`` package's own :class:`gguf.SpecialVocab` (``add_bos``/``add_eos``
from what the tokenizer does where its config does not say). On SmolLM2 the result equals the
bundled llama.cpp-written GGUF's tokens, types, merges, ids and template (tested).

``tokenizer.ggml.pre`` (which split regex llama.cpp applies before the merges) is read from the
tokenizer's pre-tokenizer: plain ``ByteLevel`` is ``gpt-2``, ``Digits`` + ``ByteLevel`` is
``smollm``, a ``Split`` regex is looked up in transformers' GGUF table of pre-tokenizer regexes
(``llama3``, ``qwen2``, ...). Anything else, and SentencePiece-style tokenizers (Llama 2,
Gemma: a ``tokenizer.model`` / ``Metaspace``), is refused with one error before any tensor
is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layercut.compress.core.errors import LayercutError

# llama.cpp's convert_hf_to_gguf.py: added tokens that are control tokens even when not marked special
_LOOKS_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")


def _looks_special(token: str) -> bool:
    return (token in _LOOKS_SPECIAL or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _split_names() -> dict[str, str]:
    """Split regex -> llama.cpp pre-tokenizer name, from transformers' GGUF reader table."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # older transformers: only the structural cases below
        return {}
    names: dict[str, str] = {}
    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        names.setdefault(regex, name)  # the table lists the canonical name of a regex first
    return names


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE ``tokenizer.json``; LayercutError if unknown."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    items = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in items]
    if kinds == ["ByteLevel"] and items[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and items[0].get("individual_digits") and items[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not items[1].get("use_regex", True):
        regex = (items[0].get("pattern") or {}).get("Regex")
        if regex in _split_names():
            return _split_names()[regex]
    raise LayercutError(f"--format gguf: unknown pre-tokenizer {json.dumps(pre)[:160]}: llama.cpp would split text "
                        "differently; supported: GPT-2 byte-level, SmolLM digits + byte-level, and the split "
                        "regexes of transformers' GGUF table (Llama 3, Qwen2, ...)")


def read_tokenizer_json(src: Path) -> dict[str, Any]:
    """The checkpoint's ``tokenizer.json``, checked to be byte-level BPE; LayercutError otherwise."""
    path = src / "tokenizer.json"
    if not path.is_file():
        kind = "SentencePiece (tokenizer.model)" if (src / "tokenizer.model").is_file() else "no tokenizer.json"
        raise LayercutError(f"--format gguf: {src} has {kind}; GGUF export writes byte-level BPE tokenizers only")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    model, decoder = tokenizer.get("model") or {}, tokenizer.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise LayercutError(
            f"--format gguf: the tokenizer is {model.get('type')} with a {decoder.get('type')} decoder "
            "(SentencePiece-style, e.g. Gemma or Llama 2); GGUF export writes byte-level BPE tokenizers only "
            "(GPT-2, Llama 3, SmolLM2, Qwen2 style)")
    return tokenizer


def vocab_tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token strings and GGUF token types for ids ``0 .. vocab_size-1`` (llama.cpp's get_vocab_base)."""
    from gguf import TokenType

    vocab = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= vocab_size:
        raise LayercutError(f"--format gguf: the tokenizer has token id {max(vocab.values())} but the model's "
                            f"vocabulary is {vocab_size}")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:  # llama.cpp expects added tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(int(TokenType.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                types.append(int(TokenType.USER_DEFINED))
        else:
            types.append(int(TokenType.NORMAL))
        tokens.append(token)
    return tokens, types


def add_tokenizer(writer: Any, src: Path, vocab_size: int) -> None:
    """Add ``src``'s tokenizer (and chat template, if any) to ``writer`` (a ``gguf.GGUFWriter``)."""
    from gguf import SpecialVocab
    from transformers import AutoTokenizer

    pre = pre_tokenizer_name(read_tokenizer_json(src))
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokens, types = vocab_tokens(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = SpecialVocab(src, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise LayercutError(f"--format gguf: {src}/tokenizer.json has no BPE merges")
    for kind, added in _adds_special(tokenizer).items():  # what the tokenizer does, when no config says it
        special.add_special_token.setdefault(kind, added)
    special.add_to_gguf(writer, quiet=True)


def _adds_special(tokenizer: Any) -> dict[str, bool]:
    """Whether encoding puts BOS in front / EOS at the end (llama.cpp reads add_bos/add_eos_token)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    extra = len(full) > len(plain)
    return {"bos": extra and tokenizer.bos_token_id is not None and full[0] == tokenizer.bos_token_id,
            "eos": extra and tokenizer.eos_token_id is not None and full[-1] == tokenizer.eos_token_id}
