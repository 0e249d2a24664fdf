"""Scale tuning: distil a GPTQ checkpoint's group scales from the original model.

Usage::

    layercut heal q4/ --method scales --teacher bundled:smollm2-135m -o q4-tuned/ --steps 60

    from layercut.heal.scales import tune_scales
    result = tune_scales(student, teacher, tokenizer, HealConfig(method="scales"), source="q4/", out_dir="q4-tuned")

GPTQ fixes every weight's integer code and each group's zero point; the fp16 scale of each
(group, output row) is the one continuous number left. Here only the scales move: every
``QuantLinear`` is swapped for a :class:`ScaleTuned` module while training, whose weight is
``s0 · (1 + θ)[g_idx] · (q − z)`` with the codes frozen and θ ([groups, out], starting at 0)
trained by the heal loop's distillation loss. θ is relative, so one learning rate suits layers
whose scales differ by orders of magnitude. Afterwards the scales, rounded to fp16, go back into
the ``QuantLinear`` modules, and the output is the source checkpoint with only its ``*.scales``
tensors rewritten, shard by shard: the same codes, zeros, ``g_idx``, config and bytes, loadable by
whatever loaded the source. Unlike LoRA, nothing needs merging or re-quantizing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import Tensor, nn

from layercut.compress.core.devices import resolve_device
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.save import atomic_dir, check_output_dir
from layercut.compress.quant.format.pack import unpack_gptq
from layercut.compress.quant.format.qlinear import QuantLinear
from layercut.heal.config import HealConfig, HealResult
from layercut.heal.data import HealDataset, heal_data
from layercut.heal.train import _teacher_and_cache, _train

NOTE = ("only the GPTQ group scales were trained (fp16, in place): codes, zero points, g_idx and the bytes on "
        "disk are the source's")


class ScaleTuned(nn.Module):
    """A GPTQ linear whose scales train: y = x · (s0 (1 + θ)[g_idx] · (q − z))ᵀ + b, all else frozen."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        q, z = unpack_gptq(layer.qweight, layer.qzeros, layer.bits, layer.in_features, layer.out_features)
        g = layer.g_idx.long()
        # q - z lies in [-(2^bits - 1), 2^bits - 1]: int16 holds every width (8-bit needs > int8)
        self.register_buffer("codes", (q.to(torch.int16) - z[g].T.to(torch.int16)))  # [out, in]
        self.register_buffer("g_idx", g)
        self.register_buffer("s0", layer.scales.float())  # [groups, out]
        self.theta = nn.Parameter(torch.zeros_like(self.s0))
        self.bias = None if layer.bias is None else layer.bias.float()
        self.layer = layer  # the QuantLinear the tuned scales go back into

    def scales(self) -> Tensor:
        return self.s0 * (1 + self.theta)

    def forward(self, x: Tensor) -> Tensor:
        w = self.scales()[self.g_idx].T * self.codes.to(self.s0.dtype)  # [out, in]
        y = x @ w.to(x.dtype).T
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _quant_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    return [(parent, child, mod) for parent in model.modules()
            for child, mod in parent.named_children() if isinstance(mod, QuantLinear)]


def wrap_scales(model: nn.Module) -> list[nn.Parameter]:
    """Freeze ``model``, swap each ``QuantLinear`` for a :class:`ScaleTuned`; return the θ parameters."""
    found = _quant_linears(model)
    if not found:
        raise LayercutError("heal --method scales tunes a GPTQ checkpoint's scales, and this model has no GPTQ "
                            "layers: quantize it first (layercut quantize), or heal it with --method lora")
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    for parent, child, mod in found:
        tuned = ScaleTuned(mod)
        setattr(parent, child, tuned)
        params.append(tuned.theta)
    return params


@torch.no_grad()
def unwrap_scales(model: nn.Module) -> dict[str, Tensor]:
    """Put every ``QuantLinear`` back with its tuned scales rounded to fp16; return them by checkpoint
    name (``<module>.scales``). A scale that would round to zero or below keeps its old value."""
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, Tensor] = {}
    for parent in list(model.modules()):
        for child, mod in list(parent.named_children()):
            if not isinstance(mod, ScaleTuned):
                continue
            new = mod.scales().half()
            new = torch.where(torch.isfinite(new) & (new > 0), new, mod.s0.half())
            mod.layer.scales.copy_(new)
            setattr(parent, child, mod.layer)
            out[f"{names[id(mod)]}.scales"] = new.cpu()
    return out


def write_scales(source: str | Path, scales: dict[str, Tensor], dest: Path) -> None:
    """``dest`` := ``source`` with the named fp16 scale tensors overwritten in place: each shard is
    copied and only those tensors' bytes are rewritten (same header, names, shapes and offsets, so
    the files are byte-identical elsewhere); every other file is copied as it is."""
    src = Path(source)
    left = dict(scales)
    for f in sorted(src.iterdir()):
        if f.is_dir():
            continue
        shutil.copy2(f, dest / f.name)
        if f.suffix != ".safetensors":
            continue
        with open(dest / f.name, "r+b") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            for k in [k for k in header if k in left]:
                entry, new = header[k], left.pop(k)
                if entry["dtype"] != "F16" or list(new.shape) != entry["shape"] or new.dtype != torch.float16:
                    raise LayercutError(f"scale tuning: {k} is {entry['shape']} {entry['dtype']} in {f.name}, "
                                        f"tuned {list(new.shape)} {new.dtype}")
                begin, stop = entry["data_offsets"]
                data = new.contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
                if len(data) != stop - begin:
                    raise LayercutError(f"scale tuning: {k} spans {stop - begin} bytes in {f.name}, tuned {len(data)}")
                fh.seek(8 + n + begin)
                fh.write(data)
    if left:
        raise LayercutError(f"scale tuning: {len(left)} tuned scale tensors are not in {src} (first: {next(iter(left))})")


def tune_scales(student: nn.Module, teacher, tokenizer, cfg: HealConfig, source: str | Path,
                out_dir: str | Path | None = None, progress: bool = True, *, data=None,
                overwrite: bool = False) -> HealResult:
    """Train the GPTQ scales of ``student`` (loaded from the GPTQ checkpoint ``source``) toward
    ``teacher`` (a model or its top-k cache, as :func:`layercut.heal.train.heal_model` takes);
    write ``source`` with the tuned scales to ``out_dir`` atomically. ``student`` keeps its
    ``QuantLinear`` modules, now with the tuned scales."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    out = check_output_dir(out_dir, overwrite) if out_dir is not None else None
    if data is None:
        data = heal_data(tokenizer, cfg)
    accelerator = Accelerator(cpu=resolve_device(cfg.device).type == "cpu")
    set_seed(cfg.seed)
    teacher, cache = _teacher_and_cache(teacher, student, data, cfg, accelerator.device, progress)
    use_cache = getattr(student.config, "use_cache", None)
    student.config.use_cache = False
    params = wrap_scales(student)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    dataset = HealDataset(data, cfg.steps * cfg.batch * accelerator.num_processes, cfg.seed, cache)
    loader = DataLoader(dataset, batch_size=cfg.batch, shuffle=False,
                        generator=torch.Generator().manual_seed(cfg.seed))
    model, optimizer, loader = accelerator.prepare(student, optimizer, loader)
    if teacher is not None:
        teacher.to(accelerator.device).eval()
    losses: list[float] = []
    step, tokens, seconds = _train(accelerator, model, teacher, loader, optimizer, params, cfg, 0, losses,
                                   None, None, progress)
    student = accelerator.unwrap_model(model)
    scales = unwrap_scales(student)
    student.config.use_cache = use_cache
    student.eval()
    result = HealResult(
        steps=step, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        loss_first=_mean(losses[:10]), loss_last=_mean(losses[-10:]),
        trainable_params=sum(p.numel() for p in params), targets=["scales"], lora_modules=0,
        quantized_input=True, merged=False, notes=[NOTE], losses=losses, config=cfg.model_dump())
    if out is not None and accelerator.is_main_process:
        with atomic_dir(out, overwrite) as tmp:
            write_scales(source, scales, tmp)
            result.output = str(out)
            (tmp / "heal.json").write_text(json.dumps(result.to_dict(with_losses=True), indent=1, default=str) + "\n")
            (tmp / "HEAL.md").write_text(_readme(result, cfg, len(scales)))
    result.model = student
    return result


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def _readme(result: HealResult, cfg: HealConfig, layers: int) -> str:
    return (
        "# Scales tuned with layercut\n\n"
        f"The GPTQ group scales of {layers} quantized layers ({result.trainable_params:,} numbers) were trained by "
        f"distillation ({cfg.loss}"
        + (f", the teacher's top-{cfg.teacher_topk} log-probs" if cfg.teacher_topk and cfg.loss != "lm" else "")
        + f") for {result.steps} steps of {cfg.batch} x {cfg.seq_len} tokens from {cfg.text_label()}, lr {cfg.lr:g} "
        f"({cfg.schedule}), seed {cfg.seed}. Loss {result.loss_first:.4f} -> {result.loss_last:.4f}.\n\n"
        f"{NOTE[0].upper() + NOTE[1:]}.\n"
    )
