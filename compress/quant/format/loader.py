"""layercut's own loader for GPTQ v1 checkpoints (uniform or mixed bits via ``dynamic``).

Usage::

    from layercut.compress.quant.format.loader import load_quantized
    model = load_quantized("out/q4", dtype=torch.float32, device="cpu")
    # or simply layercut.compress.io.models.load_model("out/q4"), which routes here

The model is built with its parameters on the meta device (buffers such as rotary
frequencies are computed normally), every linear that has a ``.qweight`` in the
checkpoint is swapped for a :class:`~layercut.compress.quant.format.qlinear.QuantLinear` whose bits and
group size come from ``quantization_config`` and its ``dynamic`` overrides (GPTQModel's
rule: first matching regex wins, ``-:`` means "not quantized"), the safetensors are read
one tensor at a time and assigned (``load_state_dict(assign=True)``), and tied weights are
re-tied. Works for checkpoints written by layercut and by GPTQModel (format ``gptq``).
On CPU QuantLinear runs the pure-torch reference dequant; on GPU the CUDA kernels.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from layercut.compress.core.arch import get_submodule
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.core.shards import ShardWriter, read_index
from layercut.compress.quant.format.checkpoint import LazySource, resolve_dynamic
from layercut.compress.quant.format.pack import dequantize_gptq, packed_rows
from layercut.compress.quant.format.qlinear import QuantLinear
from layercut.compress.quant.format.result import SUPPORTED_BITS


def _weight_files(path: Path) -> list[Path]:
    indexed = read_index(path)
    if indexed is not None:
        files = sorted({path / f for f in indexed.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LayercutError(f"{path}: no .safetensors weights")
    for f in files:
        if not f.is_file():
            raise LayercutError(f"{path}: index names {f.name}, which is missing")
    return files


def _read_quant_config(config) -> dict:
    qc = config.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method != "gptq":
        raise LayercutError(f"layercut loads GPTQ checkpoints; this one is quant_method={method!r}")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt != "gptq":
        raise LayercutError(f"layercut loads GPTQ v1 checkpoints (format 'gptq'); this one is {fmt!r}")
    if qc.get("bits") not in SUPPORTED_BITS:
        raise LayercutError(f"quantization_config.bits must be one of {SUPPORTED_BITS}, got {qc.get('bits')}")
    return qc


def _conv1d_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a Linear or GPT-2 Conv1D; None for anything else."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _swap_quant_linears(model: nn.Module, qc: dict, headers: dict[str, tuple[int, ...]]) -> set[str]:
    """Replace each linear with a ``.qweight`` tensor by an empty (meta) QuantLinear."""
    names = sorted(k[: -len(".qweight")] for k in headers if k.endswith(".qweight"))
    if not names:
        raise LayercutError("checkpoint has a quantization_config but no .qweight tensors")
    base_bits, base_gs = int(qc["bits"]), int(qc.get("group_size", 128))
    _check_dynamic_matches(model, qc.get("dynamic"))
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise LayercutError(f"checkpoint has quantized weights for {name}, which the model does not have") from None
        shape = _conv1d_shape(module)
        if shape is None:
            raise LayercutError(f"{name} is quantized in the checkpoint but is a {type(module).__name__}")
        in_f, out_f = shape
        over = resolve_dynamic(qc.get("dynamic"), name)
        if over is False:
            raise LayercutError(f"{name}: quantization_config.dynamic excludes it ('-:'), yet it has a qweight")
        bits = int((over or {}).get("bits", base_bits))
        gs = int((over or {}).get("group_size", base_gs))
        expected = (packed_rows(in_f, bits), out_f)
        if tuple(headers[f"{name}.qweight"]) != expected:
            raise LayercutError(
                f"{name}.qweight is {list(headers[f'{name}.qweight'])} but {bits}-bit [{in_f} -> {out_f}] needs "
                f"{list(expected)}: the quantization_config (bits / dynamic) does not match the tensors"
            )
        if bits not in SUPPORTED_BITS or (gs != -1 and (gs <= 0 or in_f % gs)):
            raise LayercutError(f"{name}: quantization_config gives it {bits} bits with group size {gs}, which "
                                f"does not fit its in_features={in_f}")
        n_groups = 1 if gs == -1 else in_f // gs
        if f"{name}.scales" in headers and tuple(headers[f"{name}.scales"]) != (n_groups, out_f):
            raise LayercutError(
                f"{name}.scales is {list(headers[f'{name}.scales'])} but group size {gs} needs {[n_groups, out_f]}: "
                "the quantization_config (group_size / dynamic) does not match the tensors"
            )
        layer = QuantLinear(in_f, out_f, bits, gs, bias=f"{name}.bias" in headers, device="meta")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return set(names)


def _check_dynamic_matches(model: nn.Module, dynamic: dict | None) -> None:
    """Every ``dynamic`` pattern must match some module: one that matches nothing is a
    typo or a checkpoint written for another numbering (e.g. before pruning), and would
    silently leave its modules at the base configuration."""
    if not dynamic:
        return
    modules = [n for n, _ in model.named_modules() if n]
    for pattern in dynamic:
        raw = pattern[2:] if pattern.startswith(("+:", "-:")) else pattern
        try:
            rx = re.compile(raw)
        except re.error as exc:
            raise LayercutError(f"quantization_config.dynamic: {pattern!r} is not a valid regex ({exc})") from None
        if not any(rx.match(n) for n in modules):
            raise LayercutError(f"quantization_config.dynamic: pattern {pattern!r} matches no module of the model "
                                "(wrong layer numbering or module names?)")


def load_quantized(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """Load a GPTQ v1 checkpoint directory into a model with :class:`QuantLinear` layers.

    Non-quantized tensors are cast to ``dtype``; packed tensors keep their stored dtypes
    (int32 codes, fp16 scales). Raises :class:`LayercutError` on a config that does not
    match the tensors, missing or unexpected tensors, or a non-GPTQ format.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    if not is_quantized(config):
        raise LayercutError(f"{path}: no quantization_config in config.json (not a GPTQ checkpoint)")
    qc = _read_quant_config(config)
    files = _weight_files(path)
    headers: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                headers[key] = tuple(fh.get_slice(key).get_shape())

    dense_config = copy.deepcopy(config)
    del dense_config.quantization_config
    dense_config.dtype = dtype
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(dense_config, dtype=dtype)
    quantized = _swap_quant_linears(model, qc, headers)

    expected = set(model.state_dict().keys())
    unexpected: list[str] = []
    for f in files:
        state = {}
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key not in expected:
                    unexpected.append(key)
                    continue
                t = fh.get_tensor(key)
                owner = key.rpartition(".")[0]
                if owner not in quantized and t.is_floating_point():
                    t = t.to(dtype)
                state[key] = t
        model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise LayercutError(f"{path}: {len(unexpected)} tensors the model does not have (e.g. {unexpected[0]})")
    model.tie_weights()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise LayercutError(f"{path}: {len(missing)} tensors missing from the checkpoint (e.g. {missing[0]})")
    model.config.quantization_config = qc
    return model.to(device).eval()


# ---------------------------------------------------------------- streaming (one block at a time)
# The block-by-block path (layercut.compress.io.lazy.LazyModel with allow_quantized=True) builds the
# skeleton itself and calls quantize_skeleton: the same per-module rule as load_quantized, applied to
# whatever module has a ``.qweight`` in the files (decoder linears, a quantized head alike).


def quantize_skeleton(
    model: nn.Module, config, shapes: dict[str, tuple[int, ...]]
) -> tuple[dict, set[str]]:
    """Swap the quantized linears of a meta skeleton (built from the dense config) for empty
    :class:`QuantLinear` layers; ``shapes`` are the stored tensors' shapes (from the headers).

    Returns (the validated ``quantization_config``, the swapped module names). Raises
    :class:`LayercutError` where the config (bits / group size / ``dynamic``) does not match
    the stored shapes, exactly as :func:`load_quantized` does.
    """
    qc = _read_quant_config(config)
    return qc, _swap_quant_linears(model, qc, shapes)


def dequantize_rows(layer: QuantLinear, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` (output features) of W [out, in] in float32, unpacked from that slice alone.

    For a head of 128k outputs, where the whole weight in float32 would be 1 GiB. ``start`` must
    be a multiple of 32 (the packed zero points of 32 outputs fill whole words at every width).
    """
    if start % 32 or not 0 <= start < stop <= layer.out_features:
        raise LayercutError(f"dequantize_rows: need 0 <= start < stop <= {layer.out_features}, start a "
                            f"multiple of 32 (got {start}, {stop})")
    b = layer.bits
    zeros = layer.qzeros[:, start * b // 32 : start * b // 32 + packed_rows(stop - start, b)]
    return dequantize_gptq(layer.qweight[:, start:stop], zeros, layer.scales[:, start:stop], layer.g_idx, b)


def write_dequantized(lazy: LazySource, folder: Path, dtype: torch.dtype, max_shard_size: str | int = "2GB") -> int:
    """Write ``lazy`` (a :class:`~layercut.compress.io.lazy.LazyModel` of a GPTQ checkpoint) into
    ``folder`` as a dense checkpoint in ``dtype``, one tensor at a time; returns the layers dequantized.

    Each quantized linear is read (its packed tensors only), dequantized to ``NAME.weight``
    (``[in, out]`` for GPT-2's Conv1D), cast and written, then released; every other stored
    tensor is cast and copied. The tensors are those of
    :func:`layercut.export.export.dequantize_model` + ``save_pretrained`` (tested); ``config.json``
    loses its ``quantization_config``. Side files are the caller's.
    """
    count = 0
    with ShardWriter(folder, max_shard_size) as writer:
        for name in lazy.model.state_dict(keep_vars=True):
            owner, _, leaf = name.rpartition(".")
            if name in lazy.tied or name not in lazy.names:
                continue  # tied aliases and computed buffers are not stored
            if owner not in lazy.quantized:
                writer.add(name, _cast(lazy.weights.get(lazy.names[name]), dtype))
            elif leaf == "qweight":
                layer = lazy.materialize(owner)
                weight = layer.dequantize()  # [out, in] float32
                writer.add(f"{owner}.weight", (weight.T if lazy.spec.conv1d else weight).to(dtype).contiguous())
                if get_submodule(lazy.model, owner).bias is not None:
                    writer.add(f"{owner}.bias", layer.bias.to(dtype))
                del weight, layer
                lazy.release(owner)
                count += 1
    config = copy.deepcopy(lazy.config)
    del config.quantization_config
    config.dtype = dtype
    config.save_pretrained(folder)
    return count


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t
