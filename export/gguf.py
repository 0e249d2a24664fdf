"""Write a dense checkpoint as one GGUF file, tensor by tensor (llama.cpp, Ollama, LM Studio, transformers).

Usage::

    layercut export runs/demo/02-prune/model -o smollm2-gguf --format gguf            # model-f16.gguf
    layercut export pruned/ -o smollm2-q8 --format gguf --gguf-type q8_0

    from layercut.export.gguf import write_gguf
    write_gguf("pruned/", "out/model-f16.gguf", "f16")

Dense checkpoints only (a depth-pruned one is a dense one with fewer layers); a GPTQ checkpoint
is refused: export it dense with ``--dequantize`` first. Architectures: ``llama`` (SmolLM2,
Llama 2/3 without rope scaling, TinyLlama, ...); anything else is one clear error.

The file is what llama.cpp's ``convert_hf_to_gguf.py`` writes for such a checkpoint: tensor
names from the ``gguf`` package's table (through transformers' map,
:func:`layercut.compress.core.gguf_convert.gguf_tables`, shared with layercut's GGUF reader), Llama's
q/k rows permuted to llama.cpp's rotary layout (the inverse of what both readers undo), 1-D
tensors (norms, biases) in F32 and every matrix in ``gguf_type``:

* ``f16``, ``bf16``: rounded to nearest (numpy's float16 cast; the ``gguf`` package's BF16
  quantizer, ggml's own rounding);
* ``q8_0``: blocks of 32 weights with an fp16 scale, by the ``gguf`` package's reference
  quantizer (``gguf.quants.quantize``, bit-exact with ggml-quants.c per that package). A matrix
  whose rows are not a multiple of 32 falls back to f16, as in llama.cpp.

Memory: the skeleton is built on the meta device and the weights are read from the shards
one tensor at a time (:class:`layercut.compress.io.lazy.TensorIndex`), converted and appended
to the file, so the peak is about the largest tensor as stored plus its encoded copy (BF16 from
a non-bf16 source and Q8_0 are quantized from float32 in chunks of rows). The tokenizer
goes in as GGUF metadata (:mod:`layercut.export.gguf_vocab`). Readers: llama.cpp and its
front ends, transformers ``from_pretrained(folder, gguf_file=...)`` and layercut itself (both
tested on the written file; llama.cpp is not run by the tests).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.gguf_convert import gguf_tables
from layercut.compress.io.lazy import LazyModel
from layercut.export.gguf_vocab import add_tokenizer

GGUF_TYPES = ("f16", "bf16", "q8_0")
ARCHS = {"llama": "llama"}  # HF model_type -> GGUF architecture written


def gguf_file_name(gguf_type: str) -> str:
    return f"model-{gguf_type}.gguf"


def check_gguf_source(config: dict[str, Any], src: Path) -> None:
    """Refuse, before any work, what GGUF export cannot write (quantized, unmapped architecture, ...)."""
    if config.get("quantization_config") is not None:
        raise LayercutError(f"--format gguf: {src} is a GPTQ checkpoint; export it dense with --dequantize "
                            "first, then export that folder with --format gguf")
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        raise LayercutError(f"--format gguf: architecture '{model_type}' is not mapped (supported: "
                            f"{', '.join(sorted(ARCHS))})")
    if config.get("auto_map"):
        raise LayercutError(f"--format gguf: {src} has its own modeling code (auto_map); not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise LayercutError(f"--format gguf: rope scaling '{rope.get('rope_type', rope.get('type'))}' is not "
                            "supported (only the default rotary embedding)")


def _types(gguf_type: str) -> tuple[Any, Any]:
    """(matrix tensor type, file type) for ``gguf_type``."""
    from gguf import GGMLQuantizationType as Q
    from gguf import LlamaFileType as F

    if gguf_type not in GGUF_TYPES:
        raise LayercutError(f"unknown GGUF type '{gguf_type}' (choose from {', '.join(GGUF_TYPES)})")
    return {"f16": (Q.F16, F.MOSTLY_F16), "bf16": (Q.BF16, F.MOSTLY_BF16),
            "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0)}[gguf_type]


def permute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order for ``n_head`` heads: each head's two rotary halves interleaved
    (``LlamaModel.permute`` in convert_hf_to_gguf.py; transformers' reader undoes it)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _encode(t: torch.Tensor, qtype: Any, rows_per_chunk: int = 4096) -> np.ndarray:
    """``t`` (as stored: bf16, fp16 or fp32) as the array ``gguf`` writes for ``qtype``.

    F16/F32 are a direct cast (round to nearest even, as numpy's); BF16 and Q8_0 go through the
    ``gguf`` package's reference quantizer from float32, a chunk of rows at a time (blocks never
    cross rows), so the float32 copy of a large embedding is never whole. A bf16 source written as
    BF16 is its own bits (the quantizer rounds an exact bf16 value to itself)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if qtype == Q.F32:
        return t.to(torch.float32).contiguous().numpy()
    if qtype == Q.F16:
        return t.to(torch.float16).contiguous().numpy()
    if qtype == Q.BF16 and t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.uint8).numpy()
    flat = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
    chunks = [quantize(flat[i:i + rows_per_chunk].to(torch.float32).numpy(), qtype)
              for i in range(0, flat.shape[0], rows_per_chunk)]
    out = np.concatenate(chunks, axis=0) if len(chunks) > 1 else chunks[0]
    return out.reshape(*t.shape[:-1], out.shape[-1])


def _info(shape: tuple[int, ...], qtype: Any) -> tuple[tuple[int, ...], Any, int]:
    """(numpy shape, numpy dtype, bytes) of a tensor of logical ``shape`` stored as ``qtype``."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape

    count = int(np.prod(shape)) if shape else 1
    if qtype == Q.F32:
        return shape, np.float32, 4 * count
    if qtype == Q.F16:
        return shape, np.float16, 2 * count
    byte_shape = quant_shape_to_byte_shape(shape, qtype)
    return byte_shape, np.uint8, int(np.prod(byte_shape))


def _hparams(writer: Any, config: Any, name: str, file_type: Any) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    writer.add_name(name)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(text, "num_key_value_heads", None) or heads)
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(text.rms_norm_eps))
    writer.add_vocab_size(text.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(int(file_type))


def write_gguf(src: str | os.PathLike, path: str | os.PathLike, gguf_type: str = "f16",
               progress: bool = False) -> dict[str, Any]:
    """Write the dense checkpoint ``src`` as the GGUF file ``path`` (in a folder the caller moves
    into place). Returns ``{"tensors": n, "types": {gguf type name: count}}``."""
    import json

    from gguf import GGML_QUANT_VERSION, GGUFWriter
    from gguf import GGMLQuantizationType as Q
    from tqdm.auto import tqdm

    src, path = Path(src), Path(path)
    check_gguf_source(json.loads((src / "config.json").read_text()), src)
    matrix_type, file_type = _types(gguf_type)
    lazy = LazyModel(src)
    config = lazy.config
    arch = ARCHS[config.model_type]
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    _, gguf_to_hf = gguf_tables(lazy.model, arch, {"num_attention_heads": n_head, "num_key_value_heads": n_kv})
    hf_to_gguf = {hf: g for g, hf in gguf_to_hf.items()}
    plan = []  # (gguf name, checkpoint name, logical shape, type)
    for name in lazy.model.state_dict():
        if name in lazy.tied or name not in lazy.names:
            continue  # a tied head (llama.cpp reuses token_embd) and computed buffers are not stored
        if name not in hf_to_gguf:
            raise LayercutError(f"--format gguf: tensor {name} has no GGUF name for architecture '{arch}'")
        shape = tuple(lazy.weights.info(lazy.names[name])["shape"])
        qtype = Q.F32 if len(shape) < 2 else matrix_type
        if qtype == Q.Q8_0 and shape[-1] % 32:
            qtype = Q.F16  # llama.cpp's fallback for rows that are not whole Q8_0 blocks
        plan.append((hf_to_gguf[name], lazy.names[name], shape, qtype))

    writer = GGUFWriter(str(path), arch)
    _hparams(writer, config, src.resolve().name, file_type)
    if matrix_type == Q.Q8_0:
        writer.add_quantization_version(GGML_QUANT_VERSION)
    add_tokenizer(writer, src, config.vocab_size)
    for gguf_name, _, shape, qtype in plan:
        np_shape, np_dtype, nbytes = _info(shape, qtype)
        writer.add_tensor_info(gguf_name, np_shape, np.dtype(np_dtype), nbytes,
                               raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    counts: dict[str, int] = {}
    for gguf_name, stored, _, qtype in tqdm(plan, desc=f"gguf {gguf_type}", unit="tensor", disable=not progress,
                                            file=sys.stderr):
        t = lazy.weights.get(stored)  # as stored: a bf16 embedding is not upcast whole
        if ".attn_q." in gguf_name:
            t = permute_rotary(t, n_head)
        elif ".attn_k." in gguf_name:
            t = permute_rotary(t, n_kv)
        writer.write_tensor_data(_encode(t, qtype))
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        del t
    writer.close()
    return {"tensors": len(plan), "types": counts}
