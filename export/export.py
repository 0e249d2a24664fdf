"""Export a checkpoint for release: sharded safetensors + index, config, tokenizer, card.

Usage::

    layercut export runs/demo -o smollm2-demo-release                 # a run dir or a checkpoint dir
    layercut export runs/demo/04-quantize/model -o dense --dequantize  # dense weights from GPTQ
    layercut export dense/ -o gguf --format gguf --gguf-type q8_0       # llama.cpp (export/gguf.py)
    layercut export runs/demo/04-quantize/model -o ct --format compressed-tensors  # vLLM

    from layercut.export.export import export_checkpoint
    export_checkpoint("runs/demo/04-quantize/model", "release", save_dtype="fp16")

Dense inputs are loaded (in ``load_dtype``) and re-saved with ``save_pretrained``
(optionally cast to ``save_dtype``); quantized (GPTQ) inputs are copied file by file, so their bytes are what the
quantize stage wrote, or dequantized into a dense model with ``dequantize=True``. Either
way the weights end up as ``model-XXXXX-of-YYYYY.safetensors`` with a
``model.safetensors.index.json`` (also for a single shard), each file's metadata
``{"format": "pt"}``. The result is written atomically (:func:`layercut.compress.core.save.atomic_dir`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from layercut.compress.core.arch import arch_for
from layercut.compress.core.dtypes import OPTION_NAMES, option_dtype
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.hfconfig import is_quantized, read_config
from layercut.compress.core.save import atomic_dir, check_output_dir
from layercut.compress.core.shards import INDEX
from layercut.compress.core.units import check_size
from layercut.compress.depth.stream_drop import write_without_blocks
from layercut.compress.io.lazy import LazyModel, stream_blocker
from layercut.compress.io.models import load_model, resolve_model
from layercut.compress.options import torch_dtype
from layercut.compress.quant.format.loader import write_dequantized
from layercut.compress.quant.format.qlinear import QuantLinear
from layercut.export.compressed_tensors import check_ct_source, write_compressed_tensors
from layercut.export.gguf import _types, check_gguf_source, gguf_file_name, write_gguf

DTYPES = {name: option_dtype(name) for name in OPTION_NAMES}  # --save-dtype: fp32, fp16, bf16
FORMATS = ("safetensors", "gguf", "compressed-tensors")
# Files of a checkpoint that are not weights but travel with it (tokenizer, generation, GPTQ configs).
# What an export writes itself (from the run), never copied over from the input checkpoint.
_OWN_FILES = ("README.md", "report.json", "recipe.yaml")
_SIDE_SUFFIXES = (".json", ".txt", ".model", ".py", ".jinja", ".tiktoken", ".yaml", ".md", ".png")


@dataclass
class ExportResult:
    path: str
    quantized: bool
    dequantized: bool
    files: list[str]
    bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def probe_writable(target: str | os.PathLike) -> None:
    """Fail early, with one line, if ``target`` cannot be created: really try (root ignores modes)."""
    parent = Path(target).expanduser().absolute().parent
    probe = parent if parent.exists() else next((p for p in parent.parents if p.exists()), Path("/"))
    if not probe.is_dir():
        raise LayercutError(f"output parent {probe} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".layercut-probe-", dir=probe))
    except OSError as exc:
        raise LayercutError(f"output location {probe} is not writable ({exc.strerror})") from None


def export_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dequantize: bool = False,
    save_dtype: str | None = None,
    load_dtype: str = "auto",
    max_shard_size: str = "2GB",
    trust_remote_code: bool = False,
    extra_files: dict[str, str | bytes] | None = None,
    stream: bool = True,
    overwrite: bool = False,
    fmt: str = "safetensors",
    gguf_type: str | None = None,
) -> ExportResult:
    """Write ``src`` (a checkpoint dir) to ``out`` as a release checkpoint; nothing is left on failure.

    ``save_dtype`` (fp32, fp16, bf16): dtype of written dense weights; ``load_dtype``: the
    dtype a dense model is loaded in (auto: the checkpoint's own). ``fmt``: ``safetensors``,
    ``gguf`` (a dense model as ``model-<gguf_type>.gguf``, :mod:`layercut.export.gguf`) or
    ``compressed-tensors`` (a GPTQ model, :mod:`layercut.export.compressed_tensors`).
    """
    src_path = _check_inputs(src, dequantize, save_dtype, max_shard_size)
    _check_format(src_path, fmt, gguf_type, dequantize, save_dtype)
    check_output_dir(out, overwrite)
    probe_writable(out)
    if fmt != "safetensors":
        with atomic_dir(out, overwrite) as tmp:
            result = _write_other_format(src_path, tmp, fmt, gguf_type or "f16", max_shard_size, extra_files)
        result.path = str(Path(out))
        return result
    with atomic_dir(out, overwrite) as tmp:
        result = write_export_into(src_path, tmp, dequantize=dequantize, save_dtype=save_dtype,
                                   load_dtype=load_dtype, max_shard_size=max_shard_size,
                                   trust_remote_code=trust_remote_code, extra_files=extra_files, stream=stream)
    result.path = str(Path(out))
    return result


def _check_inputs(src: str | os.PathLike, dequantize: bool, dtype: str | None, max_shard_size: str) -> Path:
    path = resolve_model(src)
    quantized = is_quantized(path)
    if dequantize and not quantized:
        raise LayercutError(f"--dequantize: {path} is not quantized (no quantization_config in config.json)")
    if dtype is not None and dtype not in DTYPES:
        raise LayercutError(f"unknown save dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    if quantized and dtype is not None and not dequantize:
        raise LayercutError("--save-dtype applies to dense weights: a GPTQ checkpoint keeps its packing "
                            "(add --dequantize for dense weights in that dtype)")
    try:
        check_size(max_shard_size)
    except ValueError as exc:
        raise LayercutError(f"--max-shard-size: {exc}") from None
    return path


def _check_format(src: Path, fmt: str, gguf_type: str | None, dequantize: bool, save_dtype: str | None) -> None:
    """Refuse a format that does not fit the input or the other options, before any work."""
    if fmt not in FORMATS:
        raise LayercutError(f"unknown export format '{fmt}' (choose from {', '.join(FORMATS)})")
    if gguf_type is not None and fmt != "gguf":
        raise LayercutError("--gguf-type applies to --format gguf")
    if fmt == "safetensors":
        return
    if dequantize or save_dtype is not None:
        raise LayercutError(f"--format {fmt} writes its own tensor types: drop --dequantize / --save-dtype"
                            + (" (choose the GGUF type with --gguf-type)" if fmt == "gguf" else ""))
    config = read_config(src)
    if fmt == "gguf":
        check_gguf_source(config, src)
        _types(gguf_type or "f16")
    else:
        check_ct_source(config, src)


def _write_other_format(src: Path, folder: Path, fmt: str, gguf_type: str, max_shard_size: str,
                        extra_files: dict[str, str | bytes] | None) -> ExportResult:
    """The GGUF / compressed-tensors export into ``folder`` (a temp dir the caller moves into place)."""
    if fmt == "gguf":
        write_gguf(src, folder / gguf_file_name(gguf_type), gguf_type)
        weights = [folder / gguf_file_name(gguf_type)]
    else:
        write_compressed_tensors(src, folder, max_shard_size)
        _copy_side_files(src, folder, skip_existing=True, skip=("quantize_config.json",))
        weights = list(folder.glob("*.safetensors"))
    for name, content in (extra_files or {}).items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return ExportResult(str(folder), fmt == "compressed-tensors", False, files,
                        sum(p.stat().st_size for p in weights))


def write_export_into(
    src: Path,
    folder: Path,
    *,
    dequantize: bool = False,
    save_dtype: str | None = None,
    load_dtype: str = "auto",
    max_shard_size: str = "2GB",
    trust_remote_code: bool = False,
    extra_files: dict[str, str | bytes] | None = None,
    stream: bool = True,
) -> ExportResult:
    """The non-atomic part of :func:`export_checkpoint`, for callers that own the temp dir.

    A dense checkpoint is copied tensor by tensor (``stream``; in ``save_dtype``, else the
    load dtype), so memory holds one tensor, not the model; so is a GPTQ checkpoint under
    ``dequantize`` (one quantized linear dequantized at a time,
    :func:`layercut.compress.quant.format.loader.write_dequantized`). Models with their own modeling
    code, and ``stream=False``, load the whole model.
    """
    quantized = is_quantized(src)
    lazy = None
    if stream and not quantized and not trust_remote_code:
        if stream_blocker(src) is None:
            dtype = DTYPES[save_dtype] if save_dtype is not None else torch_dtype(load_dtype, src)
            lazy = LazyModel(src, storage_dtype=dtype)
    if quantized and not dequantize:
        _copy_checkpoint(src, folder)
    elif quantized and stream and not trust_remote_code and _streamable_quantized(src):
        # one quantized linear dequantized at a time (issue 26), the tensors of the whole-model path
        dtype = DTYPES[save_dtype] if save_dtype is not None else torch_dtype(load_dtype, src)
        write_dequantized(LazyModel(src, allow_quantized=True), folder, dtype, max_shard_size)
        _copy_side_files(src, folder, skip_existing=True, skip=("config.json", "quantize_config.json"))
    elif lazy is not None:
        write_without_blocks(lazy, folder, [], max_shard_size=max_shard_size)  # copies the side files too
        for name in _OWN_FILES:  # the run's own card, report and recipe come from extra_files, never the input
            (folder / name).unlink(missing_ok=True)
    else:
        model, tokenizer = load_model(src, dtype=torch_dtype(load_dtype, src), trust_remote_code=trust_remote_code)
        if dequantize:
            dequantize_model(model)
        if save_dtype is not None:
            model.to(DTYPES[save_dtype])
            model.config.dtype = DTYPES[save_dtype]
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(folder)
        # a dense result must not carry a GPTQ config that loaders would act on
        _copy_side_files(src, folder, skip_existing=True, skip=("quantize_config.json",) if dequantize else ())
    ensure_index(folder)
    for name, content in (extra_files or {}).items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return ExportResult(str(folder), quantized, dequantize, files, size)


def _streamable_quantized(src: Path) -> bool:
    return stream_blocker(src, quantized=True) is None


def _copy_checkpoint(src: Path, folder: Path) -> None:
    for item in sorted(src.iterdir()):
        if item.name.startswith(".") or not item.is_file() or item.name in _OWN_FILES:
            continue
        shutil.copyfile(item, folder / item.name)


def _copy_side_files(src: Path, folder: Path, skip_existing: bool, skip: tuple[str, ...] = ()) -> None:
    """Tokenizer/modeling files ``save_pretrained`` does not rewrite (never weights, never our card)."""
    for item in sorted(src.iterdir()):
        if not item.is_file() or item.name.startswith(".") or item.suffix == ".safetensors" or item.name in skip:
            continue
        if item.name in (INDEX, *_OWN_FILES) or not item.name.endswith(_SIDE_SUFFIXES):
            continue
        if skip_existing and (folder / item.name).exists():
            continue
        shutil.copyfile(item, folder / item.name)


def dequantize_model(model: nn.Module) -> int:
    """Replace every GPTQ ``QuantLinear`` by a dense layer holding its dequantized weight.

    GPT-2 style models get ``Conv1D`` back (weight stored transposed, [in, out]). Drops
    ``config.quantization_config``. Returns the number of layers replaced.
    """
    conv1d = arch_for(model).conv1d
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantLinear):
            continue
        weight = module.dequantize()  # [out, in] float32
        bias = module.bias.float() if module.bias is not None else None
        if conv1d:
            from transformers.pytorch_utils import Conv1D

            dense = Conv1D(module.out_features, module.in_features)
            dense.weight.data = weight.T.contiguous()
            dense.bias.data = bias if bias is not None else torch.zeros(module.out_features)
        else:
            dense = nn.Linear(module.in_features, module.out_features, bias=bias is not None)
            dense.weight.data = weight.contiguous()
            if bias is not None:
                dense.bias.data = bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, dense)
        count += 1
    if count == 0:
        raise LayercutError("no quantized layers found to dequantize")
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method", "hf_quantizer"):
        if getattr(model, attr, None) is not None:
            try:
                setattr(model, attr, None if attr != "is_quantized" else False)
            except AttributeError:
                pass
    return count


def ensure_index(folder: Path) -> None:
    """Give a single-file checkpoint the sharded layout: ``model-00001-of-00001`` + index."""
    single = folder / "model.safetensors"
    if (folder / INDEX).exists() or not single.exists():
        return
    shard = "model-00001-of-00001.safetensors"
    os.replace(single, folder / shard)
    header = _safetensors_header(folder / shard)
    total = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    index = {"metadata": {"total_size": total}, "weight_map": {k: shard for k in sorted(header) if k != "__metadata__"}}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(length))


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def check_pt_metadata(folder: Path) -> list[str]:
    """Weight files whose metadata lacks ``{"format": "pt"}`` (empty list when all are fine)."""
    bad = []
    for f in weight_files(folder):
        meta = _safetensors_header(f).get("__metadata__") or {}
        if meta.get("format") != "pt":
            bad.append(f.name)
    return bad
