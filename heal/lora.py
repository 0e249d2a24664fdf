"""LoRA plumbing over peft: target modules from the arch table, quantized inputs, checks.

Usage::

    from layercut.heal.lora import resolve_targets, wrap_lora, dequantize_modules, check_descendant
    names = resolve_targets(model, "mlp")          # ['mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj']
    peft_model = wrap_lora(model, names, rank=16, alpha=32)

No LoRA is written here: peft's ``LoraConfig`` + ``get_peft_model`` do the work (Hu et al.
2021, "LoRA: Low-Rank Adaptation of Large Language Models"). This module only decides
*which* modules peft wraps — the decoder blocks' linears as listed by
:func:`layercut.compress.core.arch.arch_for`, matched by one anchored regex so nothing outside the
blocks (``lm_head``, embeddings) is touched — and turns quantized layers into dense ones
peft can wrap.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from layercut.compress.core.arch import arch_for
from layercut.compress.core.errors import LayercutError

TARGET_ALIASES = ("all-linear", "mlp", "attn")


def resolve_targets(model: nn.Module, targets: str) -> list[str]:
    """In-block linear names (e.g. ``self_attn.q_proj``) selected by ``targets``.

    ``all-linear`` | ``mlp`` | ``attn`` | a comma list of in-block names, leaf names
    (``down_proj``) or the aliases. Unknown names are a :class:`LayercutError`.
    """
    spec = arch_for(model)
    groups = spec.groups  # (qkv, o, gate_up, down)
    alias = {
        "all-linear": [n for g in groups for n in g],
        "attn": [n for g in groups[:2] for n in g],
        "mlp": [n for g in groups[2:] for n in g],
    }
    known = alias["all-linear"]
    chosen: list[str] = []
    for item in (t.strip() for t in targets.split(",")):
        if not item:
            continue
        if item in alias:
            names = alias[item]
        elif item in known:
            names = [item]
        else:
            names = [n for n in known if n.rsplit(".", 1)[-1] == item]
        if not names:
            raise LayercutError(
                f"unknown LoRA target '{item}' for {spec.family} (use {', '.join(TARGET_ALIASES)} "
                f"or block linears: {', '.join(known)})"
            )
        chosen.extend(n for n in names if n not in chosen)
    if not chosen:
        raise LayercutError("no LoRA targets given")
    return chosen


def target_regex(model: nn.Module, names: list[str]) -> str:
    """Anchored regex over full module names: ``<layers path>.<i>.<one of names>``."""
    spec = arch_for(model)
    alternatives = "|".join(re.escape(n) for n in names)
    return rf"{re.escape(spec.layers_path())}\.\d+\.({alternatives})"


def dequantize_modules(model: nn.Module) -> int:
    """Replace every quantized linear (a non-Linear module with ``dequantize()``) by nn.Linear.

    Works for layercut's ``layercut.compress.quant.format.qlinear.QuantLinear`` and any module exposing
    ``dequantize() -> W [out, in]`` plus ``in_features``/``out_features``/``bias``. The
    dense weight is float32 on the module's device. Returns the number replaced.
    """
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) or not callable(getattr(module, "dequantize", None)):
            continue
        if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
            continue
        with torch.no_grad():
            weight = module.dequantize().to(torch.float32)
            if tuple(weight.shape) != (module.out_features, module.in_features):
                raise LayercutError(f"{name}: dequantize() gave {tuple(weight.shape)}, expected "
                                    f"{(module.out_features, module.in_features)}")
            bias = getattr(module, "bias", None)
            dense = nn.Linear(module.in_features, module.out_features, bias=bias is not None,
                              device=weight.device, dtype=torch.float32)
            dense.weight.copy_(weight)
            if bias is not None:
                dense.bias.copy_(bias.to(torch.float32))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, dense)
        replaced += 1
    return replaced


def wrap_lora(model: nn.Module, names: list[str], rank: int, alpha: float, dropout: float = 0.0):
    """``get_peft_model`` with LoRA on the block linears ``names``. Returns the PeftModel."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    regex = target_regex(model, names)
    # GPT-2 keeps its linears as transposed Conv1D: peft needs fan_in_fan_out for those.
    conv1d = any(isinstance(m, Conv1D) and re.fullmatch(regex, n) for n, m in model.named_modules())
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=regex,
                        fan_in_fan_out=conv1d, bias="none", init_lora_weights=True)
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise LayercutError(f"peft could not wrap {names}: {str(exc).splitlines()[0]}") from exc


def lora_module_count(peft_model: nn.Module) -> int:
    from peft.tuners.lora import LoraLayer

    return sum(isinstance(m, LoraLayer) for m in peft_model.modules())


def model_dims(model: nn.Module) -> tuple[int, int, int]:
    """(hidden size, output vocabulary, decoder blocks) read from the modules themselves."""
    hidden = model.get_input_embeddings().weight.shape[1]
    out = model.get_output_embeddings()
    if out is None:
        vocab = model.config.vocab_size
    else:  # a GPTQ-quantized head has no .weight, only its logical out_features
        vocab = out.out_features if hasattr(out, "qweight") else out.weight.shape[0]
    return int(hidden), int(vocab), len(arch_for(model).layers_of(model))


def check_descendant(student: nn.Module, teacher: nn.Module) -> None:
    """Refuse a teacher the student cannot have been cut from (hidden size, vocab, depth)."""
    check_dims(model_dims(student), model_dims(teacher))


def check_dims(student: tuple[int | None, int | None, int | None],
               teacher: tuple[int | None, int | None, int | None]) -> None:
    """The one descendant check, on (hidden size, vocab, blocks) from modules or from configs
    (the heal stage runs it on ``config.json`` before anything is loaded); None skips a field."""
    (s_hidden, s_vocab, s_layers), (t_hidden, t_vocab, t_layers) = student, teacher
    if None not in (s_vocab, t_vocab) and s_vocab != t_vocab:
        raise LayercutError(f"teacher has a different vocabulary ({t_vocab} logits vs the student's "
                            f"{s_vocab}): distillation needs the same tokenizer")
    if None not in (s_hidden, t_hidden) and s_hidden != t_hidden:
        raise LayercutError(f"student is not a descendant of the teacher: hidden size {s_hidden} vs "
                            f"{t_hidden}")
    if None not in (s_layers, t_layers) and s_layers > t_layers:
        raise LayercutError(f"student is not a descendant of the teacher: {s_layers} blocks vs the "
                            f"teacher's {t_layers}")


def check_tokenizers(student_tok, teacher_tok) -> None:
    """Same vocabulary (token -> id) or a clear error."""
    if student_tok.get_vocab() != teacher_tok.get_vocab():
        s, t = len(student_tok), len(teacher_tok)
        raise LayercutError(f"teacher has a different tokenizer vocabulary ({t} tokens vs the "
                            f"student's {s}): distillation needs the same tokenizer")
