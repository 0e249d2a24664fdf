"""A causal LM whose weights stay in safetensors until a step needs them.

Usage::

    from layercut.compress.io.lazy import LazyModel
    lazy = LazyModel("ckpt-dir")              # skeleton only: parameters on the meta device
    lazy.materialize("model.embed_tokens")    # one submodule's tensors, read from the shards
    block = lazy.block(3)                     # decoder block 3, materialized in lazy.compute_dtype
    lazy.release(lazy.block_path(3))          # back to meta: its memory is freed

The capture driver (:func:`layercut.calibrate.capture.run_blocks`) recognises such a model and
materializes each decoder block for its turn, then releases it, so a data-driven stage
holds one block at a time (plus the embeddings for input capture, and the final norm and
head where a loss is computed).

Dtypes: ``storage_dtype`` is the checkpoint's own (``auto``) unless given; blocks are
materialized in ``compute_dtype`` (float32 on CPU: a bf16 block is upcast for its turn).
The input embedding stays in the storage dtype and its output is upcast by a hook, so the
rotary tables, which the model computes in the stream's dtype, are float32 as they are when
the whole model is loaded in float32.

GPTQ checkpoints (``allow_quantized=True``; what ``layercut eval`` and ``layercut score`` ask
for): the skeleton's quantized linears are swapped for empty (meta)
:class:`~layercut.compress.quant.format.qlinear.QuantLinear` layers by the loader's own per-module rule
(:func:`layercut.compress.quant.format.loader.quantize_skeleton`: bits and group size from
``quantization_config`` and its ``dynamic`` overrides, checked against the stored shapes).
A block's turn then reads its packed tensors (``qweight``/``qzeros``/``scales``/``g_idx``/``bias``,
kept in their stored dtypes) as well as its dense ones; releasing it sends both back to meta.
Any module with a ``.qweight`` in the files takes that path, a quantized head included.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn

from layercut.compress.core.arch import arch_for, count_params, get_submodule, spec_for_model_type
from layercut.compress.core.dtypes import parse_dtype, safetensors_dtype
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.core.shards import weight_map
from layercut.compress.io.models import check_weights
from layercut.compress.quant.format.loader import dequantize_rows, quantize_skeleton
from layercut.compress.quant.format.qlinear import QuantLinear

VOCAB_SLICE = 16384  # head rows dequantized or upcast at a time by LazyModel.head_logits


class TensorIndex:
    """Which shard holds each tensor of a safetensors checkpoint; reads one tensor at a time."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        check_weights(self.folder)  # missing shards, unknown tensors, truncation: one clear error
        self.where = weight_map(self.folder)
        self._headers: dict[str, tuple[int, dict]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _header(self, shard: str) -> tuple[int, dict]:
        if shard not in self._headers:
            with open(self.folder / shard, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                self._headers[shard] = (8 + size, json.loads(fh.read(size)))
        return self._headers[shard]

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read with ``pread`` into its own buffer.

        Not through a memory map: pages of a mapped shard count towards the process's
        resident set as they are touched, so reading a whole checkpoint through mmap shows
        up as its whole size in RSS even though only one block is alive.
        """
        if name not in self.where:
            raise LayercutError(f"{self.folder}: no tensor named {name} in the checkpoint")
        shard = self.where[name]
        base, header = self._header(shard)
        if name not in header:
            raise LayercutError(f"{self.folder / shard}: no tensor named {name}")
        info = header[name]
        start, end = info["data_offsets"]
        dtype = safetensors_dtype(info["dtype"])
        if dtype is None:
            raise LayercutError(f"{self.folder / shard}: tensor {name} has unsupported dtype {info['dtype']}")
        buf = bytearray(end - start)
        with open(self.folder / shard, "rb") as fh:
            got = fh.readinto(memoryview(buf)) if fh.seek(base + start) >= 0 else 0
        if got != end - start:
            raise LayercutError(f"{self.folder / shard}: truncated (tensor {name} is cut short)")
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def info(self, name: str) -> dict:
        """A tensor's header entry (``dtype``, ``shape``, ``data_offsets``), read without its data."""
        if name not in self.where:
            raise LayercutError(f"{self.folder}: no tensor named {name} in the checkpoint")
        _, header = self._header(self.where[name])
        if name not in header:
            raise LayercutError(f"{self.folder / self.where[name]}: no tensor named {name}")
        return header[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the shard headers (no data read)."""
        return {name: tuple(self.info(name)["shape"]) for name in self.where}

    def dtype(self, skip: set[str] | frozenset[str] = frozenset()) -> torch.dtype:
        """The dtype of the checkpoint's floating tensors (its first one not in ``skip``), from the headers."""
        for name in self.where:
            dtype = safetensors_dtype(self.info(name)["dtype"])
            if name not in skip and dtype is not None and dtype.is_floating_point:
                return dtype
        return torch.float32


class LazyModel:
    """Skeleton on the meta device + a tensor index; see the module docstring."""

    def __init__(self, path: str | os.PathLike, storage_dtype: torch.dtype | str | None = None,
                 compute_dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                 allow_quantized: bool = False) -> None:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path = Path(path)
        self.weights = TensorIndex(self.path)
        self.config = AutoConfig.from_pretrained(self.path, trust_remote_code=trust_remote_code)
        quantized = is_quantized(self.config)
        if quantized and not allow_quantized:
            raise LayercutError(f"{self.path}: a quantized checkpoint cannot be streamed by this step")
        shapes = self.weights.shapes() if quantized else {}
        packed = {n for n in shapes if n.rpartition(".")[0] + ".qweight" in shapes}  # a quantized module's tensors
        self.storage_dtype = parse_dtype(storage_dtype) or self.weights.dtype(skip=packed)
        self.compute_dtype = compute_dtype
        dense_config = self.config
        if quantized:  # the skeleton is the dense model; the quantized linears are swapped in below
            dense_config = copy.deepcopy(self.config)
            del dense_config.quantization_config
        with init_empty_weights(include_buffers=False):  # buffers (rotary tables) stay real
            model = AutoModelForCausalLM.from_config(dense_config, dtype=self.storage_dtype,
                                                     trust_remote_code=trust_remote_code)
        self.model = model.eval()
        self.model._layercut_lazy = self  # lets run_blocks find the loader
        self.quantized: set[str] = set()  # module paths of the QuantLinear layers (GPTQ checkpoints)
        self.quantization_config: dict | None = None
        if quantized:
            self.quantization_config, self.quantized = quantize_skeleton(self.model, self.config, shapes)
        self.spec = arch_for(self.model)
        self.num_blocks = len(self.spec.layers_of(self.model))
        self.names = self._checkpoint_names()
        self.tied = self._tied_pairs()
        for alias, owner in self.tied.items():  # share the meta parameter, as the loaded model does
            _set_param(self.model, alias, get_submodule(self.model, owner.rpartition(".")[0]).weight)
        self.num_params = count_params(self.model)  # tied ones once, a quantized linear as in x out

    def _checkpoint_names(self) -> dict[str, str]:
        """Model parameter name -> checkpoint tensor name, through transformers' key renamings."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        conversions = get_model_conversion_mapping(self.model)
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        if converters:
            raise LayercutError(f"{self.path}: this architecture's checkpoint format merges tensors on load; "
                                "it cannot be streamed block by block")
        meta = self.model.state_dict()
        names = {}
        for key in self.weights.where:
            new, _ = rename_source_key(key, renamings, converters, self.model.base_model_prefix, meta)
            names[new] = key
        return names

    # ------------------------------------------------------------------ naming
    def block_path(self, index: int) -> str:
        return f"{self.spec.layers_path()}.{index}"

    def _tied_pairs(self) -> dict[str, str]:
        """Parameters stored once but used twice (tied head) that the checkpoint does not hold."""
        keys = getattr(self.model, "_tied_weights_keys", None) or {}
        if isinstance(keys, (list, tuple)):  # older transformers: a list of tied names
            keys = {k: f"{self.spec.base}.{self.spec.embed}.weight" for k in keys}
        tie = getattr(self.config.get_text_config(), "tie_word_embeddings", False)
        # a quantized head (its own .qweight) is stored, not tied
        return {k: v for k, v in keys.items() if tie and k not in self.names
                and k.rpartition(".")[0] not in self.quantized}

    # ------------------------------------------------------------------ loading
    def materialize(self, path: str, dtype: torch.dtype | None = None) -> nn.Module:
        """Read ``path``'s parameters from the shards (in ``dtype``, default the compute dtype)."""
        module = get_submodule(self.model, path) if path else self.model
        dtype = dtype or self.compute_dtype
        prefix = f"{path}." if path else ""
        for name, param in list(module.named_parameters(recurse=True)):
            full = prefix + name
            source = self.tied.get(full, full)
            if not param.is_meta and param.dtype == dtype:
                continue
            if source not in self.names:
                raise LayercutError(f"{self.path}: the checkpoint has no tensor for {source}")
            _set_param(module, name, self.weights.get(self.names[source]).to(dtype))
        for name, buf in self._stored_buffers(module, prefix):  # packed GPTQ tensors: stored dtypes
            if buf.is_meta:
                tensor = self.weights.get(self.names[prefix + name])
                if tuple(tensor.shape) != tuple(buf.shape):
                    raise LayercutError(f"{self.path}: {self.names[prefix + name]} is {list(tensor.shape)}, the "
                                        f"quantization_config gives this layer {list(buf.shape)}")
                _set_buffer(module, name, tensor)
        return module

    def release(self, path: str) -> None:
        """Send ``path``'s parameters (and packed buffers) back to the meta device (frees their memory)."""
        module = get_submodule(self.model, path) if path else self.model
        prefix = f"{path}." if path else ""
        for name, param in list(module.named_parameters(recurse=True)):
            if not param.is_meta:
                _set_param(module, name, torch.empty_like(param, device="meta"))
        for name, buf in self._stored_buffers(module, prefix):
            if not buf.is_meta:
                _set_buffer(module, name, torch.empty_like(buf, device="meta"))
        trim_heap()

    def _stored_buffers(self, module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
        """``module``'s buffers that belong to a quantized linear (read from the files, not computed)."""
        if not self.quantized:
            return []
        return [(n, b) for n, b in module.named_buffers(recurse=True)
                if (prefix + n).rpartition(".")[0] in self.quantized and prefix + n in self.names]

    def block(self, index: int) -> nn.Module:
        return self.materialize(self.block_path(index))

    def embeddings(self) -> nn.Module:
        """The input embedding in the storage dtype, with its output upcast to the compute dtype."""
        emb = self.model.get_input_embeddings()
        path = next(n for n, m in self.model.named_modules() if m is emb)
        self.materialize(path, dtype=self.storage_dtype)
        if not getattr(emb, "_layercut_upcast", False):
            emb.register_forward_hook(lambda _m, _i, out: out.to(self.compute_dtype))
            emb._layercut_upcast = True
        return emb

    def prepare_capture(self) -> None:
        """Materialize what input capture runs: every non-block module except the head."""
        self.embeddings()
        skip = {id(self.model.get_input_embeddings()), id(self.model.get_output_embeddings())}
        for path in self.outside_blocks():
            if id(get_submodule(self.model, path)) not in skip:
                self.materialize(path)

    def release_outside(self) -> None:
        """Release every non-block module (embeddings, norms, head); a later step re-reads what it needs."""
        for path in self.outside_blocks():
            self.release(path)

    def head(self) -> nn.Module:
        """The output head in the storage dtype (see :meth:`head_logits` for the fp32 maths)."""
        head = self.model.get_output_embeddings()
        path = next(n for n, m in self.model.named_modules() if m is head)
        return self.materialize(path, dtype=self.storage_dtype)

    @torch.no_grad()
    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from a raw last-block output [S, D] -> [S, V] in the compute dtype: the final norm, the head
        (a GPTQ head dequantized, a narrower one upcast, :data:`VOCAB_SLICE` rows at a time: never a float32
        copy of the whole vocabulary), and the final softcap where the config has one."""
        norm = self.materialize(f"{self.spec.base}.{self.spec.final_norm}")
        head = self.head()
        x = norm(h.unsqueeze(0)).squeeze(0).to(self.compute_dtype)
        bias = getattr(head, "bias", None)
        if not isinstance(head, QuantLinear) and head.weight.dtype == x.dtype:
            logits = nn.functional.linear(x, head.weight, bias)
        else:
            rows = head.out_features if isinstance(head, QuantLinear) else head.weight.shape[0]
            parts = []
            for v0 in range(0, rows, VOCAB_SLICE):
                v1 = min(v0 + VOCAB_SLICE, rows)
                w = dequantize_rows(head, v0, v1) if isinstance(head, QuantLinear) else head.weight[v0:v1]
                parts.append(nn.functional.linear(x, w.to(x.dtype), None if bias is None else bias[v0:v1].to(x.dtype)))
            logits = torch.cat(parts, dim=-1)
        cap = getattr(self.config.get_text_config(), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def outside_blocks(self) -> list[str]:
        """Paths of the non-block leaf modules that hold parameters (embeddings, norms, head)."""
        layers = self.spec.layers_path()
        paths = []
        for name, module in self.model.named_modules():
            if name.startswith(layers + ".") or name == layers:
                continue
            if any(True for _ in module.parameters(recurse=False)) or name in self.quantized:
                paths.append(name)
        return paths


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them after a block's tensors are freed)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (probe: absent outside glibc)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def _set_param(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = root.get_submodule(owner) if owner else root
    param = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    setattr(target, leaf, param)


def _set_buffer(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = root.get_submodule(owner) if owner else root
    setattr(target, leaf, value)  # a registered buffer's name: stays a (persistent) buffer


def lazy_of(model: nn.Module) -> LazyModel | None:
    """The :class:`LazyModel` behind ``model``, if it was built lazily."""
    return getattr(model, "_layercut_lazy", None)


def stream_blocker(path: Path, quantized: bool = False) -> str | None:
    """Why ``path`` cannot be streamed block by block, or None when it can.

    ``quantized``: the caller streams GPTQ checkpoints too (``LazyModel(..., allow_quantized=True)``).
    """
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "its config.json is unreadable"
    if is_quantized(cfg) and not quantized:
        return "it is a quantized checkpoint"
    if cfg.get("auto_map"):
        return "it ships its own modeling code"
    if spec_for_model_type(str(cfg.get("model_type"))) is None:
        return f"model type '{cfg.get('model_type')}' is not in layercut's architecture table"
    return None
