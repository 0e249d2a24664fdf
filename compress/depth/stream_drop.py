"""Drop decoder blocks checkpoint to checkpoint, one tensor at a time, never building the model.

Usage::

    from layercut.compress.depth.stream_drop import drop_blocks_streamed
    drop_blocks_streamed("src-ckpt", "out-ckpt", [12, 13, 14])

The same result as :func:`layercut.compress.depth.blocks.drop_blocks` followed by ``save_pretrained``
(the tensors of the kept blocks, renumbered, and the trimmed config), but the source is
only read tensor by tensor through :class:`layercut.compress.io.lazy.TensorIndex` and written through
:class:`layercut.compress.core.shards.ShardWriter`: peak memory is one output shard, whatever the model's
size. Tensors keep their stored dtype. The output appears under ``out`` only when
complete (:func:`layercut.compress.core.save.atomic_dir`).
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from layercut.compress.core.arch import get_submodule
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.save import atomic_dir
from layercut.compress.core.shards import INDEX, ShardWriter
from layercut.compress.depth.blocks import check_block_drop_supported, trim_config, validate_layers
from layercut.compress.depth.cores import merge_map_into_bias, merge_map_into_down
from layercut.compress.depth.replace import fit_linear_maps
from layercut.compress.io.lazy import LazyModel

WEIGHT_FILES = (".safetensors",)
SKIP_FILES = {"config.json", INDEX}


def drop_blocks_streamed(
    source: str | os.PathLike,
    output: str | os.PathLike,
    layers: Sequence[int],
    max_shard_size: str | int = "2GB",
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> dict:
    """Write ``source`` without decoder blocks ``layers`` (old indices) to ``output``; return a summary."""
    lazy = LazyModel(source, trust_remote_code=trust_remote_code)
    with atomic_dir(output, overwrite) as tmp:
        return write_without_blocks(lazy, tmp, layers, max_shard_size)


def write_without_blocks(
    lazy: LazyModel,
    folder: Path,
    layers: Sequence[int],
    max_shard_size: str | int = "2GB",
    edits: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> dict:
    """Copy ``lazy``'s checkpoint into ``folder`` (an existing temporary directory) without ``layers``.

    ``edits`` maps parameter names (old numbering) to a function of the stored tensor that
    gives the tensor to write instead (e.g. a linear map folded into a kept block).
    """
    num = lazy.num_blocks
    drop = set(validate_layers(layers, num)) if layers else set()  # none: a plain streamed copy (export)
    if drop:
        check_block_drop_supported(lazy.model)
    keep = [i for i in range(num) if i not in drop]
    new_index = {old: new for new, old in enumerate(keep)}
    prefix = lazy.spec.layers_path() + "."
    config = copy.deepcopy(lazy.config)
    trim_config(config, keep, lazy.spec)
    text_config = config.get_text_config()
    if text_config is not config:
        trim_config(text_config, keep, lazy.spec)
    edits = dict(edits or {})
    written = 0
    with ShardWriter(folder, max_shard_size) as writer:
        for name in lazy.model.state_dict(keep_vars=True):
            if name in lazy.tied or name not in lazy.names:
                continue  # tied aliases and computed buffers are not stored
            target = name
            if name.startswith(prefix):
                index, _, rest = name[len(prefix):].partition(".")
                if int(index) in drop:
                    continue
                target = f"{prefix}{new_index[int(index)]}.{rest}"
            tensor = lazy.weights.get(lazy.names[name]).to(lazy.storage_dtype)
            if name in edits:
                tensor = edits.pop(name)(tensor)
            writer.add(target, tensor)
            written += 1
        if edits:
            raise LayercutError(f"no tensor {sorted(edits)[0]} to edit in {lazy.path}")
    config.dtype = lazy.storage_dtype
    config.save_pretrained(folder)
    for file in lazy.path.iterdir():  # tokenizer, generation config, chat template, …
        if file.is_file() and file.name not in SKIP_FILES and file.suffix not in WEIGHT_FILES:
            shutil.copy2(file, folder / file.name)
    removed = sum(p.numel() for i in sorted(drop) for p in lazy.spec.layers_of(lazy.model)[i].parameters())
    return {"removed": sorted(drop), "layers_before": num, "layers_after": len(keep), "tensors": written,
            "params_after": lazy.num_params - removed}


def map_edits(lazy: LazyModel, fits: Sequence) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Fold each fitted span map into its anchor block's down projection, as tensor edits."""
    spec = lazy.spec
    edits: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for fit in fits:
        down = f"{lazy.block_path(fit.anchor)}.{spec.down_proj}"
        t = fit.t
        edits[f"{down}.weight"] = lambda w, t=t: merge_map_into_down(w, t, conv1d=spec.conv1d)
        if getattr(get_submodule(lazy.model, down), "bias", None) is not None:
            edits[f"{down}.bias"] = lambda b, t=t: merge_map_into_bias(b, t)
    return edits


def replace_streamed(
    source: str | os.PathLike,
    output: str | os.PathLike,
    layers: Sequence[int],
    calib,
    max_shard_size: str | int = "2GB",
    overwrite: bool = False,
    trust_remote_code: bool = False,
    **fit_kwargs,
) -> tuple[dict, list]:
    """Linear replacement (:func:`layercut.compress.depth.replace.linear_replace`) with one block in memory.

    The maps are fitted over the capture driver on a lazily loaded model, then folded into
    each anchor block's down projection while the checkpoint is copied tensor by tensor.
    """
    lazy = LazyModel(source, trust_remote_code=trust_remote_code)
    fits = fit_linear_maps(lazy.model, layers, calib, **fit_kwargs)
    with atomic_dir(output, overwrite) as tmp:
        summary = write_without_blocks(lazy, tmp, layers, max_shard_size, edits=map_edits(lazy, fits))
    return summary, fits
