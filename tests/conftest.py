"""Shared fixtures: tiny models of every covered family, built from config (offline).

``tiny_model_dir(family)`` saves a randomly initialised model of that family with a
small BPE tokenizer trained on the bundled Brown text, so every CLI path can run on it
in seconds. Real-model tests are marked ``slow`` and run with ``--runslow``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

VOCAB = 384
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox"]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="run tests on the real bundled model")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("LAYERCUT_SLOW") == "1"
    skip_slow = pytest.mark.skip(reason="needs --runslow (real bundled model)")
    cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)


def import_extra(name: str):
    """Import a module from an optional extra; skip without it locally, but fail under CI.

    Under CI (``CI=true``: GitHub Actions and GitLab set it, ``.ci/run`` exports it) the
    ``.[gptq,dev,eval]`` extras are installed, so a missing module there is a broken install, not a
    reason to skip: e.g. the bit-exactness test that keeps the ``gptqmodel`` entry in
    ``meta.quantizer`` honest must run.
    """
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        import importlib

        return importlib.import_module(name)
    return pytest.importorskip(name)


def tiny_config(family: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama_like = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **common)
    if family == "llama":
        return T.LlamaConfig(**llama_like)
    if family == "mistral":
        return T.MistralConfig(**{**llama_like, "sliding_window": 32})
    if family == "qwen2":
        return T.Qwen2Config(**llama_like)
    if family == "qwen3":
        return T.Qwen3Config(**llama_like)
    if family == "gemma2":
        return T.Gemma2Config(**{**llama_like, "sliding_window": 32})
    if family == "gemma3_text":
        return T.Gemma3TextConfig(**{**llama_like, "sliding_window": 32, "sliding_window_pattern": 2})
    if family == "phi3":
        return T.Phi3Config(**{k: v for k, v in llama_like.items() if k != "head_dim"})
    if family == "gpt2":
        return T.GPT2Config(n_embd=64, n_layer=6, n_head=4, n_positions=256, **common)
    if family == "gpt_neox":
        return T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                               num_attention_heads=4, max_position_embeddings=256, **common)
    raise ValueError(family)


def build_tiny_model(family: str, seed: int = 0):
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(family))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A 384-token BPE tokenizer trained on a slice of the bundled Brown calibration text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from layercut.calibrate.data import load_texts

    docs = load_texts("bundled:brown-calib")[:40]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    assert len(fast) <= VOCAB
    return fast


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """``tiny_model_dir(family)`` -> Path of a saved tiny checkpoint (cached per session)."""
    cache: dict[str, Path] = {}

    def make(family: str = "llama") -> Path:
        if family not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            model = build_tiny_model(family)
            model.save_pretrained(path, safe_serialization=True)
            tiny_tokenizer.save_pretrained(path)
            cache[family] = path
        return cache[family]

    return make


@pytest.fixture()
def calib(tiny_tokenizer):
    from layercut.calibrate.data import calibration_batch

    return calibration_batch(tiny_tokenizer, "bundled:brown-calib", samples=6, seq_len=32, seed=0)
