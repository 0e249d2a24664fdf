"""Remove whole decoder blocks in place and keep the config and KV-cache indices consistent.

Usage::

    from layercut.compress.depth.blocks import drop_blocks
    drop_blocks(model, [12, 13, 14])          # in place; returns the model
    model.save_pretrained(out)                # loads in stock AutoModelForCausalLM

What changes: the blocks leave the ``nn.ModuleList``; ``config.num_hidden_layers`` and
every per-layer config list (``ArchSpec.per_layer_keys``: ``layer_types`` …) are trimmed;
``max_window_layers`` — a *count* (layers with index below it use full attention in
Qwen2/Qwen3) — becomes the number of kept layers that were below it; every ``layer_idx``
attribute inside the kept blocks is renumbered, since the KV cache is indexed by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from layercut.compress.core.arch import ArchSpec, arch_for
from layercut.compress.core.errors import LayercutError

COUNT_KEYS = ("max_window_layers",)  # per-layer settings stored as a count of leading layers


def validate_layers(layers: Sequence[int], num_layers: int, what: str = "block") -> list[int]:
    """Sorted distinct indices, each in range, fewer than ``num_layers`` of them."""
    picked = sorted(set(int(i) for i in layers))
    if not picked:
        raise LayercutError(f"no {what}s to remove")
    bad = [i for i in picked if i < 0 or i >= num_layers]
    if bad:
        raise LayercutError(f"{what} index {bad[0]} out of range: the model has {num_layers} layers (0..{num_layers - 1})")
    if what == "block" and len(picked) >= num_layers:
        raise LayercutError(f"cannot remove {len(picked)} of {num_layers} blocks: at least one must remain")
    return picked


def trim_config(config, keep: Sequence[int], spec: ArchSpec) -> None:
    """Shrink per-layer config entries to the kept layer indices (in their old numbering)."""
    old_n = config.num_hidden_layers
    updates: dict = {}
    for key in spec.per_layer_keys:
        value = getattr(config, key, None)
        if value is None:
            continue
        if key in COUNT_KEYS:
            updates[key] = sum(1 for i in keep if i < int(value))
        elif isinstance(value, (list, tuple)):
            if len(value) != old_n:
                raise LayercutError(f"config.{key} has {len(value)} entries for {old_n} layers")
            updates[key] = [value[i] for i in keep]
    config.num_hidden_layers = len(keep)
    for key, value in updates.items():
        setattr(config, key, value)
    validate = getattr(config, "validate_layer_type", None)
    if callable(validate):
        validate()


def renumber_layer_idx(block: nn.Module, new_index: int) -> None:
    """Set every ``layer_idx`` attribute in ``block`` (attention modules, Gemma3 layers)."""
    for module in block.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            module.layer_idx = new_index


def check_block_drop_supported(model: nn.Module) -> None:
    config = model.config
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise LayercutError(
            "this GPT-2 config scales attention by 1/(layer_idx+1); removing blocks would change the "
            "scaling of every later block, which a stock config cannot express"
        )


def drop_blocks(model: nn.Module, layers: Sequence[int]) -> nn.Module:
    """Remove decoder blocks ``layers`` (old indices) from ``model`` in place; return it."""
    spec = arch_for(model)
    blocks = spec.layers_of(model)
    drop = set(validate_layers(layers, len(blocks)))
    check_block_drop_supported(model)
    keep = [i for i in range(len(blocks)) if i not in drop]
    for new_index, old_index in enumerate(keep):
        renumber_layer_idx(blocks[old_index], new_index)
    for index in sorted(drop, reverse=True):
        del blocks[index]  # ModuleList re-keys the rest: state-dict names follow the new numbering
    base = spec.base_of(model)
    trim_config(model.config, keep, spec)
    if getattr(base, "config", None) is not None and base.config is not model.config:
        trim_config(base.config, keep, spec)
    return model
