"""Heal a compressed model: LoRA (peft) distillation from the original, merged into dense weights.

Usage::

    layercut heal pruned/ --teacher bundled:smollm2-135m -o healed/ --steps 200 --rank 16

    from layercut.heal.train import heal_model
    from layercut.heal.config import HealConfig
    result = heal_model(student, teacher, tokenizer, HealConfig(steps=200), out_dir="healed")
    result.model            # merged dense student; healed/ holds it as a checkpoint

The loop: peft LoRA on the decoder blocks' linears (layercut.heal.lora), loss = token-level
KL(teacher ‖ student) by default (layercut.heal.losses; teacher on the fly in no_grad, or a
cached top-k), AdamW with warmup + cosine, gradient checkpointing, then
``merge_and_unload``. Device placement, ``prepare`` and ``backward`` go through
``accelerate.Accelerator``, so ``accelerate launch -m layercut.cli heal ...`` runs it
data-parallel (``batch`` is per process); only the single-process path is tested here.
Deterministic under ``seed``: data order is a function of (seed, step) and a resumed
run restores adapter, optimizer and RNG state, so it ends on the same weights.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from layercut.calibrate.data import CalibSet
from layercut.compress.core.devices import resolve_device
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.save import atomic_dir, check_output_dir, write_checkpoint_into
from layercut.heal.config import HealConfig, HealResult
from layercut.heal.data import HealDataset, TopKCache, distill_target, heal_data
from layercut.heal.lora import (
    check_descendant,
    dequantize_modules,
    lora_module_count,
    model_dims,
    resolve_targets,
    wrap_lora,
)
from layercut.heal.losses import TopK, heal_loss
from layercut.heal.progress import progress_bar
from layercut.heal.state import default_state_dir, latest_state, load_state, restore_rng, save_state

REQUANTIZE_NOTE = ("the input was quantized: the adapter (saved in adapter/) was trained over the dequantized "
                   "layers, and the merged weights here are dense (dequantized + LoRA); merging needs a "
                   "re-quantize (layercut quantize) to get a quantized model back")

StepCallback = Callable[[int, float, nn.Module], None]


def lr_at(step: int, cfg: HealConfig) -> float:
    """Learning rate for 0-based ``step``: linear warmup, then cosine to 10% (or constant)."""
    warm = math.ceil(cfg.warmup * cfg.steps)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def heal_model(
    student: nn.Module,
    teacher: nn.Module | TopKCache | None,
    tokenizer,
    config: HealConfig | dict,
    out_dir: str | Path | None = None,
    progress: bool = True,
    *,
    data: CalibSet | None = None,
    state_dir: str | Path | None = None,
    callback: StepCallback | None = None,
    overwrite: bool = False,
) -> HealResult:
    """Train LoRA adapters on ``student`` toward ``teacher``, merge them, optionally save.

    ``teacher``: the original model (run on the fly), a :class:`TopKCache` built from it
    (``layercut.heal.data.build_topk_cache``), or None for ``loss="lm"``. With ``teacher_topk`` set
    and a model given, the cache is built first. ``student`` is modified in place and
    returned merged in ``result.model``. ``out_dir``: write the merged checkpoint there
    atomically (plus ``adapter/`` with ``save_adapter`` or a quantized input). Training
    state goes to ``state_dir`` (default ``OUT.heal-state``) every ``checkpoint_every``
    steps and is removed on success. ``callback(step, loss, model)`` runs after each step.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    cfg = config if isinstance(config, HealConfig) else HealConfig.parse(config)
    out = check_output_dir(out_dir, overwrite) if out_dir is not None else None
    state, resume_from = _resume_point(cfg, out, state_dir)
    if cfg.loss != "lm" and teacher is None:
        raise LayercutError(f"loss '{cfg.loss}' needs a teacher")
    if isinstance(teacher, nn.Module):
        check_descendant(student, teacher)
    names = resolve_targets(student, cfg.targets)
    if data is None:
        data = heal_data(tokenizer, cfg)
    if data.num_samples != cfg.num_samples:
        raise LayercutError(f"heal data has {data.num_samples} sequences, config asks {cfg.num_samples}")

    accelerator = Accelerator(cpu=resolve_device(cfg.device).type == "cpu")  # auto: cuda when available
    set_seed(cfg.seed)
    teacher, cache = _teacher_and_cache(teacher, student, data, cfg, accelerator.device, progress)

    quantized = dequantize_modules(student) > 0
    use_cache = getattr(student.config, "use_cache", None)
    student.config.use_cache = False
    if cfg.gradient_checkpointing:
        _checkpointing(student, True)
        student.enable_input_require_grads()  # peft: the frozen embeddings' output must carry grad
    set_seed(cfg.seed)  # LoRA A is initialised from the torch RNG
    peft_model = wrap_lora(student, names, cfg.rank, cfg.lora_alpha, cfg.dropout)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    start, losses, rng = 0, [], None
    if resume_from is not None:
        start, losses, rng = load_state(resume_from, peft_model, optimizer, cfg)
        losses = losses[:start]

    dataset = HealDataset(data, cfg.steps * cfg.batch * accelerator.num_processes, cfg.seed, cache)
    # Own generator: a DataLoader otherwise draws its base seed from the global RNG when an
    # iterator starts, which would shift dropout masks after a resume.
    loader = DataLoader(dataset, batch_size=cfg.batch, shuffle=False,
                        generator=torch.Generator().manual_seed(cfg.seed))
    model, optimizer, loader = accelerator.prepare(peft_model, optimizer, loader)
    if start:
        loader = accelerator.skip_first_batches(loader, start)
    if teacher is not None:
        teacher.to(accelerator.device).eval()
    if rng is not None:
        restore_rng(rng)

    step, tokens, seconds = _train(accelerator, model, teacher, loader, optimizer, params, cfg, start, losses,
                                   state, callback, progress)
    accelerator.wait_for_everyone()
    peft_model = accelerator.unwrap_model(model)
    peft_model.eval()
    result = HealResult(
        steps=step, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        loss_first=_mean(losses[:10]), loss_last=_mean(losses[-10:]),
        trainable_params=sum(p.numel() for p in params), targets=names,
        lora_modules=lora_module_count(peft_model), quantized_input=quantized, merged=True,
        resumed_from=start, notes=[REQUANTIZE_NOTE] if quantized else [], losses=losses, config=cfg.model_dump())
    merged = _finish(peft_model, tokenizer, cfg, out, overwrite, result, accelerator.is_main_process, use_cache)
    result.model = merged
    if state is not None and accelerator.is_main_process and state.exists():
        shutil.rmtree(state, ignore_errors=True)  # the run completed: its training state is spent
    return result


def _resume_point(cfg: HealConfig, out: Path | None, state_dir: str | Path | None) -> tuple[Path | None, Path | None]:
    """(training-state folder, the checkpoint to resume from or None), refusing a resume that
    has nothing to resume and an interrupted run that is not asked to resume."""
    state = Path(state_dir) if state_dir is not None else (default_state_dir(out) if out is not None else None)
    if cfg.checkpoint_every and state is None:
        raise LayercutError("checkpoint_every needs an output or a state directory")
    resume_from = latest_state(state)
    if cfg.resume and resume_from is None:
        raise LayercutError(f"--resume: no heal checkpoint in {state}")
    if resume_from is not None and not cfg.resume:
        raise LayercutError(f"{state} holds an interrupted heal run: pass --resume to continue it, or remove it")
    return state, resume_from


def _teacher_and_cache(teacher, student: nn.Module, data: CalibSet, cfg: HealConfig, device,
                       progress: bool) -> tuple[nn.Module | None, TopKCache | None]:
    """(the teacher to run on the fly, or the top-k cache to read): exactly one of them, or
    neither for ``loss="lm"``. A cache is checked against the data, vocabulary and temperature."""
    if cfg.loss == "lm":
        return None, None
    if isinstance(teacher, nn.Module) and cfg.teacher_topk:
        teacher.to(device)
    target = distill_target(teacher, data, cfg, progress)
    if not isinstance(target, TopKCache):
        return target, None
    target.check(data, model_dims(student)[1], cfg.temperature)
    return None, target


def _train(accelerator, model, teacher, loader, optimizer, params, cfg: HealConfig, start: int,
           losses: list[float], state: Path | None, callback: StepCallback | None,
           progress: bool) -> tuple[int, int, float]:
    """The optimisation loop from step ``start``; appends to ``losses``, saves training state
    every ``checkpoint_every`` steps. Returns (steps done, tokens seen, seconds)."""
    model.train()
    tokens, t0 = 0, time.perf_counter()
    bar = progress_bar(total=cfg.steps, initial=start, desc="heal", unit="step",
                       enabled=progress and accelerator.is_local_main_process)
    step = start
    for batch in loader:
        if step >= cfg.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = _loss(model, teacher, batch, cfg)
        accelerator.backward(loss)
        if cfg.grad_clip:
            accelerator.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(accelerator.reduce(loss.detach(), reduction="mean"))
        if not math.isfinite(value):
            raise LayercutError(f"heal diverged at step {step + 1} (loss {value}); lower --lr")
        losses.append(value)
        tokens += int(batch["attention_mask"].sum())
        step += 1
        bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        bar.update(1)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                save_state(state, step, accelerator.unwrap_model(model), getattr(optimizer, "optimizer", optimizer),
                           losses, cfg)
        if callback is not None:
            callback(step, value, accelerator.unwrap_model(model))
    bar.close()
    return step, tokens, time.perf_counter() - t0


def _loss(model: nn.Module, teacher: nn.Module | None, batch: dict, cfg: HealConfig) -> torch.Tensor:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    teacher_logits = None
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits
    topk = TopK(batch["topk_logp"], batch["topk_idx"], batch["tail_logp"]) if "topk_logp" in batch else None
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, L, V]
    return heal_loss(cfg.loss, logits, ids, mask, teacher_logits, topk, cfg.temperature, cfg.kd_weight)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def _finish(peft_model, tokenizer, cfg: HealConfig, out: Path | None, overwrite: bool,
            result: HealResult, is_main: bool, use_cache: bool | None) -> nn.Module:
    """Merge the adapters into dense weights; write OUT (checkpoint, adapter/, heal.json) atomically."""
    keep_adapter = cfg.save_adapter or result.quantized_input
    if out is None or not is_main:
        merged = peft_model.merge_and_unload()
        _restore(merged, use_cache)
        return merged
    with atomic_dir(out, overwrite) as tmp:
        if keep_adapter:
            peft_model.save_pretrained(tmp / "adapter", safe_serialization=True)
            result.adapter = str(out / "adapter")
        merged = peft_model.merge_and_unload()
        _restore(merged, use_cache)
        if result.quantized_input and getattr(merged.config, "quantization_config", None) is not None:
            del merged.config.quantization_config  # the merged weights are dense now
        result.output = str(out)
        report = result.to_dict(with_losses=True)
        write_checkpoint_into(merged, tokenizer, tmp, extra_files={
            "heal.json": json.dumps(report, indent=1, default=str) + "\n",
            "HEAL.md": _readme(result, cfg),
        })
    return merged


def _checkpointing(model: nn.Module, on: bool) -> None:
    """Gradient (activation) checkpointing, non-reentrant; transformers 5 renamed the methods."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _restore(model: nn.Module, use_cache: bool | None) -> None:
    _checkpointing(model, False)
    if hasattr(model, "disable_input_require_grads"):
        try:
            model.disable_input_require_grads()
        except AttributeError:  # no hook was registered
            pass
    model.config.use_cache = use_cache
    model.eval()


def _readme(result: HealResult, cfg: HealConfig) -> str:
    lines = [
        "# Healed with layercut",
        "",
        f"LoRA (peft) rank {cfg.rank}, alpha {cfg.lora_alpha:g}, on {', '.join(result.targets)} "
        f"({result.lora_modules} modules); loss {cfg.loss}"
        + (f" from the teacher's top-{cfg.teacher_topk} log-probs" if cfg.teacher_topk and cfg.loss != "lm" else "")
        + f"; {result.steps} steps of {cfg.batch} x {cfg.seq_len} tokens from {cfg.text_label()} "
        f"(offset {cfg.offset if isinstance(cfg.data, str) else cfg.source_offsets()}), lr {cfg.lr:g} ({cfg.schedule}), seed {cfg.seed}.",
        f"Loss {result.loss_first:.4f} -> {result.loss_last:.4f}. The adapters are merged into these "
        "dense weights (merge_and_unload)." + (" The peft adapter is in adapter/." if result.adapter else ""),
    ]
    if result.quantized_input:
        lines += ["", f"**Merging needs a re-quantize:** {REQUANTIZE_NOTE}."]
    return "\n".join(lines) + "\n"
