"""Streamed GPTQ writing, one decoder block in memory: the quantize driver's ``after_block``
callback writes a block's packed tensors (and its unquantized ones, in ``save_dtype``) to the
shard writer before the block is released, and :func:`write_rest` copies the embeddings, final
norm and head from the source at the end. ``lazy`` is a :class:`layercut.compress.io.lazy.LazyModel`
and ``run`` a :class:`layercut.calibrate.capture.BlockRun` (this layer imports neither). The layout
is the one :func:`layercut.compress.quant.format.checkpoint.write_quantized_into` writes (GPTQ v1,
sharded with an index), so every loader reads both the same way.
"""
from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from layercut.compress.core.arch import target_linears
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.shards import INDEX
from layercut.compress.quant.format.checkpoint import quantization_config
from layercut.compress.quant.format.result import QuantizeResult

SKIP_FILES = {"config.json", INDEX, "quantize_config.json"}


def write_block_fn(lazy, writer, save_dtype: torch.dtype) -> Callable:
    """The ``after_block`` callback: write the quantized block's tensors, then drop its packed tensors."""
    prefix = lazy.spec.layers_path()
    stored = set(lazy.names)

    def write_block(run, result: QuantizeResult) -> None:
        block_prefix = f"{prefix}.{run.index}."
        quantized = {n[len(block_prefix):]: n for n in result.layers if n.startswith(block_prefix)}
        for name, tensor in run.block.state_dict().items():
            full = block_prefix + name
            module, _, leaf = name.rpartition(".")
            if full not in stored:
                continue  # computed buffers
            if module in quantized:
                if leaf == "bias":
                    writer.add(full, tensor.to(torch.float16))
                continue  # the dense weight is replaced by the packed tensors below
            writer.add(full, tensor.to(save_dtype) if tensor.is_floating_point() else tensor)
        for full in quantized.values():
            ql = result.layers[full]
            for leaf, t in ql.tensors.items():
                writer.add(f"{full}.{leaf}", t)
            ql.tensors = {}  # written: keep only the figures

    return write_block


def discard_block(run, result: QuantizeResult) -> None:
    """The ``after_block`` callback of a process that writes nothing (a torchrun rank other than 0):
    drop the packed tensors, as :func:`write_block_fn` does once they are written."""
    for ql in result.layers.values():
        ql.tensors = {}


def cast_in_place(tensor: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 22) -> torch.Tensor:
    """``tensor.to(dtype)``, converted inside ``tensor``'s own buffer when both dtypes have one
    element size (bf16 ↔ fp16: a 128k-vocabulary embedding is not held twice); ``tensor``
    (contiguous, owned by the caller) is garbage afterwards. Other dtypes: a plain ``.to``."""
    if tensor.dtype == dtype or tensor.element_size() != torch.empty((), dtype=dtype).element_size() \
            or not tensor.is_contiguous():
        return tensor.to(dtype)
    src, dst = tensor.reshape(-1), tensor.reshape(-1).view(dtype)
    for i in range(0, src.numel(), chunk):  # each slice is read whole before it is overwritten
        dst[i : i + chunk] = src[i : i + chunk].to(dtype)
    return dst.view(tensor.shape)


def write_rest(lazy, result: QuantizeResult, writer, folder: Path, save_dtype: torch.dtype,
               extra_files: Mapping[str, str | bytes] | None = None) -> dict:
    """After the last block: the non-block tensors, the index, config and side files; returns the
    ``quantization_config``."""
    prefix = lazy.spec.layers_path()
    missing = [n for _, _, n, _ in target_linears(lazy.model) if n not in result.layers]
    if missing:
        raise LayercutError(f"quantize: {len(missing)} linears were not quantized (e.g. {missing[0]})")
    head = result.head  # a quantized head: its packed tensors (and an fp16 bias) replace its weight
    for name in lazy.model.state_dict(keep_vars=True):  # embeddings, final norm, head (not tied aliases)
        if name.startswith(prefix + ".") or name in lazy.tied or name not in lazy.names:
            continue
        if head is not None and name.rpartition(".")[0] == head:
            if name.endswith(".bias"):
                writer.add(name, lazy.weights.get(lazy.names[name]).to(torch.float16))
            continue
        tensor = lazy.weights.get(lazy.names[name])  # a fresh buffer, ours to overwrite
        writer.add(name, cast_in_place(tensor, save_dtype) if tensor.is_floating_point() else tensor)
        del tensor
    if head is not None:
        for leaf, t in result.layers[head].tensors.items():
            writer.add(f"{head}.{leaf}", t)
        result.layers[head].tensors = {}  # written: keep only the figures
    writer.close()
    qc = quantization_config(lazy.model, result)
    config = copy.deepcopy(lazy.config)
    config.quantization_config = qc
    config.dtype = save_dtype
    config.save_pretrained(folder)
    (folder / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    for file in lazy.path.iterdir():  # tokenizer, generation config, chat template, …
        if file.is_file() and file.name not in SKIP_FILES and file.suffix != ".safetensors":
            shutil.copy2(file, folder / file.name)
    for name, content in (extra_files or {}).items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return qc
