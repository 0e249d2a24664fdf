"""Sublayer-pruned Llama-family models written by ``layercut prune --what attention|mlp``.

Load with::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)

Stock configs cannot say "block 7 has no attention", so this file ships next to the
weights (``auto_map`` in config.json) and subclasses the stock transformers classes of
the source family (llama, mistral, qwen2, qwen3). Two config lists drive it:

- ``layercut_drop_attention``: blocks whose attention (and its input norm) is gone:
  the block computes ``h + MLP(post_attention_layernorm(h))``;
- ``layercut_drop_mlp``: blocks whose MLP (and its norm) is gone: ``h + Attn(input_layernorm(h))``.

Removed modules are ``None``, so their weights are neither expected nor stored. A block
without attention gets a no-storage ``DummyLayer`` in the KV cache (transformers'
``kv_sharing_modes`` mechanism maps "reuse" to a layer that never stores keys/values),
so no cache memory is allocated for it. transformers 5.25 asks block 0's cache layer for the
sequence length; when block 0 has no attention, its ``DummyLayer`` is given the length of
the first block that has (``_answer_seq_length``). The model type is ``layercut_<family>`` on
purpose: loading without ``trust_remote_code`` fails instead of silently building the
stock model with random weights in the removed slots.

This file imports only transformers.
"""

from __future__ import annotations

import importlib

from transformers import DynamicCache

FAMILIES = {
    # family: (module, config class, causal LM class)
    "llama": ("transformers.models.llama", "LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("transformers.models.mistral", "MistralConfig", "MistralForCausalLM"),
    "qwen2": ("transformers.models.qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("transformers.models.qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
}


def _dropped(config, key: str) -> set[int]:
    return {int(i) for i in (getattr(config, key, None) or [])}


def _answer_seq_length(cache, gone: set[int]) -> None:
    """Let the cache layers of blocks without attention report the sequence length of the first block with it
    (transformers >= 5.25 reads it from block 0; its ``DummyLayer`` has no ``get_seq_length``)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return
    first = next((i for i in range(len(layers)) if i not in gone), None)
    if first is None:
        return
    for i in gone:
        if i < len(layers) and not hasattr(layers[i], "get_seq_length"):
            layers[i].get_seq_length = layers[first].get_seq_length


class _SublayerSkipMixin:
    """Decoder-layer forward that skips a removed attention or MLP (module set to ``None``)."""

    def forward(self, hidden_states, **kwargs):
        # The model passes everything but hidden_states by keyword; attention takes the same.
        if self.self_attn is not None:
            residual = hidden_states
            attn_out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
            hidden_states = residual + attn_out
        if self.mlp is not None:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


def _make_classes(family: str):
    module_name, config_name, model_name = FAMILIES[family]
    module = importlib.import_module(module_name)
    base_config = getattr(module, config_name)
    base_model = getattr(module, model_name)

    class Config(base_config):
        model_type = f"layercut_{family}"

        @property
        def kv_sharing_modes(self) -> list[str | None]:
            # "reuse" -> transformers allocates a DummyLayer (no KV storage) for that block.
            gone = _dropped(self, "layercut_drop_attention")
            return ["reuse" if i in gone else None for i in range(self.num_hidden_layers)]

    class ForCausalLM(base_model):
        config_class = Config

        def __init__(self, config):
            super().__init__(config)
            no_attn = _dropped(config, "layercut_drop_attention")
            no_mlp = _dropped(config, "layercut_drop_mlp")
            for index, layer in enumerate(self.model.layers):
                if index not in no_attn and index not in no_mlp:
                    continue
                if index in no_attn:
                    layer.self_attn = None
                    layer.input_layernorm = None
                if index in no_mlp:
                    layer.mlp = None
                    layer.post_attention_layernorm = None
                # Same object, same parameters; only the forward changes.
                layer.__class__ = _skip_class(type(layer))
            if no_attn:
                self.model.register_forward_pre_hook(self._cache_with_seq_length, with_kwargs=True)

        def _cache_with_seq_length(self, module, args, kwargs):
            # transformers 5.25 renamed the argument past_key_values -> cache.
            name = "cache" if "cache" in kwargs else "past_key_values"
            use_cache = kwargs.get("use_cache")
            if kwargs.get(name) is None and (self.config.use_cache if use_cache is None else use_cache):
                kwargs[name] = DynamicCache(config=self.config)
            _answer_seq_length(kwargs.get(name), _dropped(self.config, "layercut_drop_attention"))
            return args, kwargs

        def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
            # generate() reads the cache's length before the first forward.
            out = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
            for name in ("cache", "past_key_values"):
                _answer_seq_length(model_kwargs.get(name), _dropped(self.config, "layercut_drop_attention"))
            return out

    camel = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    Config.__name__ = Config.__qualname__ = f"Layercut{camel}Config"
    ForCausalLM.__name__ = ForCausalLM.__qualname__ = f"Layercut{camel}ForCausalLM"
    Config.__module__ = ForCausalLM.__module__ = __name__
    Config.register_for_auto_class("AutoConfig")
    ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    return Config, ForCausalLM


_SKIP_CLASSES: dict[type, type] = {}


def _skip_class(layer_cls: type) -> type:
    if layer_cls not in _SKIP_CLASSES:
        _SKIP_CLASSES[layer_cls] = type(f"Layercut{layer_cls.__name__}", (_SublayerSkipMixin, layer_cls), {})
    return _SKIP_CLASSES[layer_cls]


LayercutLlamaConfig, LayercutLlamaForCausalLM = _make_classes("llama")
LayercutMistralConfig, LayercutMistralForCausalLM = _make_classes("mistral")
LayercutQwen2Config, LayercutQwen2ForCausalLM = _make_classes("qwen2")
LayercutQwen3Config, LayercutQwen3ForCausalLM = _make_classes("qwen3")

__all__ = [
    "LayercutLlamaConfig", "LayercutLlamaForCausalLM", "LayercutMistralConfig", "LayercutMistralForCausalLM",
    "LayercutQwen2Config", "LayercutQwen2ForCausalLM", "LayercutQwen3Config", "LayercutQwen3ForCausalLM",
]
