"""The one dtype table: the option names (``--dtype`` / ``--save-dtype``), torch's names (as
``config.json`` writes them) and safetensors' header codes.

Usage::

    from layercut.compress.core.dtypes import option_dtype, parse_dtype, safetensors_code
    option_dtype("bf16")                  # torch.bfloat16
    parse_dtype("auto"), parse_dtype("float16")     # None, torch.float16
    option_name("bfloat16")               # "bf16" (a config.json dtype as an option name)
    safetensors_code(torch.int32)         # "I32"; safetensors_dtype("I32") -> torch.int32

Torch-free at import (``layercut --help`` reads :mod:`layercut.compress.options`, which uses it);
the functions that return torch dtypes import torch when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from layercut.compress.core.errors import LayercutError

if TYPE_CHECKING:
    import torch

Dtype = Literal["auto", "bf16", "fp16", "fp32"]  # a load/compute dtype option (auto: the checkpoint's own)
SaveDtype = Literal["bf16", "fp16", "fp32"]  # the dtype of written dense tensors

# option name -> torch's name (this order is the one error messages list)
OPTION_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

# torch's name -> safetensors' header code, in the order safetensors' ``save_file`` lays a file's
# tensors out (by dtype in this order, then by name; :class:`layercut.compress.core.shards.ShardWriter`
# follows it)
SAFETENSORS_CODES = {"int64": "I64", "float64": "F64", "float32": "F32", "int32": "I32", "bfloat16": "BF16",
                     "float16": "F16", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_FROM_CODE = {code: name for name, code in SAFETENSORS_CODES.items()}


def _torch():
    import torch

    return torch


def option_dtype(name: str) -> torch.dtype:
    """``bf16`` / ``fp16`` / ``fp32`` -> the torch dtype (KeyError for any other name)."""
    return getattr(_torch(), OPTION_NAMES[name])


def option_name(torch_name: str) -> str | None:
    """A torch dtype name (``bfloat16``, as config.json writes it) -> its option name; None if it has none."""
    return next((opt for opt, full in OPTION_NAMES.items() if full == torch_name), None)


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``auto``/``bf16``/``fp16``/``fp32`` (or ``bfloat16``/``float16``/``float32``, or a torch dtype)
    -> torch dtype; ``auto`` -> None."""
    torch = _torch()
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    full = OPTION_NAMES.get(name) or (name if name in OPTION_NAMES.values() else None)
    if full is None:
        raise LayercutError(f"unknown dtype '{name}' (choose from auto, {', '.join(sorted(OPTION_NAMES))})")
    return getattr(torch, full)


def safetensors_code(dtype: torch.dtype) -> str | None:
    """A torch dtype's safetensors header code (``F16``, ``I32``, ...); None if safetensors has none here."""
    return SAFETENSORS_CODES.get(str(dtype).removeprefix("torch."))


def safetensors_dtype(code: str) -> torch.dtype | None:
    """A safetensors header code -> the torch dtype; None for a code layercut does not read."""
    name = _FROM_CODE.get(code)
    return None if name is None else getattr(_torch(), name)
