"""Architecture table: where each model family keeps its layers, as data.

Usage::

    from layercut.compress.core.arch import arch_for
    spec = arch_for(model)            # by config.model_type, generic fallback
    layers = spec.layers_of(model)    # nn.ModuleList of decoder blocks
    spec.linears(block)               # [(name, module), ...] in forward order

One small record per family (GPTQModel's ``module_tree`` idea), never a driver per
model. A family not in the table is probed by :func:`generic_spec`, which looks for
the usual attribute names and fails with a clear error if it cannot find them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from layercut.compress.core.errors import LayercutError


@dataclass(frozen=True)
class ArchSpec:
    """Where things live in one family's ``*ForCausalLM``.

    Paths are dotted attribute names. ``base`` is relative to the causal LM; ``layers``,
    ``embed``, ``final_norm`` to the base model; everything else to one decoder block.
    """

    family: str
    base: str = "model"
    layers: str = "layers"
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    attn: str = "self_attn"
    mlp: str = "mlp"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    # Module whose output is what attention / MLP add to the residual stream.
    attn_out: str = "self_attn"
    mlp_out: str = "mlp"
    # Linear layers in forward order, grouped as servers fuse them (never split bits
    # inside a group): qkv, o, gate_up, down.
    groups: tuple[tuple[str, ...], ...] = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    q_proj: str | None = "self_attn.q_proj"
    k_proj: str | None = "self_attn.k_proj"
    fused_qkv: str | None = None  # one Linear producing q, k, v stacked (Phi3, NeoX, GPT-2)
    down_proj: str = "mlp.down_proj"
    # True when a norm sits between the MLP output and the residual add (Gemma2/3):
    # linear replacement cannot be merged into down_proj there.
    post_mlp_norm: bool = False
    parallel_residual: bool = False  # h + attn(ln1 h) + mlp(ln2 h) (GPT-NeoX)
    conv1d: bool = False  # GPT-2 stores Linear weights transposed (transformers Conv1D)
    # Config keys holding one entry per layer, trimmed when blocks are removed.
    per_layer_keys: tuple[str, ...] = ("layer_types",)
    model_types: tuple[str, ...] = field(default=())

    # -- lookups -------------------------------------------------------------
    def base_of(self, model: nn.Module) -> nn.Module:
        return get_submodule(model, self.base)

    def layers_of(self, model: nn.Module) -> nn.ModuleList:
        layers = get_submodule(self.base_of(model), self.layers)
        if not isinstance(layers, nn.ModuleList):
            raise LayercutError(f"{self.family}: '{self.base}.{self.layers}' is not a ModuleList")
        return layers

    def layers_path(self) -> str:
        """State-dict prefix of the decoder blocks, e.g. ``model.layers``."""
        return f"{self.base}.{self.layers}"

    def linear_names(self) -> list[str]:
        return [name for group in self.groups for name in group]

    def linears(self, block: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(name, get_submodule(block, name)) for name in self.linear_names()]


_LLAMA = ArchSpec(family="llama", model_types=("llama", "mistral", "qwen2", "qwen3", "smollm3"),
                  per_layer_keys=("layer_types", "max_window_layers"))
_GEMMA = replace(
    _LLAMA,
    family="gemma2",
    model_types=("gemma2", "gemma3", "gemma3_text"),
    mlp_norm="pre_feedforward_layernorm",
    attn_out="post_attention_layernorm",
    mlp_out="post_feedforward_layernorm",
    post_mlp_norm=True,
    per_layer_keys=("layer_types",),
)
_PHI3 = replace(
    _LLAMA,
    family="phi3",
    model_types=("phi3",),
    groups=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    q_proj=None,
    k_proj=None,
    fused_qkv="self_attn.qkv_proj",
    per_layer_keys=("layer_types",),
)
_GPT2 = ArchSpec(
    family="gpt2",
    model_types=("gpt2",),
    base="transformer",
    layers="h",
    embed="wte",
    final_norm="ln_f",
    attn="attn",
    mlp="mlp",
    attn_norm="ln_1",
    mlp_norm="ln_2",
    attn_out="attn",
    mlp_out="mlp",
    groups=(("attn.c_attn",), ("attn.c_proj",), ("mlp.c_fc",), ("mlp.c_proj",)),
    q_proj=None,
    k_proj=None,
    fused_qkv="attn.c_attn",
    down_proj="mlp.c_proj",
    conv1d=True,
    per_layer_keys=(),
)
_NEOX = ArchSpec(
    family="gpt_neox",
    model_types=("gpt_neox",),
    base="gpt_neox",
    layers="layers",
    embed="embed_in",
    final_norm="final_layer_norm",
    attn="attention",
    mlp="mlp",
    attn_norm="input_layernorm",
    mlp_norm="post_attention_layernorm",
    attn_out="attention",
    mlp_out="mlp",
    groups=(("attention.query_key_value",), ("attention.dense",), ("mlp.dense_h_to_4h",),
            ("mlp.dense_4h_to_h",)),
    q_proj=None,
    k_proj=None,
    fused_qkv="attention.query_key_value",
    down_proj="mlp.dense_4h_to_h",
    parallel_residual=True,
    per_layer_keys=(),
)

ARCH_TABLE: tuple[ArchSpec, ...] = (_LLAMA, _GEMMA, _PHI3, _GPT2, _NEOX)


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError as exc:
        raise LayercutError(f"module path '{path}' not found in {type(root).__name__}") from exc


def spec_for_model_type(model_type: str) -> ArchSpec | None:
    for spec in ARCH_TABLE:
        if model_type in spec.model_types:
            return spec
    return None


def arch_for(model: nn.Module) -> ArchSpec:
    """The table entry for ``model.config.model_type``, else a probed generic spec."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    spec = spec_for_model_type(model_type)
    if spec is not None:
        if model_type == "gpt_neox" and not getattr(config, "use_parallel_residual", True):
            spec = replace(spec, parallel_residual=False)
        return spec
    return generic_spec(model)


def generic_spec(model: nn.Module) -> ArchSpec:
    """Probe an unknown family for the Llama-style names; refuse clearly if absent."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    base_name = getattr(model, "base_model_prefix", "model") or "model"
    spec = replace(_LLAMA, family=f"generic:{model_type}", base=base_name, model_types=())
    try:
        layers = spec.layers_of(model)
        block = layers[0]
        spec.linears(block)
        get_submodule(block, spec.attn_norm)
        get_submodule(block, spec.mlp_norm)
    except (LayercutError, IndexError) as exc:
        raise LayercutError(
            f"unsupported architecture '{model_type}': not in layercut's table "
            f"({', '.join(t for s in ARCH_TABLE for t in s.model_types)}) and it does not "
            f"have Llama-style module names ({exc})"
        ) from exc
    has_post_norm = hasattr(block, "post_feedforward_layernorm")
    if has_post_norm:
        spec = replace(spec, post_mlp_norm=True, mlp_out="post_feedforward_layernorm")
    return spec


def target_linears(model: nn.Module, spec: ArchSpec | None = None) -> list[tuple[int, int, str, nn.Module]]:
    """(block index, group index, full name, module) of every linear GPTQ quantizes, forward order."""
    spec = spec or arch_for(model)
    prefix = spec.layers_path()
    out = []
    for i, block in enumerate(spec.layers_of(model)):
        for g, group in enumerate(spec.groups):
            for path in group:
                out.append((i, g, f"{prefix}.{i}.{path}", get_submodule(block, path)))
    return out


def count_params(model: nn.Module) -> int:
    """Parameters, counting each quantized linear's logical in×out weights once."""
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if hasattr(module, "qweight") and hasattr(module, "in_features"):
            total += module.in_features * module.out_features
    return total
