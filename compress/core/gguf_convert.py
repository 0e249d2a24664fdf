"""Convert a GGUF file into a dense safetensors checkpoint, one tensor at a time.

Usage::

    from layercut.compress.core.gguf_convert import convert_gguf
    convert_gguf("model.Q4_1.gguf", "out/dense", dtype=torch.bfloat16)

The GGUF is memory-mapped by the ``gguf`` package's reader; each tensor is dequantized on
its own, renamed to its Hugging Face name, cast to ``dtype`` and handed to an incremental
shard writer, then released. Peak memory is one shard plus one dequantized tensor (in
float32), never a model: transformers' own ``from_pretrained(gguf_file=...)`` builds the
whole model in memory first.

The names, the tensor fix-ups (Llama's q/k row permutation, …) and the config come from
transformers' GGUF tables (``transformers.modeling_gguf_pytorch_utils``, through
:func:`gguf_tables`, which the GGUF writer :mod:`layercut.export.gguf` shares), so the output is
the same tensors transformers would build: bit for bit at ``dtype=float32``
(``tests/test_models.py`` checks it on the bundled model). Dequantized k-quant and Q4_1
values (``d * q + m`` with fp16 ``d`` and ``m``) are exact in float32 but not in bfloat16,
which is why ``auto`` converts to float32 (see :func:`layercut.compress.io.models.resolve_model`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.shards import ShardWriter


def gguf_architecture(path: str | os.PathLike) -> str:
    """The ``general.architecture`` field of a GGUF file (reads the header only)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
    except KeyError as exc:
        raise LayercutError(f"{path}: not a model GGUF (no general.architecture field)") from exc
    except Exception as exc:  # the reader raises ValueError/struct errors on a corrupt file
        raise LayercutError(f"cannot read GGUF {path}: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def check_supported(path: str | os.PathLike) -> str:
    """Refuse a GGUF whose architecture transformers has no table for, before any tensor is read."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = gguf_architecture(path)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise LayercutError(
            f"{path}: GGUF architecture '{arch}' is not supported (supported: "
            f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )
    return arch


def convert_gguf(
    gguf: str | os.PathLike,
    folder: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int = "2GB",
    progress: bool = True,
) -> None:
    """Write config, tokenizer and ``dtype`` safetensors shards for ``gguf`` into ``folder``.

    ``folder`` should be a temporary directory; the caller moves it into place.
    """
    import numpy as np
    from gguf import GGUFReader, dequantize
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf, folder = Path(gguf), Path(folder)
    arch = check_supported(gguf)
    where, name = str(gguf.parent), gguf.name
    try:
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)  # metadata only
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except Exception as exc:  # transformers raises many types on a bad GGUF
        raise LayercutError(f"cannot read GGUF {gguf}: {str(exc).splitlines()[0]}") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with torch.device("meta"):  # names only: no weights are allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    processor, name_map = gguf_tables(skeleton, arch, parsed.get("config", {}))
    del skeleton

    reader = GGUFReader(str(gguf))
    written: set[str] = set()
    with ShardWriter(folder, max_shard_size) as writer:
        for tensor in tqdm(reader.tensors, desc=f"convert {gguf.name}", unit="tensor", disable=not progress,
                           file=sys.stderr):
            weights = dequantize(tensor.data, tensor.tensor_type)  # float32 numpy, logical shape
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=name_map,
                                       parsed_parameters=parsed)
            if result.name not in name_map:
                continue  # e.g. rope frequency tables that the HF model computes itself
            hf_name = name_map[result.name]
            writer.add(hf_name, torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype))
            written.add(hf_name)
            del weights, result
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(expected - written - tied - _computed_buffers(expected))
    if missing:
        raise LayercutError(f"{gguf}: the GGUF lacks {len(missing)} tensors the model needs (e.g. {missing[0]})")
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def gguf_tables(model: torch.nn.Module, arch: str, config: dict) -> tuple[object, dict[str, str]]:
    """transformers' GGUF tables for ``arch``: its tensor processor and GGUF name -> HF name map.

    ``model`` is a (meta) skeleton whose ``state_dict`` names the tensors; ``config`` the
    GGUF-side config dict (``num_attention_heads``, ``num_key_value_heads``, ...) the processor
    reads. The one place both directions take their names from: :func:`convert_gguf` reads a
    GGUF with them, :mod:`layercut.export.gguf` writes one with the inverted map (and the
    inverse of the processor's fix-ups, checked by reading the file back through this reader).
    """
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    return processor, get_gguf_hf_weights_map(model, processor)


def _computed_buffers(names: set[str]) -> set[str]:
    """State-dict entries a model computes itself (rotary tables), never stored in a GGUF."""
    return {n for n in names if n.endswith(("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"))}
