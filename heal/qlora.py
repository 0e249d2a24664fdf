"""QLoRA heal: LoRA adapters trained over a 4-bit copy of the student, merged into its dense weights.

Usage::

    layercut heal pruned/ --method qlora --teacher bundled:smollm2-135m -o healed/ --steps 200

    from layercut.heal.qlora import heal_qlora
    result = heal_qlora(base, teacher, tokenizer, HealConfig(method="qlora"), dense_source="pruned/",
                        out_dir="healed/")   # base: pruned/ quantized (the stage makes it with RTN)

LoRA (``--method lora``) trains over the student's dense weights, so the whole dense model sits in
memory in the training dtype (float32 for fp16 checkpoints): 7.3 GiB for a 3B model. Here the frozen
base is the student quantized to ``base_bits`` (the heal stage writes it with layercut's own RTN into a
temporary GPTQ checkpoint, group size :data:`BASE_GROUP_SIZE`, and loads its packed tensors): each
target linear becomes a :class:`LoraQuant`, whose base weight is unpacked a slice of rows at a time
inside its forward and backward (:class:`layercut.heal.scales.ScaleTuned` with its scales frozen), plus
``(x · Aᵀ · Bᵀ) · alpha / rank`` with A, B in float32 (A Kaiming-uniform, B zero, as peft initialises
them). The embedding and head stay 16-bit with float32 logits
(:func:`layercut.heal.scales.train_dtype_except_embeddings`).

After training, ``B · A · alpha / rank`` of each target is added to the **dense** weight of the source
checkpoint, tensor by tensor (:func:`merge_into_dense`: read one weight, add, write it), so the output
is a stock dense checkpoint in the source's dtype, like ``--method lora``'s; nothing but the adapters
and one tensor is resident while merging. The adapters learned to correct the 4-bit base, and are
merged into weights that never had its rounding error: ``benchmarks/qlora.py`` measures what that costs
against LoRA over the dense base at the same steps.
"""

from __future__ import annotations

import gc
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from layercut.compress.core.errors import LayercutError
from layercut.compress.core.save import atomic_dir, check_output_dir
from layercut.compress.core.shards import INDEX, ShardWriter
from layercut.compress.io.lazy import TensorIndex, trim_heap
from layercut.heal.config import HealConfig, HealResult
from layercut.heal.lora import resolve_targets
from layercut.heal.progress import progress_bar
from layercut.heal.scales import (
    ScaleTuned,
    cache_codes_auto,
    heal_result,
    quant_linears,
    train_frozen_base,
    training_sentence,
    write_report,
)

BASE_GROUP_SIZE = 64  # RTN group size of the frozen base: divides every hidden size this project meets
NOTE = ("the LoRA adapters were trained over a {bits}-bit RTN copy of the student (group size {group}) and merged "
        "into its dense weights")


class LoraQuant(nn.Module):
    """A frozen GPTQ linear (unpacked slice by slice) plus a trainable LoRA update: y = base(x) + s · x Aᵀ Bᵀ."""

    def __init__(self, layer: nn.Module, rank: int, alpha: float, dropout: float, cache_codes: bool = False):
        super().__init__()
        self.base = ScaleTuned(layer, cache_codes)
        self.base.theta.requires_grad_(False)  # θ = 0: the base's own scales, no gradient
        device = layer.scales.device
        self.lora_A = nn.Parameter(torch.empty(rank, layer.in_features, dtype=torch.float32, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(layer.out_features, rank, dtype=torch.float32, device=device))
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        update = (self.dropout(x).to(torch.float32) @ self.lora_A.T) @ self.lora_B.T
        return self.base(x) + (update * self.scaling).to(x.dtype)

    @torch.no_grad()
    def delta(self) -> Tensor:
        """The update to the dense weight, [out, in] float32."""
        return (self.lora_B @ self.lora_A) * self.scaling


def wrap_qlora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float,
               progress: bool = False, cache_codes: bool | None = None) -> dict[str, LoraQuant]:
    """Freeze ``model`` and swap each GPTQ linear named by ``targets`` (in-block names such as
    ``self_attn.q_proj``, :func:`layercut.heal.lora.resolve_targets`) for a :class:`LoraQuant`; return them by
    module name. ``cache_codes`` as in :func:`layercut.heal.scales.wrap_scales`."""
    names = {id(m): n for n, m in model.named_modules()}
    every = quant_linears(model)
    found = [(parent, child, mod) for parent, child, mod in every
             if any(names[id(mod)].endswith("." + t) for t in targets)]
    if not found:
        raise LayercutError("heal --method qlora: no quantized linear of the base matches the targets "
                            f"({', '.join(targets)})")
    if cache_codes is None:
        cache_codes = cache_codes_auto([m for _, _, m in every])
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = {}
    for parent, child, mod in progress_bar(every, desc="lora layers", unit="layer", enabled=progress):
        if any(mod is m for _, _, m in found):
            wrapped[names[id(mod)]] = new = LoraQuant(mod, rank, alpha, dropout, cache_codes)
        else:  # not a target: frozen, but the gradient must flow through it (the packed kernel has no backward)
            new = ScaleTuned(mod, cache_codes)
            new.theta.requires_grad_(False)
        setattr(parent, child, new)
    trim_heap()  # the unpacking's transients
    return wrapped


def merge_into_dense(source: str | Path, deltas: Mapping[str, Callable[[], Tensor]], dest: Path,
                     progress: bool = False) -> None:
    """Write ``source`` (a dense safetensors checkpoint) to ``dest`` with ``deltas[name]()`` added to the tensor
    ``name + '.weight'``, in float32 and back to the tensor's dtype; one tensor at a time, each update computed
    when its tensor is reached (all of them at once would be a float32 copy of every adapted weight). Other
    files are copied."""
    src = Path(source)
    index = TensorIndex(src)
    left = {f"{name}.weight": d for name, d in deltas.items()}
    missing = [k for k in left if k not in index]
    if missing:
        raise LayercutError(f"qlora merge: {src} has no tensor {missing[0]} (the base and the source differ)")
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX:
            shutil.copy2(f, dest / f.name)
    with ShardWriter(dest) as writer:
        for name in progress_bar(list(index.where), desc="merge", unit="tensor", enabled=progress):
            t = index.get(name)
            if name in left:
                d = left.pop(name)()
                if tuple(d.shape) != tuple(t.shape):
                    raise LayercutError(f"qlora merge: {name} is {tuple(t.shape)} in {src}, adapter {tuple(d.shape)}")
                t = (t.to(torch.float32) + d.to(torch.float32)).to(t.dtype)
            writer.add(name, t)
            del t


def heal_qlora(base: nn.Module, teacher, tokenizer, cfg: HealConfig, dense_source: str | Path,
               out_dir: str | Path | None = None, progress: bool = True, *, data=None,
               overwrite: bool = False) -> HealResult:
    """Train LoRA adapters over ``base`` (the student loaded from its quantized copy) toward ``teacher`` (a
    model or its top-k cache); merge them into the dense checkpoint ``dense_source`` and write it to
    ``out_dir`` atomically. Without ``out_dir``, ``result.model`` is ``base`` with its adapters (not merged); with
    it, the base's tensors are freed before the merge (``base`` is left on the meta device, ``result.model``
    None)."""
    out = check_output_dir(out_dir, overwrite) if out_dir is not None else None
    wrapped = wrap_qlora(base, resolve_targets(base, cfg.targets), cfg.rank, cfg.lora_alpha, cfg.dropout, progress)
    params = [p for m in wrapped.values() for p in (m.lora_A, m.lora_B)]
    steps, tokens, seconds, losses, is_main = train_frozen_base(base, teacher, tokenizer, cfg, params, data, progress)
    bits = next(iter(wrapped.values())).base.bits
    result = heal_result(cfg, steps, tokens, seconds, losses, params,
                         targets=sorted({n.split(".", 3)[-1] for n in wrapped}), lora_modules=len(wrapped),
                         quantized_input=False, merged=True, notes=[NOTE.format(bits=bits, group=BASE_GROUP_SIZE)])
    result.model = base
    if out is not None and is_main:
        factors = {name: (m.lora_A.detach().cpu(), m.lora_B.detach().cpu(), m.scaling) for name, m in wrapped.items()}
        # the base is spent: free its tensors (the caller may still hold the module) so that merging holds the
        # adapters and one tensor of the source
        result.model = None
        wrapped.clear()
        base.to_empty(device="meta")
        gc.collect()
        trim_heap()
        deltas = {name: (lambda f=f: (f[1] @ f[0]) * f[2]) for name, f in factors.items()}
        with atomic_dir(out, overwrite) as tmp:
            merge_into_dense(dense_source, deltas, tmp, progress)
            write_report(tmp, out, result, _readme(result, cfg, bits))
    return result


def _readme(result: HealResult, cfg: HealConfig, bits: int) -> str:
    return (f"# Healed with layercut (QLoRA)\n\nLoRA rank {cfg.rank}, alpha {cfg.lora_alpha:g}, on {result.lora_modules} "
            f"linears, trained over a {bits}-bit RTN copy of the student (group size {BASE_GROUP_SIZE}) "
            f"{training_sentence(result, cfg)} The adapters are merged into these dense weights (the source's dtype), "
            "tensor by tensor.\n")
