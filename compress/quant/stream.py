"""GPTQ checkpoint to checkpoint with one decoder block in memory: quantize a block, write it, free it.

Usage::

    from layercut.compress.lazy import LazyModel
    from layercut.compress.quant.stream import quantize_streamed
    lazy = LazyModel("ckpt-dir")
    result, qc = quantize_streamed(lazy, calib, SolverConfig(bits=4, group_size=128), "out-tmp-dir")

The model is a :class:`layercut.compress.lazy.LazyModel`: the capture driver reads each block from
the checkpoint for its turn, :func:`layercut.compress.quant.driver.quantize_model` quantizes it in
place (Hessians per group, solved and freed at the block's turn), and the block's packed
tensors (and its unquantized ones, in ``save_dtype``) go straight to the shard writer before
the block is released; the :class:`~layercut.compress.quant.driver.QuantizeResult` keeps only each
linear's bits, shape and solve figures, never its tensors. The embeddings, final norm and
head are copied from the source at the end. The layout is the one
:func:`layercut.compress.quant.checkpoint.write_quantized_into` writes (GPTQ v1, sharded with an
index), so every loader reads both the same way.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from layercut.calibrate.capture import BlockRun
from layercut.compress.arch import target_linears
from layercut.compress.errors import LayercutError
from layercut.compress.lazy import LazyModel
from layercut.compress.quant.checkpoint import quantization_config
from layercut.compress.quant.driver import SolverConfig, quantize_model
from layercut.compress.quant.result import QuantizeResult
from layercut.export.shards import INDEX

SKIP_FILES = {"config.json", INDEX, "quantize_config.json"}


def quantize_streamed(
    lazy: LazyModel,
    calib,
    cfg: SolverConfig,
    folder: str | Path,
    bits: Mapping[str, int] | None = None,
    save_dtype: torch.dtype = torch.float16,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    max_shard_size: str | int = "2GB",
    extra_files: Mapping[str, str | bytes] | None = None,
) -> tuple[QuantizeResult, dict]:
    """Quantize ``lazy`` block by block into ``folder`` (an existing temporary directory)."""
    from layercut.export.shards import ShardWriter

    folder = Path(folder)
    writer = ShardWriter(folder, max_shard_size, always_index=True)
    result = quantize_model(lazy.model, calib, cfg, bits, batch_size=batch_size, device=device,
                            progress=progress, after_block=write_block_fn(lazy, writer, save_dtype))
    return result, write_rest(lazy, result, writer, folder, save_dtype, extra_files)


def write_block_fn(lazy: LazyModel, writer, save_dtype: torch.dtype) -> Callable[[BlockRun, QuantizeResult], None]:
    """The ``after_block`` callback: write the quantized block's tensors, then drop its packed tensors."""
    prefix = lazy.spec.layers_path()
    stored = set(lazy.names)

    def write_block(run: BlockRun, result: QuantizeResult) -> None:
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


def discard_block(run: BlockRun, result: QuantizeResult) -> None:
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


def write_rest(lazy: LazyModel, result: QuantizeResult, writer, folder: Path, save_dtype: torch.dtype,
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
