"""Write GPTQ v1 checkpoints that stock transformers (uniform bits), GPTQModel and layercut load
(tested); vLLM is the format's documented consumer, untested here.

Usage::

    from layercut.compress.quant.format.checkpoint import save_quantized
    cfg = build_plan(QuantizeConfig(bits=4, group_size=64), model).solver   # compress/quant/plan.py
    result = quantize_model(model, calib, cfg)
    save_quantized(model, tokenizer, result, "out/q4")

    # or streamed, one decoder block in memory (what `layercut quantize` does on a checkpoint):
    writer = ShardWriter(tmp, "2GB", always_index=True)
    result = quantize_model(lazy.model, calib, cfg, after_block=write_block_fn(lazy, writer, torch.float16))
    write_rest(lazy, result, writer, tmp, torch.float16)

The one GPTQ writer: both paths store what :func:`stored_tensors` and :func:`packed_tensors`
decide and write their configs with :func:`write_config_files` (the whole-model shards are laid
out as safetensors' ``save_file`` lays out a file, the streamed ones in the order the tensors
arrive; the tensors, config.json and quantize_config.json are the same, tested).

Layout: every quantized linear ``NAME`` is stored as ``NAME.qweight`` / ``.qzeros`` /
``.scales`` (fp16) / ``.g_idx`` (+ ``.bias`` in fp16), exactly as
:func:`layercut.compress.quant.format.pack.pack_gptq` packs it; every other tensor (embeddings, norms,
an untied head) in ``dtype`` (default float16, the GPTQ convention); tied copies are not
stored. Shards ``model-0000i-of-0000n.safetensors`` with metadata ``{"format": "pt"}``
and ``model.safetensors.index.json`` (also for one shard), written atomically by
:class:`layercut.compress.core.shards.ShardWriter` (the one shard writer; each shard laid out as safetensors'
``save_file`` lays out a file).

``config.json`` gets a ``quantization_config`` (also written as ``quantize_config.json``)::

    {"quant_method": "gptq", "checkpoint_format": "gptq", "format": "gptq", "bits": 4,
     "group_size": 64, "desc_act": false, "sym": false, "true_sequential": false,
     "damp_percent": 0.01, "static_groups": false, "lm_head": false, "pack_dtype": "int32",
     "block_name_to_quantize": "model.layers",
     "dynamic": {"+:model\\.layers\\.3\\..*": {"bits": 8, "group_size": 64}, ...}}

``bits`` / ``group_size`` are the base: the pair most weights of the decoder blocks have. A
quantized output head (``quantize_model(..., head=...)``) sets ``"lm_head": true`` and, if its
pair differs from the base, gets its own entry ``"+:lm_head$": {"bits": 8, "group_size": 128}``
and is listed in ``modules_in_block_to_quantize``. GPTQModel 7.6.0 and layercut load such a
checkpoint (tested); stock transformers does not (it initialises a random dense head, tested), so
the card's usage snippet is GPTQModel's. ``dynamic`` holds
GPTQModel's per-module overrides of both (omitted when every linear has the base pair, so
a uniform checkpoint loads in stock transformers): keys are regexes that GPTQModel (PCRE) matches, and vLLM (``re``; documented, untested here) would match, from the start
of a module's full name, ``+:`` marking a positive override. They are written in the
model's current layer numbering — after pruning, that is the final one. A whole layer at
other bits is ``+:model\\.layers\\.3\\..*``; a fused group is e.g.
``+:model\\.layers\\.3\\.self_attn\\.(q_proj|k_proj|v_proj|qkv_proj)$`` — vLLM's fused
module name is added so servers that fuse q/k/v (``qkv_proj``) match it too (untested).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from layercut.compress.core.arch import ArchSpec, arch_for, target_linears
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.save import atomic_dir
from layercut.compress.core.shards import INDEX, ShardWriter
from layercut.compress.quant.format.result import QuantizeResult

# meta.quantizer: who wrote it, and whose v1 packing convention it follows. GPTQModel refuses
# to load *asymmetric* v1 checkpoints unless a "gptqmodel:>=0.9" entry vouches that zero
# points were stored with its (post-0.9) offset handling; compress/quant/format/pack.py is bit-exact
# with GPTQModel 7.6.0's packer (tests/test_pack.py), so the entry is declared.
PACKING_COMPAT = "gptqmodel:7.6.0"
# files of a source checkpoint that a streamed write does not copy (it writes its own)
SKIP_FILES = {"config.json", INDEX, "quantize_config.json"}


def _quantizer_tags() -> list[str]:
    try:
        own = f"layercut:{version('layercut')}"
    except PackageNotFoundError:
        own = "layercut:unknown"
    return [own, PACKING_COMPAT]


def _fused_name(paths: tuple[str, ...]) -> str | None:
    """vLLM's fused module name for a group (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    if len(paths) < 2:
        return None
    parents = {p.rpartition(".")[0] for p in paths}
    leaves = [p.rpartition(".")[2] for p in paths]
    if len(parents) != 1 or not all(leaf.endswith("_proj") for leaf in leaves):
        return None
    stems = [leaf[: -len("_proj")] for leaf in leaves]
    joined = "".join(stems) if all(len(s) == 1 for s in stems) else "_".join(stems)
    return f"{parents.pop()}.{joined}_proj"


def _alternation(names: list[str]) -> str:
    """Regex for exactly these dotted names: ``mlp\\.(gate_proj|up_proj|gate_up_proj)``."""
    parents = {n.rpartition(".")[0] for n in names}
    if len(names) == 1:
        return re.escape(names[0])
    if len(parents) == 1 and parents != {""}:
        parent = parents.pop()
        return re.escape(parent) + "\\.(" + "|".join(re.escape(n.rpartition(".")[2]) for n in names) + ")"
    return "(" + "|".join(re.escape(n) for n in names) + ")"


def dynamic_overrides(
    model: nn.Module,
    bits: Mapping[str, int | tuple[int, int]],
    base_bits: int | tuple[int, int],
    group_size: int | None = None,
) -> dict:
    """GPTQModel ``dynamic`` entries for every linear whose (bits, group size) differs from the base.

    ``bits`` maps full linear names (all target linears) to a width (at ``group_size``) or
    to a (bits, group size) pair; ``base_bits`` is the base width (at ``group_size``) or
    pair. Every entry carries both ``bits`` and ``group_size``. A decoder layer whose
    linears all share one non-base pair gets one layer regex; otherwise each differing
    fused group gets its own. Raises if a fused group mixes configurations.
    """
    def pair(v) -> tuple[int, int]:
        if isinstance(v, (tuple, list)):
            return int(v[0]), int(v[1])
        if group_size is None:
            raise LayercutError("dynamic_overrides: bare bits need group_size")
        return int(v), int(group_size)

    base = pair(base_bits)
    spec = arch_for(model)
    prefix = re.escape(spec.layers_path())
    out: dict[str, dict] = {}
    for i, _block in enumerate(spec.layers_of(model)):
        group_cfg = []
        for group in spec.groups:
            pairs = {pair(bits[f"{spec.layers_path()}.{i}.{p}"]) for p in group}
            if len(pairs) != 1:
                raise LayercutError(f"quantize: layer {i} group {group} mixes bit widths / group sizes "
                                    f"{sorted(pairs)}; fused projections must share one configuration")
            group_cfg.append(pairs.pop())
        if len(set(group_cfg)) == 1:
            if group_cfg[0] != base:
                out[f"+:{prefix}\\.{i}\\..*"] = {"bits": group_cfg[0][0], "group_size": group_cfg[0][1]}
            continue
        for group, c in zip(spec.groups, group_cfg):
            if c == base:
                continue
            names = list(group) + ([_fused_name(group)] if _fused_name(group) else [])
            body = _alternation(names)
            out[f"+:{prefix}\\.{i}\\.{body}$"] = {"bits": c[0], "group_size": c[1]}
    return out


def resolve_dynamic(dynamic: Mapping[str, Mapping] | None, name: str) -> Mapping | bool | None:
    """GPTQModel's rule: the first pattern that ``re.match``-es ``name`` wins; ``-:`` → False
    (not quantized), ``+:``/bare → its overrides; no match → None."""
    for pattern, overrides in (dynamic or {}).items():
        negative = pattern.startswith("-:")
        raw = pattern[2:] if pattern.startswith(("+:", "-:")) else pattern
        if re.match(raw, name):
            return False if negative else overrides
    return None


def quantization_config(model: nn.Module, result: QuantizeResult) -> dict:
    """The ``quantization_config`` dict for a quantized model (see module doc)."""
    cfg = result.config
    bits = result.bits()
    if not bits:
        raise LayercutError("quantize: nothing was quantized")
    counts: Counter[tuple[int, int]] = Counter()
    for q in result.body().values():  # the base is the blocks' pair; a quantized head may differ
        counts[(q.bits, q.group_size)] += q.in_features * q.out_features
    # the (bits, group size) most weights have; ties: fewer bits, then the larger group size
    base = max(counts, key=lambda c: (counts[c], -c[0], c[1] == -1, c[1]))
    spec = arch_for(model)
    qc = {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "format": "gptq",
        "bits": base[0],
        "group_size": base[1],
        "desc_act": cfg.act_order and not cfg.static_groups,  # static groups keep g_idx = i // gs
        "sym": cfg.sym,
        "true_sequential": cfg.sequential != "block",
        "damp_percent": cfg.damp,
        "static_groups": cfg.static_groups,
        "lm_head": result.head is not None,
        "pack_dtype": "int32",
        "block_name_to_quantize": spec.layers_path(),
        # + the head's name when it is quantized: vLLM treats a module as quantized only if some
        # entry is a substring of its name (documented in vLLM's gptq_utils; untested here)
        "modules_in_block_to_quantize": [list(g) for g in spec.groups] + ([[result.head]] if result.head else []),
        "meta": {"quantizer": _quantizer_tags(), "method": cfg.method, "sequential": cfg.sequential},
    }
    dynamic = dynamic_overrides(model, result.configs(), base)
    dynamic.update(head_override(result, base))
    if dynamic:
        qc["dynamic"] = dynamic
    return qc


def head_override(result: QuantizeResult, base: tuple[int, int]) -> dict:
    """The ``dynamic`` entry of a quantized head whose (bits, group size) differs from the base:
    ``{"+:lm_head$": {"bits": 8, "group_size": 128}}`` (GPTQModel reads a quantized head only with
    ``lm_head: true`` and takes its bits from ``dynamic`` like any module's); {} otherwise."""
    if result.head is None:
        return {}
    q = result.layers[result.head]
    if (q.bits, q.group_size) == tuple(base):
        return {}
    return {f"+:{re.escape(result.head)}$": {"bits": q.bits, "group_size": q.group_size}}


# ---------------------------------------------------------------------------------- the writer
# One set of rules for both paths: the whole model in memory (save_quantized / write_quantized_into)
# and one decoder block at a time during a streamed quantize (write_block_fn per block, then
# write_rest). stored_tensors decides what a dense tensor becomes, packed_tensors names the packed
# ones, checked_quantization_config checks and builds the config, write_config_files writes
# config.json, quantize_config.json and the side files; every tensor goes through ShardWriter.


class LazySource(Protocol):
    """The lazily loaded checkpoint the streamed writer (and the streamed dequantizer,
    :func:`layercut.compress.quant.format.loader.write_dequantized`) reads: the interface of
    :class:`layercut.compress.io.lazy.LazyModel`, a layer above this one (so not imported here)."""

    path: Path
    config: Any
    model: nn.Module
    spec: ArchSpec
    weights: Any  # a TensorIndex: ``.get(name)`` reads one stored tensor into its own buffer
    names: Mapping[str, str]  # model parameter name -> checkpoint tensor name
    tied: Mapping[str, str]  # tied aliases the checkpoint does not store
    quantized: set[str]  # module paths of QuantLinear layers (a GPTQ source)

    def materialize(self, path: str, dtype: torch.dtype | None = None) -> nn.Module: ...

    def release(self, path: str) -> None: ...


def stored_tensors(names: Iterable[str], read: Callable[[str], Tensor], quantized: Container[str],
                   dtype: torch.dtype, owned: bool = False) -> Iterator[tuple[str, Tensor]]:
    """The stored form of the dense tensors ``names`` (``read(name)`` gives each, read only when it
    is stored): a quantized module's weight is dropped (its packed tensors replace it) and its bias
    stored in fp16; every other floating tensor in ``dtype``, the rest as they are. ``owned``:
    ``read`` returns fresh buffers, converted in place where the element size allows
    (:func:`cast_in_place`). Yields one tensor at a time."""
    for name in names:
        module, _, leaf = name.rpartition(".")
        if module in quantized:
            if leaf == "bias":
                yield name, read(name).to(torch.float16)
            continue  # the dense weight is replaced by the packed tensors
        tensor = read(name)
        if tensor.is_floating_point():
            tensor = cast_in_place(tensor, dtype) if owned else tensor.to(dtype)
        yield name, tensor
        del tensor  # released before the next one is read


def packed_tensors(result: QuantizeResult, names: Iterable[str], release: bool = False) -> Iterator[tuple[str, Tensor]]:
    """``NAME.qweight`` / ``.qzeros`` / ``.scales`` / ``.g_idx`` of the quantized linears ``names``, as
    packed; ``release``: drop each layer's packed tensors once yielded (the figures stay)."""
    for name in names:
        ql = result.layers[name]
        for leaf, t in ql.tensors.items():
            yield f"{name}.{leaf}", t
        if release:
            ql.tensors = {}  # written: keep only the figures


def _add_all(writer: ShardWriter, tensors: Iterable[tuple[str, Tensor]]) -> None:
    for name, tensor in tensors:
        writer.add(name, tensor)
        del tensor  # one tensor alive at a time


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


def checked_quantization_config(model: nn.Module, result: QuantizeResult) -> dict:
    """:func:`quantization_config`, after checking that every target linear was quantized."""
    missing = [n for _, _, n, _ in target_linears(model) if n not in result.layers]
    if missing:
        raise LayercutError(f"quantize: {len(missing)} linears were not quantized (e.g. {missing[0]})")
    return quantization_config(model, result)


def write_config_files(folder: Path, config, qc: dict, dtype: torch.dtype, *, tokenizer=None,
                       generation_config=None, copy_from: Path | None = None,
                       extra_files: Mapping[str, str | bytes] | None = None) -> None:
    """``config.json`` (a copy of ``config`` with ``qc`` as its ``quantization_config`` and ``dtype``),
    ``quantize_config.json``, then the side files: ``generation_config`` and ``tokenizer`` saved, or
    (``copy_from``, a source checkpoint) every file there but its weights, index and configs;
    ``extra_files`` (name -> content) last."""
    config = copy.deepcopy(config)
    config.quantization_config = qc
    config.dtype = dtype
    config.save_pretrained(folder)
    (folder / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if copy_from is not None:
        for file in copy_from.iterdir():  # tokenizer, generation config, chat template, …
            if file.is_file() and file.name not in SKIP_FILES and file.suffix != ".safetensors":
                shutil.copy2(file, folder / file.name)
    for name, content in (extra_files or {}).items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())


# ---------------------------------------------------------------- the whole model in memory


def _tied_keys(model: nn.Module) -> set[str]:
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "get_expanded_tied_weights_keys"):
        return set(model.get_expanded_tied_weights_keys(all_submodels=True))
    return set()


def quantized_state_dict(model: nn.Module, result: QuantizeResult, dtype: torch.dtype) -> dict[str, Tensor]:
    """Tensors to store: packed GPTQ tensors for quantized linears, the rest in ``dtype``; in the
    model's state-dict order, the packed tensors last (the order the shards are split in)."""
    tied = _tied_keys(model)
    params = model.state_dict()
    names = [k for k in params if k not in tied]
    state = {k: t.contiguous().clone()
             for k, t in stored_tensors(names, lambda k: params[k].detach(), result.layers, dtype)}
    for key, t in packed_tensors(result, result.layers):
        state[key] = t.detach().cpu().contiguous().clone()  # safetensors refuses shared storage
    return state


def write_quantized_into(
    model: nn.Module,
    tokenizer,
    result: QuantizeResult,
    folder: Path,
    dtype: torch.dtype = torch.float16,
    max_shard_size: str | int = "2GB",
    extra_files: Mapping[str, str | bytes] | None = None,
) -> dict:
    """Non-atomic part of :func:`save_quantized`; returns the ``quantization_config``."""
    from huggingface_hub import split_torch_state_dict_into_shards

    qc = checked_quantization_config(model, result)
    state = quantized_state_dict(model, result, dtype)
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    # Hub's grouping, each shard laid out as save_file would; model-0000i-of-0000n + index even for one shard
    writer = ShardWriter(folder, always_index=True)
    try:
        for keys in split.filename_to_tensors.values():
            writer.add_shard({k: state[k] for k in keys})
        writer.close()
    except BaseException:
        writer.abort()
        raise
    write_config_files(folder, model.config, qc, dtype, tokenizer=tokenizer,
                       generation_config=getattr(model, "generation_config", None), extra_files=extra_files)
    return qc


def save_quantized(
    model: nn.Module,
    tokenizer,
    result: QuantizeResult,
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float16,
    max_shard_size: str | int = "2GB",
    overwrite: bool = False,
    extra_files: Mapping[str, str | bytes] | None = None,
) -> Path:
    """Write ``model`` (after :func:`~layercut.compress.quant.solve.driver.quantize_model`) as a GPTQ v1
    checkpoint at ``path``, atomically (nothing appears under ``path`` on failure)."""
    with atomic_dir(path, overwrite) as tmp:
        write_quantized_into(model, tokenizer, result, tmp, dtype, max_shard_size, extra_files)
    return Path(path)


# ------------------------------------------------------------ streamed: one block in memory
# The quantize driver's ``after_block`` callback writes a block's packed tensors (and its unquantized
# ones, in ``save_dtype``) to the shard writer before the block is released; write_rest copies the
# embeddings, final norm and head from the source at the end. ``run`` is a
# :class:`layercut.calibrate.capture.BlockRun` (a layer above: not imported here).


def write_block_fn(lazy: LazySource, writer: ShardWriter, save_dtype: torch.dtype) -> Callable:
    """The ``after_block`` callback: write the quantized block's tensors, then drop its packed tensors."""
    prefix = lazy.spec.layers_path()
    stored = set(lazy.names)

    def write_block(run, result: QuantizeResult) -> None:
        block_prefix = f"{prefix}.{run.index}."
        state = run.block.state_dict()
        names = [block_prefix + k for k in state if block_prefix + k in stored]  # not computed buffers
        _add_all(writer, stored_tensors(names, lambda full: state[full[len(block_prefix):]], result.layers,
                                        save_dtype))
        _add_all(writer, packed_tensors(result, [n for n in result.layers if n.startswith(block_prefix)],
                                        release=True))

    return write_block


def discard_block(run, result: QuantizeResult) -> None:
    """The ``after_block`` callback of a process that writes nothing (a torchrun rank other than 0):
    drop the packed tensors, as :func:`write_block_fn` does once they are written."""
    for ql in result.layers.values():
        ql.tensors = {}


def write_rest(lazy: LazySource, result: QuantizeResult, writer: ShardWriter, folder: Path, save_dtype: torch.dtype,
               extra_files: Mapping[str, str | bytes] | None = None) -> dict:
    """After the last block: the non-block tensors (embeddings, final norm, head: a quantized head's
    packed tensors), the index, config and side files; returns the ``quantization_config``."""
    qc = checked_quantization_config(lazy.model, result)
    prefix = lazy.spec.layers_path() + "."
    names = [n for n in lazy.model.state_dict(keep_vars=True)  # not tied aliases, not computed buffers
             if not n.startswith(prefix) and n not in lazy.tied and n in lazy.names]
    _add_all(writer, stored_tensors(names, lambda n: lazy.weights.get(lazy.names[n]), result.layers, save_dtype,
                                    owned=True))
    if result.head is not None:
        _add_all(writer, packed_tensors(result, [result.head], release=True))
    writer.close()
    write_config_files(folder, lazy.config, qc, save_dtype, copy_from=lazy.path, extra_files=extra_files)
    return qc
