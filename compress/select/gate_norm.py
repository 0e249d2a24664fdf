"""Gate-Norm: data-free attention-layer scores read straight from safetensors files.

Usage::

    from layercut.compress.select.gate_norm import gate_norm_scores, gate_norm_select
    g = gate_norm_scores("path/to/model")        # [L] floats, no model built, no data
    drop = gate_norm_select("path/to/model", 8)  # the 8 attention layers with the lowest G

    layercut score MODEL --method gate-norm --drop 8 --json

G_l = sqrt(Σ_h ‖W_Q,h W_K,g(h)ᵀ‖_F²) (the norm, not its square; see
:func:`layercut.compress.select.cores.gate_norm_qk`), per head with the key head shared under GQA.
Only the q and k projections are read: one layer at a time through ``safe_open`` (single
file or sharded with an index), converted to float32 on the fly, while a background thread
already reads the next layer — so the Gram products overlap the disk reads. Separate
q/k projections (Llama, Mistral, Qwen, Gemma) and fused ones (Phi3 ``qkv_proj``, GPT-NeoX
``query_key_value`` interleaved per head, GPT-2 ``c_attn`` Conv1D) are handled; head counts
come from config.json. Gemma3/Qwen3 q/k RMSNorms are not folded in (raw weights only).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from layercut.compress.core.arch import ArchSpec, arch_for, get_submodule, spec_for_model_type
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.shards import weight_map
from layercut.compress.io.models import resolve_model
from layercut.compress.select.cores import gate_norm_qk, lowest, split_fused_qkv

FUSED_LAYOUTS = {"phi3": "stacked", "gpt_neox": "neox", "gpt2": "conv1d"}  # by ArchSpec.family


def head_counts(config: dict) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim) from a config dict (text_config when nested)."""
    if "num_attention_heads" not in config and "n_head" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd")
    if not heads or not hidden:
        raise LayercutError("config.json has no num_attention_heads / hidden_size: cannot split heads")
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return int(heads), int(kv), int(head_dim)


def _spec_from_config(config: dict) -> ArchSpec:
    model_type = config.get("model_type", "")
    if model_type not in ("", None) and spec_for_model_type(model_type) is None and "text_config" in config:
        model_type = config["text_config"].get("model_type", model_type)
    spec = spec_for_model_type(model_type)
    if spec is None:  # generic fallback: Llama-style names
        spec = spec_for_model_type("llama")
    return spec


def _weight_map(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file (index when sharded, else every header)."""
    return {name: model_dir / file for name, file in weight_map(model_dir).items()}


def _layer_keys(names: list[str], spec: ArchSpec, leaf: str) -> dict[int, str]:
    """Layer index -> tensor name of ``<layers>.<i>.<leaf>.weight``, one prefix only."""
    pattern = re.compile(rf"^(.*?){re.escape(spec.layers)}\.(\d+)\.{re.escape(leaf)}\.weight$")
    by_prefix: dict[str, dict[int, str]] = {}
    for name in names:
        match = pattern.match(name)
        if match:
            by_prefix.setdefault(match.group(1), {})[int(match.group(2))] = name
    preferred = f"{spec.base}." if spec.base else ""  # e.g. "model." of "model.layers.3..."
    if preferred in by_prefix:
        return by_prefix[preferred]
    if len(by_prefix) > 1:
        raise LayercutError(f"ambiguous attention weights: several layer stacks {sorted(by_prefix)} hold '{leaf}'")
    return next(iter(by_prefix.values()), {})


class _Reader:
    """Open safetensors handles, one per file, read by a single background thread."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.handles: dict[Path, object] = {}

    def get(self, file: Path, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if file not in self.handles:
            if not file.is_file():
                raise LayercutError(f"missing shard {file}")
            self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
        return self.handles[file].get_tensor(name).float()  # bf16/fp16 -> fp32 on the fly

    def close(self) -> None:
        self.stack.close()


def iter_qk(model_dir: str | Path) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """(w_q [H·d_h, d], w_k [H_kv·d_h, d], H, H_kv) per layer, float32, read one layer ahead."""
    path = resolve_model(model_dir)
    config = json.loads((path / "config.json").read_text())
    spec = _spec_from_config(config)
    heads, kv_heads, head_dim = head_counts(config)
    where = _weight_map(path)
    names = list(where)
    layout = FUSED_LAYOUTS.get(spec.family) if spec.fused_qkv else None
    if layout:
        fused = _layer_keys(names, spec, spec.fused_qkv)
        index, layers = sorted(fused), [(fused[i],) for i in sorted(fused)]
    else:
        q_keys, k_keys = _layer_keys(names, spec, spec.q_proj), _layer_keys(names, spec, spec.k_proj)
        if sorted(q_keys) != sorted(k_keys):
            raise LayercutError(f"{path}: q and k projections found for different layers")
        index, layers = sorted(q_keys), [(q_keys[i], k_keys[i]) for i in sorted(q_keys)]
    if not layers:
        raise LayercutError(
            f"{path}: no dense attention q/k weights found ({spec.family} names; a quantized checkpoint "
            "has no .weight to score)"
        )
    if index != list(range(len(layers))):
        raise LayercutError(f"{path}: attention layers are not numbered 0..{len(layers) - 1}")

    reader = _Reader()

    def load(keys: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if layout:
            return split_fused_qkv(reader.get(where[keys[0]], keys[0]), layout, heads, kv_heads, head_dim)
        return reader.get(where[keys[0]], keys[0]), reader.get(where[keys[1]], keys[1])

    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(load, layers[0])
            for i in range(len(layers)):
                w_q, w_k = pending.result()
                if i + 1 < len(layers):
                    pending = pool.submit(load, layers[i + 1])  # read ahead while this layer computes
                yield w_q, w_k, heads, kv_heads
    finally:
        reader.close()


def gate_norm_scores(model_dir: str | Path) -> list[float]:
    """G_l per attention layer from the checkpoint files alone (no model, no data)."""
    try:
        return [gate_norm_qk(q, k, h, kv) for q, k, h, kv in iter_qk(model_dir)]
    except ValueError as exc:  # shape mismatch between config.json and the tensors
        raise LayercutError(f"{model_dir}: {exc}") from exc


def gate_norm_select(model_dir: str | Path, k: int) -> list[int]:
    """The k attention layers with the lowest G, ascending."""
    scores = gate_norm_scores(model_dir)
    if k < 1 or k >= len(scores):
        raise LayercutError(f"cannot drop {k} attention layers of {len(scores)}: need 1 <= k <= {len(scores) - 1}")
    return lowest(scores, k)


@torch.no_grad()
def gate_norm_from_model(model: nn.Module) -> list[float]:
    """The same scores from an in-memory model's weights (located through the arch table)."""
    spec = arch_for(model)
    heads, kv_heads, head_dim = head_counts(model.config.to_dict())
    layout = FUSED_LAYOUTS.get(spec.family) if spec.fused_qkv else None
    out = []
    for block in spec.layers_of(model):
        if layout:
            w = get_submodule(block, spec.fused_qkv).weight
            w_q, w_k = split_fused_qkv(w, layout, heads, kv_heads, head_dim)
        else:
            w_q, w_k = get_submodule(block, spec.q_proj).weight, get_submodule(block, spec.k_proj).weight
        out.append(gate_norm_qk(w_q, w_k, heads, kv_heads))
    return out
