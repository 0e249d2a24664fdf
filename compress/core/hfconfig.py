"""A checkpoint's ``config.json``: the one reader, and the one test of "is this quantized?".

Usage::

    from layercut.compress.core.hfconfig import is_quantized, read_config
    read_config("ckpt")            # the parsed config.json; one clear LayercutError if absent or invalid
    is_quantized("ckpt")           # a checkpoint directory (its config.json) ...
    is_quantized(cfg_dict)         # ... a parsed config.json, a transformers config, or a model

Quantized means: the config has a ``quantization_config`` (GPTQ, or any other method). Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from layercut.compress.core.errors import LayercutError


def read_config(path: str | os.PathLike) -> dict:
    """``path/config.json`` as a dict."""
    path = Path(path)
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise LayercutError(f"{path} has no config.json: not a Hugging Face model directory") from None
    except json.JSONDecodeError as exc:
        raise LayercutError(f"{path}/config.json is not valid JSON ({exc.msg})") from None


def is_quantized(source: str | os.PathLike | Mapping | Any) -> bool:
    """Whether ``source`` is quantized (has a ``quantization_config``): a checkpoint directory, a
    parsed ``config.json``, a transformers config, or a model (its ``.config``)."""
    if isinstance(source, (str, os.PathLike)):
        source = read_config(source)
    if isinstance(source, Mapping):
        return source.get("quantization_config") is not None
    return any(getattr(obj, "quantization_config", None) is not None for obj in (getattr(source, "config", None), source))
