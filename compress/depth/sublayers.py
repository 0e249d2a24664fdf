"""Remove attention or MLP sublayers (LLM-Drop) and ship the modeling file that can load it.

Usage::

    from layercut.compress.depth.sublayers import drop_sublayers, sublayer_readme
    pruned = drop_sublayers(model, [4, 7, 9], what="attention")   # a new model sharing tensors
    pruned.save_pretrained(out)      # writes config (auto_map) + weights + modeling_layercut.py
    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)

A stock config cannot express "block 7 has no attention", so the pruned model is an
instance of the classes in ``compress/depth/templates/modeling_layercut.py``: stock
transformers classes of the source family whose removed modules are ``None`` (their
weights are not saved) and whose KV cache holds a no-storage layer for each block
without attention. ``save_pretrained`` copies that file next to the weights and records
it in ``auto_map``. Supported families: llama, mistral, qwen2, qwen3.

Reference: He et al. 2024, "What Matters in Transformers? Not All Attention is Needed".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from layercut.compress.core.errors import LayercutError
from layercut.compress.depth.blocks import validate_layers
from layercut.compress.depth.templates import modeling_layercut as template

SUBLAYER_FAMILIES = tuple(template.FAMILIES)
_KEYS = {"attention": "layercut_drop_attention", "mlp": "layercut_drop_mlp"}


def sublayer_family(model: nn.Module) -> str:
    """The template family of a stock or already sublayer-pruned model; refuse others."""
    model_type = getattr(model.config, "model_type", "")
    family = model_type.removeprefix("layercut_")
    if family not in SUBLAYER_FAMILIES:
        raise LayercutError(
            f"sublayer removal supports {', '.join(SUBLAYER_FAMILIES)}; '{model_type}' is not covered "
            "(remove whole blocks with --what block instead)"
        )
    return family


def _classes(family: str) -> tuple[type, type]:
    camel = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    return getattr(template, f"Layercut{camel}Config"), getattr(template, f"Layercut{camel}ForCausalLM")


@torch.no_grad()
def drop_sublayers(model: nn.Module, layers: Sequence[int], what: str) -> nn.Module:
    """A model with the attention (``what="attention"``) or MLP of blocks ``layers`` removed.

    Returns a new ``Layercut<Family>ForCausalLM`` whose tensors are ``model``'s (shared,
    not copied); ``model`` itself is left as it was.
    """
    if what not in _KEYS:
        raise LayercutError(f"unknown sublayer '{what}' (choose attention or mlp)")
    family = sublayer_family(model)
    n = model.config.num_hidden_layers
    picked = validate_layers(layers, n, what=f"{what} sublayer")
    config_cls, model_cls = _classes(family)
    drops = {key: list(getattr(model.config, key, None) or []) for key in _KEYS.values()}
    already = set(drops[_KEYS[what]]) & set(picked)
    if already:
        raise LayercutError(f"{what} of block {min(already)} was already removed")
    drops[_KEYS[what]] = sorted(set(drops[_KEYS[what]]) | set(picked))
    if len(drops["layercut_drop_attention"]) >= n:
        raise LayercutError(f"cannot remove the attention of all {n} blocks: at least one must remain")
    fields = {k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures", "auto_map")}
    config = config_cls(**{**fields, **drops})
    config._attn_implementation = model.config._attn_implementation
    with torch.device("meta"):
        pruned = model_cls(config)
    source = dict(model.state_dict())
    wanted = pruned.state_dict()
    pruned.load_state_dict({k: source[k] for k in wanted}, assign=True, strict=True)
    # Non-persistent buffers (rotary tables) are not in the state dict: take the source's.
    buffers = dict(model.named_buffers())
    for name, buf in list(pruned.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            pruned.get_submodule(owner)._buffers[leaf] = buffers[name]
    pruned.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        pruned.generation_config = model.generation_config
    return pruned.eval()


def sublayer_readme(config, source: str) -> str:
    """README.md text for a sublayer-pruned output: how to load it and what is missing."""
    attn = list(getattr(config, "layercut_drop_attention", None) or [])
    mlp = list(getattr(config, "layercut_drop_mlp", None) or [])
    return f"""# Sublayer-pruned model (layercut)

Source: `{source}`. Made by `layercut prune --what attention|mlp`.

- Attention removed from blocks: {attn or "none"}
- MLP removed from blocks: {mlp or "none"}

**This checkpoint needs `trust_remote_code=True`.** A standard config cannot say that a
block has no attention or no MLP, so the small modeling file `modeling_layercut.py`
(which imports only `transformers`) ships next to the weights and is named in
`config.json`'s `auto_map`. It subclasses the stock `{config.model_type.removeprefix("layercut_")}`
classes and skips the removed sublayers.

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)
```

- The removed sublayers' weights (and their input norms) are **not** in the files.
- Blocks without attention get **no KV cache**: the cache holds a no-storage layer for
  them (transformers' `DummyLayer`), so generation memory shrinks with every removed
  attention layer.
- `model_type` is `{config.model_type}`, so loading without `trust_remote_code` fails
  loudly instead of building the stock model with random weights in the removed slots.
"""
