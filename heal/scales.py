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

Memory: a :class:`ScaleTuned` keeps the checkpoint's packed codes (no copy) and owns only θ; each
forward unpacks its weight a slice of output rows at a time and the backward unpacks it again
(:class:`_PackedScaleMatmul` saves the input, not the weight); blocks run under gradient checkpointing,
so saved activations are block inputs. With ``teacher_topk`` the heal stage reads the teacher one
block at a time (:func:`layercut.heal.data.build_topk_cache_streamed`). What stays whole is the
student: packed blocks, its non-quantized tensors (embedding, head, norms) in the training dtype,
θ with its AdamW state (``benchmarks/memory.py``, row ``heal-scales``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from layercut.compress.core.devices import resolve_device
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.save import atomic_dir, check_output_dir
from layercut.compress.io.lazy import trim_heap
from layercut.compress.options import torch_dtype
from layercut.compress.quant.format.pack import packed_rows, unpack_gptq
from layercut.compress.quant.format.qlinear import QuantLinear
from layercut.heal.config import HealConfig, HealResult
from layercut.heal.data import HealDataset, heal_data
from layercut.heal.progress import progress_bar
from layercut.heal.train import _checkpointing, _teacher_and_cache, _train

NOTE = ("only the GPTQ group scales were trained (fp16, in place): codes, zero points, g_idx and the bytes on "
        "disk are the source's")


CHUNK_ELEMENTS = 1 << 22  # weights dequantized at once in a ScaleTuned forward/backward (16 MB in float32)
# wrap_scales caches every layer's codes unpacked (one byte per weight) up to this many weights in all: a
# 135M model (0.1 GB of codes) steps 2.3x faster than unpacking them twice per step; a 1B one stays packed
CODES_CACHE_BYTES = 256 << 20


def _codes(qweight: Tensor, qzeros: Tensor, g_idx: Tensor, bits: int, start: int, stop: int,
           cached: Tensor | None = None) -> Tensor:
    """(q − z) of output rows ``start:stop`` as float32 [stop − start, in]: a slice of ``cached`` when given,
    else unpacked from that slice of the packed tensors alone (``start`` a multiple of 32, so the packed zero
    points start on a word)."""
    if cached is not None:
        return cached[start:stop].to(torch.float32)
    zeros = qzeros[:, start * bits // 32: start * bits // 32 + packed_rows(stop - start, bits)]
    q, z = unpack_gptq(qweight[:, start:stop], zeros, bits, g_idx.shape[0], stop - start)
    return (q.to(torch.float32) - z[g_idx].T.to(torch.float32))  # exact: small integers


def _row_chunks(out_features: int, in_features: int, device: torch.device) -> list[tuple[int, int]]:
    per = CHUNK_ELEMENTS * (16 if device.type == "cuda" else 1) // max(in_features, 1)
    step = max(32, per // 32 * 32)
    return [(o, min(o + step, out_features)) for o in range(0, out_features, step)]


def _trim(x: Tensor) -> None:
    """On the CPU, hand the freed slices back to the OS: glibc keeps freed blocks under its (growing) mmap
    threshold in the heap, where the slices of one layer after another fragment it (+1 GiB at 1B)."""
    if x.device.type == "cpu":
        trim_heap()


class _PackedScaleMatmul(torch.autograd.Function):
    """y = x · Wᵀ with W = S[g_idx]ᵀ ⊙ (q − z), (q − z) unpacked from the GPTQ tensors (or read from the
    ``codes`` cache) a slice of output rows at a time.

    Saves only ``x`` and the [groups, out] scales ``S`` (plus references to the packed tensors): the dense
    weight is recomputed, slice by slice, in the backward, so no tensor of one element per weight outlives
    a slice. Gradients: dx = dy · W; dS[g, o] = Σ_{i: g_idx[i] = g} (dyᵀ x)[o, i] · (q − z)[o, i].
    """

    @staticmethod
    def forward(ctx, x: Tensor, scales: Tensor, qweight: Tensor, qzeros: Tensor, g_idx: Tensor,
                codes: Tensor | None, bits: int) -> Tensor:
        g = g_idx.long()
        parts = []
        for o0, o1 in _row_chunks(qweight.shape[1], x.shape[-1], x.device):
            w = scales[g, o0:o1].T * _codes(qweight, qzeros, g, bits, o0, o1, codes)  # [rows, in] float32
            parts.append(x @ w.to(x.dtype).T)
            del w
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if codes is None:
            _trim(x)
        ctx.save_for_backward(x, scales, qweight, qzeros, g_idx, codes)
        ctx.bits = bits
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, scales, qweight, qzeros, g_idx, cached = ctx.saved_tensors
        g = g_idx.long()
        need_x, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x2 = x.reshape(-1, x.shape[-1])
        gy = grad_y.reshape(-1, grad_y.shape[-1]).to(x.dtype)
        grad_x = torch.zeros_like(x2) if need_x else None
        grad_s = torch.zeros_like(scales) if need_s else None
        for o0, o1 in _row_chunks(qweight.shape[1], x.shape[-1], x.device):
            codes = _codes(qweight, qzeros, g, ctx.bits, o0, o1, cached)  # [rows, in]
            if need_x:
                grad_x.addmm_(gy[:, o0:o1], (scales[g, o0:o1].T * codes).to(x.dtype))
            if need_s:
                gw = (gy[:, o0:o1].T @ x2).to(torch.float32)  # dL/dW of these rows, [rows, in]
                grad_s[:, o0:o1].index_add_(0, g, (gw * codes).T)
                del gw
            del codes
        if cached is None:
            _trim(x)
        return (grad_x.reshape(x.shape) if need_x else None), grad_s, None, None, None, None, None


HEAD_ROWS = 8192  # vocabulary rows of a 16-bit head upcast at once by _Fp32Head (64 MB at hidden 2048)


class _Fp32Head(torch.autograd.Function):
    """logits = h · Wᵀ in float32 from a frozen 16-bit W, :data:`HEAD_ROWS` vocabulary rows at a time, so the
    head (the embedding, when tied) is never upcast whole: at 1B (128k × 2048) that copy is 1 GiB."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor) -> Tensor:
        x = h.to(torch.float32)
        out = torch.empty(*h.shape[:-1], weight.shape[0], dtype=torch.float32, device=h.device)
        for r0 in range(0, weight.shape[0], HEAD_ROWS):
            out[..., r0:r0 + HEAD_ROWS] = x @ weight[r0:r0 + HEAD_ROWS].to(torch.float32).T
        ctx.save_for_backward(weight)
        ctx.h_dtype = h.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        gh = torch.zeros(*grad.shape[:-1], weight.shape[1], dtype=torch.float32, device=grad.device)
        for r0 in range(0, weight.shape[0], HEAD_ROWS):
            gh += grad[..., r0:r0 + HEAD_ROWS].to(torch.float32) @ weight[r0:r0 + HEAD_ROWS].to(torch.float32)
        return gh.to(ctx.h_dtype), None


class Fp32Head(nn.Module):
    """A frozen linear head kept in its checkpoint's 16-bit dtype whose logits are float32 (:class:`_Fp32Head`)."""

    def __init__(self, inner: nn.Linear):
        super().__init__()
        self.inner = inner

    def forward(self, h: Tensor) -> Tensor:
        y = _Fp32Head.apply(h, self.inner.weight)
        return y if self.inner.bias is None else y + self.inner.bias.to(torch.float32)


class Fp32Embedding(nn.Module):
    """A frozen embedding kept in its checkpoint's 16-bit dtype that returns float32 rows (times the module's
    ``embed_scale`` in float32, as Gemma's scaled embedding has it)."""

    def __init__(self, inner: nn.Embedding):
        super().__init__()
        self.inner = inner

    def forward(self, ids: Tensor) -> Tensor:
        out = nn.functional.embedding(ids, self.inner.weight, self.inner.padding_idx).to(torch.float32)
        scale = getattr(self.inner, "embed_scale", None)
        return out if scale is None else out * torch.as_tensor(scale, dtype=torch.float32)


def _plain_embedding(module: nn.Module) -> bool:
    """An embedding whose forward is a lookup, or a lookup times ``embed_scale`` (Gemma): what
    :class:`Fp32Embedding` computes. Any other kind is upcast as it is."""
    kind = type(module)
    if not isinstance(module, nn.Embedding) or getattr(module, "max_norm", None) is not None:
        return False
    return kind.forward is nn.Embedding.forward or (hasattr(module, "embed_scale") and kind.__mro__[1] is nn.Embedding)


def train_dtype_except_embeddings(model: nn.Module, dtype: torch.dtype) -> Callable[[], None]:
    """Cast ``model``'s floating tensors to ``dtype`` except its input embedding and (tied or not) output head,
    which keep their stored (16-bit) dtype and compute in float32 through :class:`Fp32Embedding` and
    :class:`Fp32Head`; GPTQ layers keep their packed tensors and fp16 scales. Returns the undo of the swap
    (the casts stay). An embedding or head of another kind is cast like the rest."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    keep: set[int] = set()
    swaps: list[tuple[Callable, nn.Module]] = []
    if dtype == torch.float32 and _plain_embedding(emb) and emb.weight.dtype in (torch.float16, torch.bfloat16):
        keep.add(id(emb))
        model.set_input_embeddings(Fp32Embedding(emb))
        swaps.append((model.set_input_embeddings, emb))
        if isinstance(head, nn.Linear) and head.weight.dtype == emb.weight.dtype:
            keep.add(id(head))
            model.set_output_embeddings(Fp32Head(head))
            swaps.append((model.set_output_embeddings, head))
    for module in model.modules():
        if id(module) in keep or isinstance(module, QuantLinear):
            continue
        for _name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t is not None and t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)

    def undo() -> None:
        for setter, original in swaps:
            setter(original)
    return undo


class ScaleTuned(nn.Module):
    """A GPTQ linear whose scales train: y = x · (s0 (1 + θ)[g_idx] · (q − z))ᵀ + b, all else frozen.

    It keeps the ``QuantLinear`` (``self.layer``) with its packed ``qweight``/``qzeros``/``g_idx`` and fp16
    scales ``s0``, and owns θ [groups, out] (float32). With ``cache_codes`` it also holds (q − z) unpacked,
    one int8 per weight (int16 at 8 bits); without, the codes are unpacked inside the forward and again in
    the backward, a slice of rows at a time. Either way (:class:`_PackedScaleMatmul`) the dense weight is
    made a slice at a time and no tensor of one float per weight outlives a slice.
    """

    def __init__(self, layer: nn.Module, cache_codes: bool = False):
        super().__init__()
        self.layer = layer  # the QuantLinear the tuned scales go back into (its buffers move with .to())
        self.in_features, self.out_features, self.bits = layer.in_features, layer.out_features, layer.bits
        self.theta = nn.Parameter(torch.zeros(layer.scales.shape, dtype=torch.float32, device=layer.scales.device))
        codes = None
        if cache_codes:
            q, z = unpack_gptq(layer.qweight, layer.qzeros, layer.bits, layer.in_features, layer.out_features)
            small = torch.int8 if layer.bits <= 7 else torch.int16  # q − z lies in ±(2^bits − 1)
            codes = q.to(small) - z[layer.g_idx.long()].T.to(small)
        self.register_buffer("codes", codes, persistent=False)

    @property
    def s0(self) -> Tensor:
        return self.layer.scales.float()  # [groups, out]

    def scales(self) -> Tensor:
        return self.s0 * (1 + self.theta)

    def forward(self, x: Tensor) -> Tensor:
        layer = self.layer
        y = _PackedScaleMatmul.apply(x, self.scales(), layer.qweight, layer.qzeros, layer.g_idx, self.codes,
                                     self.bits)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)


def quant_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every ``QuantLinear`` in ``model``."""
    return [(parent, child, mod) for parent in model.modules()
            for child, mod in parent.named_children() if isinstance(mod, QuantLinear)]


def cache_codes_auto(layers: list[nn.Module]) -> bool:
    """Whether the codes of ``layers`` together fit :data:`CODES_CACHE_BYTES` at one byte per weight."""
    return sum(m.in_features * m.out_features for m in layers) <= CODES_CACHE_BYTES


def wrap_scales(model: nn.Module, progress: bool = False, cache_codes: bool | None = None) -> list[nn.Parameter]:
    """Freeze ``model``, swap each ``QuantLinear`` for a :class:`ScaleTuned`; return the θ parameters.

    ``cache_codes``: hold each layer's codes unpacked (one byte per weight; faster steps) or keep only the
    packed tensors; None (auto) caches them when all of them together take at most
    :data:`CODES_CACHE_BYTES`, i.e. on small models, where the packed path's unpacking costs more time
    than the cache costs memory."""
    found = quant_linears(model)
    if not found:
        raise LayercutError("heal --method scales tunes a GPTQ checkpoint's scales, and this model has no GPTQ "
                            "layers: quantize it first (layercut quantize), or heal it with --method lora")
    if cache_codes is None:
        cache_codes = cache_codes_auto([m for _, _, m in found])
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    for parent, child, mod in progress_bar(found, desc="scale layers", unit="layer", enabled=progress):
        tuned = ScaleTuned(mod, cache_codes)
        setattr(parent, child, tuned)
        params.append(tuned.theta)
    trim_heap()  # the unpacking's transients
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


def train_frozen_base(student: nn.Module, teacher, tokenizer, cfg: HealConfig, params: list[nn.Parameter],
                      data=None, progress: bool = True) -> tuple[int, int, float, list[float], bool]:
    """The heal loop over a student whose only trainable tensors are ``params`` (θ of :func:`wrap_scales`, or
    LoRA factors): teacher or its top-k cache, the embedding and head kept 16-bit, gradient checkpointing per
    block, AdamW. ``student`` is trained in place (left in eval mode). Returns (steps, tokens, seconds,
    losses, is the main process)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    if data is None:
        data = heal_data(tokenizer, cfg)
    accelerator = Accelerator(cpu=resolve_device(cfg.device).type == "cpu")
    set_seed(cfg.seed)
    teacher, cache = _teacher_and_cache(teacher, student, data, cfg, accelerator.device, progress)
    use_cache = getattr(student.config, "use_cache", None)
    student.config.use_cache = False
    restore = train_dtype_except_embeddings(student, torch.float32 if cfg.dtype == "auto" else torch_dtype(cfg.dtype))
    if cfg.gradient_checkpointing:  # saved activations: each block's input only; a block recomputes in backward
        _checkpointing(student, True)
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
    if cfg.gradient_checkpointing:
        _checkpointing(student, False)
    restore()
    student.config.use_cache = use_cache
    student.eval()
    return step, tokens, seconds, losses, accelerator.is_main_process


def tune_scales(student: nn.Module, teacher, tokenizer, cfg: HealConfig, source: str | Path,
                out_dir: str | Path | None = None, progress: bool = True, *, data=None,
                overwrite: bool = False) -> HealResult:
    """Train the GPTQ scales of ``student`` (loaded from the GPTQ checkpoint ``source``) toward
    ``teacher`` (a model or its top-k cache, as :func:`layercut.heal.train.heal_model` takes);
    write ``source`` with the tuned scales to ``out_dir`` atomically. ``student`` keeps its
    ``QuantLinear`` modules, now with the tuned scales."""
    out = check_output_dir(out_dir, overwrite) if out_dir is not None else None
    params = wrap_scales(student, progress)
    step, tokens, seconds, losses, is_main = train_frozen_base(student, teacher, tokenizer, cfg, params, data,
                                                               progress)
    scales = unwrap_scales(student)
    result = heal_result(cfg, step, tokens, seconds, losses, params, targets=["scales"], lora_modules=0,
                         quantized_input=True, merged=False, notes=[NOTE])
    if out is not None and is_main:
        with atomic_dir(out, overwrite) as tmp:
            write_scales(source, scales, tmp)
            write_report(tmp, out, result, _readme(result, cfg, len(scales)))
    result.model = student
    return result


def heal_result(cfg: HealConfig, steps: int, tokens: int, seconds: float, losses: list[float],
                params: list[nn.Parameter], **fields) -> HealResult:
    """The :class:`HealResult` of a :func:`train_frozen_base` run (``fields``: targets, notes, ...)."""
    return HealResult(steps=steps, tokens=tokens, seconds=seconds,
                      tokens_per_s=tokens / seconds if seconds > 0 else 0.0, loss_first=_mean(losses[:10]),
                      loss_last=_mean(losses[-10:]), trainable_params=sum(p.numel() for p in params), losses=losses,
                      config=cfg.model_dump(), **fields)


def write_report(tmp: Path, out: Path, result: HealResult, readme: str) -> None:
    """``heal.json`` (the result with its losses) and ``HEAL.md`` into the staging folder of ``out``."""
    result.output = str(out)
    (tmp / "heal.json").write_text(json.dumps(result.to_dict(with_losses=True), indent=1, default=str) + "\n")
    (tmp / "HEAL.md").write_text(readme)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def training_sentence(result: HealResult, cfg: HealConfig) -> str:
    """"by distillation (...) for N steps of B x L tokens from TEXT, lr, seed. Loss a -> b." for a HEAL.md."""
    teacher = f", the teacher's top-{cfg.teacher_topk} log-probs" if cfg.teacher_topk and cfg.loss != "lm" else ""
    return (f"by distillation ({cfg.loss}{teacher}) for {result.steps} steps of {cfg.batch} x {cfg.seq_len} tokens "
            f"from {cfg.text_label()}, lr {cfg.lr:g} ({cfg.schedule}), seed {cfg.seed}. Loss {result.loss_first:.4f} "
            f"-> {result.loss_last:.4f}.")


def _readme(result: HealResult, cfg: HealConfig, layers: int) -> str:
    return (f"# Scales tuned with layercut\n\nThe GPTQ group scales of {layers} quantized layers "
            f"({result.trainable_params:,} numbers) were trained {training_sentence(result, cfg)}\n\n"
            f"{NOTE[0].upper() + NOTE[1:]}.\n")
