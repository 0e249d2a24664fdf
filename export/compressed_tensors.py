"""Convert a GPTQ v1 checkpoint (``layercut quantize``) to compressed-tensors' ``pack-quantized`` format.

Usage::

    layercut export runs/demo/03-quantize/model -o smollm2-w4-ct --format compressed-tensors

    from layercut.export.compressed_tensors import write_compressed_tensors
    write_compressed_tensors("q4/", "out-tmp/")          # a folder the caller moves into place

Each quantized linear ``NAME`` (GPTQ ``qweight``/``qzeros``/``scales``/``g_idx``) becomes:

* ``NAME.weight_packed`` int32 ``[out, ceil(in*bits/32)]``: the codes as one little-endian bit
  stream per output row. GPTQ's ``qweight`` is that same stream per output *column*, so this
  is ``qweight.T``: no code is unpacked or changed. compressed-tensors reads a field as
  ``code - 2**(bits-1)`` (signed) and the zero point the same way, so ``(q - z) * s`` is GPTQ's
  value exactly;
* ``NAME.weight_scale`` ``[out, groups]``: GPTQ's fp16 scales, transposed;
* ``NAME.weight_zero_point`` int32 ``[ceil(out*bits/32), groups]``: the true zero points (GPTQ
  v1 stores ``zero - 1``; the offset is undone as layercut's loader undoes it,
  :func:`layercut.compress.quant.format.pack.unpack_gptq`) packed along ``out``. A symmetric checkpoint
  (``sym: true``, every zero point ``2**(bits-1)``) is written symmetric, without zero points;
* ``NAME.weight_shape`` int64 ``[out, in]``; ``NAME.bias`` as stored.

Everything else (embeddings, norms, an unquantized head) is copied as stored. ``config.json``
gets a compressed-tensors ``quantization_config`` with one config group per (bits, group size)
pair (a mixed-bits checkpoint gives several), each listing its linears by full name;
strategy ``group`` (``channel`` for one group per row), ``type`` int, ``format``
``pack-quantized``. Streaming: one linear's tensors at a time through
:class:`layercut.compress.core.shards.ShardWriter`.

Refused: dense checkpoints, act-order (``desc_act``: a non-trivial ``g_idx``) and GPT-2 style
``Conv1D`` models. compressed-tensors itself reads the result back to the weights layercut
dequantizes (tested with its 0.20.1 decompressor and through transformers 5.24). For 3 bits the
fields straddle int32 words, as in compressed-tensors 0.20's dense packing (which releases before it
agree is not checked). vLLM's compressed-tensors WNA16 path serves 4 and 8 bits, with zero points
since vllm-project/vllm#14211 (from vLLM's source and that PR; not run here).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.shards import ShardWriter
from layercut.compress.io.lazy import LazyModel
from layercut.compress.quant.format.pack import pack_rows, unpack_gptq

FORMAT = "pack-quantized"


def check_ct_source(config: dict[str, Any], src: Path) -> None:
    """Refuse, before any work, a checkpoint this converter cannot write."""
    qc = config.get("quantization_config")
    if qc is None:
        raise LayercutError(f"--format compressed-tensors: {src} is a dense checkpoint; it converts GPTQ "
                            "checkpoints written by `layercut quantize` (quantize first, or use --format "
                            "safetensors / gguf for dense weights)")
    method = str(qc.get("quant_method", "")).lower()
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if method != "gptq" or fmt != "gptq":
        raise LayercutError(f"--format compressed-tensors: {src} is quant_method={method!r} format={fmt!r}; "
                            "only GPTQ v1 ('gptq') checkpoints are converted")
    if qc.get("desc_act"):
        raise LayercutError("--format compressed-tensors: act-order (desc_act) GPTQ checkpoints are not supported")


def _pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [n, m] in [0, 2**bits) -> int32 [ceil(n*bits/32), m], packed along dim 0 (GPTQ's stream)."""
    return pack_rows(codes, bits)


def convert_linear(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                   bits: int, group_size: int, sym: bool, name: str = "") -> dict[str, torch.Tensor]:
    """One GPTQ v1 linear as compressed-tensors ``pack-quantized`` tensors (see the module doc)."""
    in_f, out_f = g_idx.shape[0], scales.shape[1]
    expected = torch.zeros(in_f, dtype=torch.long) if group_size == -1 else torch.arange(in_f) // group_size
    if not torch.equal(g_idx.to(torch.long), expected):
        raise LayercutError(f"--format compressed-tensors: {name} has an act-order g_idx; not supported")
    _, zeros = unpack_gptq(qweight, qzeros, bits, in_f, out_f)  # [groups, out], v1 offset undone
    out = {"weight_packed": qweight.T.contiguous(), "weight_scale": scales.T.contiguous(),
           "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}
    if sym:
        if not bool((zeros == 1 << (bits - 1)).all()):
            raise LayercutError(f"--format compressed-tensors: {name} is marked sym but has zero points other "
                                f"than {1 << (bits - 1)}")
    else:
        out["weight_zero_point"] = _pack_stream(zeros.T.contiguous(), bits)  # [ceil(out*bits/32), groups]
    return out


def quantization_config(groups: dict[tuple[int, int], list[str]], sym: bool, ignore: list[str]) -> dict:
    """compressed-tensors' ``quantization_config``: one config group per (bits, group size)."""
    config_groups = {}
    for i, ((bits, gs), names) in enumerate(sorted(groups.items())):
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False, "actorder": None,
                   "strategy": "channel" if gs == -1 else "group", "group_size": None if gs == -1 else gs}
        config_groups[f"group_{i}"] = {"targets": sorted(names), "weights": weights, "input_activations": None,
                                       "output_activations": None, "format": FORMAT}
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": ignore, "kv_cache_scheme": None}


def write_compressed_tensors(src: str | os.PathLike, folder: str | os.PathLike, max_shard_size: str | int = "2GB",
                             progress: bool = False) -> dict[str, Any]:
    """Write the GPTQ checkpoint ``src`` into ``folder`` in compressed-tensors format (weights and
    ``config.json``; side files are the caller's). Returns ``{"layers": n, "groups": {"4g128": n, ...}}``."""
    from tqdm.auto import tqdm

    src, folder = Path(src), Path(folder)
    raw_config = json.loads((src / "config.json").read_text())
    check_ct_source(raw_config, src)
    lazy = LazyModel(src, allow_quantized=True)
    if lazy.spec.conv1d:
        raise LayercutError("--format compressed-tensors: GPT-2 style Conv1D models are not supported")
    sym = bool(lazy.quantization_config.get("sym"))
    groups: dict[tuple[int, int], list[str]] = {}
    names = [n for n in lazy.model.state_dict(keep_vars=True) if n not in lazy.tied]
    with ShardWriter(folder, max_shard_size, always_index=True) as writer:
        for name in tqdm(names, desc="compressed-tensors", unit="tensor", disable=not progress, file=sys.stderr):
            owner, _, leaf = name.rpartition(".")
            if owner not in lazy.quantized:
                if name in lazy.names:  # computed buffers (rotary tables) are not stored
                    writer.add(name, lazy.weights.get(lazy.names[name]))
                continue
            if leaf != "qweight":
                continue  # the other tensors of a quantized linear are read with its qweight
            layer = lazy.model.get_submodule(owner)
            stored = {k: lazy.weights.get(lazy.names.get(f"{owner}.{k}", f"{owner}.{k}"))
                      for k in ("qweight", "qzeros", "scales", "g_idx")}
            for key, tensor in convert_linear(**stored, bits=layer.bits, group_size=layer.group_size, sym=sym,
                                              name=owner).items():
                writer.add(f"{owner}.{key}", tensor)
            if f"{owner}.bias" in lazy.names:
                writer.add(f"{owner}.bias", lazy.weights.get(lazy.names[f"{owner}.bias"]))
            groups.setdefault((layer.bits, layer.group_size), []).append(owner)
            del stored
    out_emb = lazy.model.get_output_embeddings()
    head = next((n for n, m in lazy.model.named_modules() if m is out_emb), None)
    ignore = [] if head is None or any(head in names for names in groups.values()) else [head]
    raw_config["quantization_config"] = quantization_config(groups, sym, ignore)
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2, sort_keys=True) + "\n")
    return {"layers": sum(len(v) for v in groups.values()),
            "groups": {f"{b}g{gs}": len(v) for (b, gs), v in sorted(groups.items())}}
