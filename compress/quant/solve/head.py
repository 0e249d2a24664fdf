"""GPTQ for the untied output head (``lm_head``, ``embed_out``, ...), after the decoder blocks.

Run it::

    from layercut.compress.quant.solve.driver import quantize_model
    result = quantize_model(model, calib, cfg, head=(8, 128))   # cfg: plan.solver (compress/quant/plan.py)
    result.layers["lm_head"].tensors          # packed like every other linear; result.head == "lm_head"

or ``layercut quantize MODEL -o OUT --bits 4 --quantize-head 8g128``.

The head's input is the final norm of the last block's raw output, x = norm(h_L), so its
Hessian H = 2/N Σ x xᵀ is [hidden, hidden] (small) and is folded from the activations the
driver already holds after the last block (:func:`head_hessian`): no extra model forward, and
the head sees the quantized blocks' outputs, as every linear sees its quantized prefix. The
weight [vocab, hidden] is solved in slices of ``HEAD_ROWS`` rows (:func:`quantize_head`): GPTQ
treats rows independently given H (Frantar et al. 2022, §3; column order, damping and static
groups depend on H or on the row alone), so the slices give the codes of one solve while only
one slice is in float32 (a 128k x 4096 head is 2 GiB in float32). A streamed model's final
norm and head are read for this and released. Tied heads are refused (:func:`check_head`).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import Tensor, nn

from layercut.compress.core.arch import arch_for, get_submodule
from layercut.compress.core.errors import LayercutError
from layercut.compress.io.lazy import lazy_of
from layercut.compress.quant.format.pack import pack_gptq
from layercut.compress.quant.format.result import SUPPORTED_BITS, QuantizedLinear, QuantizeResult
from layercut.compress.quant.solve.gptq import hessian_update
from layercut.compress.quant.solve.linear import check_finite, solve, solve_dtype, solver_threads
from layercut.compress.quant.solve.settings import SolverConfig

HEAD_ROWS = 16384  # head rows solved (and upcast to float32) at once; a multiple of 32 (packed zeros)


def output_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(module name, module) of the output head; None if the model has none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = None if head is None else next((n for n, m in model.named_modules() if m is head), None)
    return None if name is None else (name, head)


def head_is_tied(model: nn.Module) -> bool:
    """True if the output head shares its weight with the input embedding (``tie_word_embeddings``)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "tie_word_embeddings", False):
        return True
    found, emb = output_head(model), model.get_input_embeddings()
    return found is not None and emb is not None and found[1].weight is emb.weight


def check_head(model: nn.Module, bits: int, group_size: int) -> str:
    """Validate head quantization before any work; return the head's module name.

    Refuses: a model without an output head, a tied head (quantizing it would quantize the
    embedding too, which no GPTQ loader reads), a head that is not a dense ``nn.Linear``,
    bits outside {2,3,4,8}, a group size that does not divide the hidden size.
    """
    found = output_head(model)
    if found is None:
        raise LayercutError("quantize: --quantize-head: the model has no output head")
    name, head = found
    if head_is_tied(model):
        raise LayercutError(f"quantize: --quantize-head: the model's head ({name}) is tied to its input "
                            "embedding; only an untied head can be quantized (untying does not pay: on "
                            "SmolLM2-135M at 4 bits it adds 15 MB with a 4g64 head, 30 MB with 8g64, to "
                            "115 MB, and no KL gain; benchmarks/head.py)")
    if not isinstance(head, nn.Linear):
        raise LayercutError(f"quantize: --quantize-head: {name} is a {type(head).__name__}, not a linear layer")
    if bits not in SUPPORTED_BITS:
        raise LayercutError(f"quantize: --quantize-head: bits must be one of {SUPPORTED_BITS}, got {bits}")
    hidden = head.in_features
    if group_size != -1 and (group_size <= 0 or hidden % group_size):
        raise LayercutError(f"quantize: --quantize-head: group size {group_size} does not divide the hidden "
                            f"size {hidden} of {name}; use a divisor of it or -1 (ch)")
    if not head.weight.is_meta:
        check_finite(head.weight, name)
    return name


def final_norm(model: nn.Module) -> nn.Module:
    """The norm between the last block and the head (materialized for a streamed model)."""
    spec = arch_for(model)
    path = f"{spec.base}.{spec.final_norm}"
    lazy = lazy_of(model)
    return lazy.materialize(path) if lazy is not None else get_submodule(model, path)


@torch.no_grad()
def head_hessian(model: nn.Module, hidden: list[Tensor], masks: list[Tensor]) -> tuple[Tensor, int]:
    """H = 2/N Σ x xᵀ over the non-pad tokens of x = norm(h_L), float64 [hidden, hidden]; (H, N).

    ``hidden``: the raw last-block outputs per micro-batch [B, L, D] (what
    :func:`~layercut.calibrate.capture.run_blocks` returns), ``masks`` [B, L] likewise."""
    norm = final_norm(model)
    H, n = None, 0
    for h, mask in zip(hidden, masks):
        dev = next(norm.parameters(), h).device
        x = norm(h.to(dev)).float()  # [B, L, D]
        Hb, m = hessian_update(None, 0, x, mask.to(x.device), dtype=torch.float32)
        if m:  # a float64 running mean of float32 micro-batch products, as HessianSet does
            H = Hb.double() if H is None else H.mul_(n / (n + m)).add_(Hb, alpha=m / (n + m))
            n += m
        del x, Hb
    if H is None:
        raise LayercutError("quantize: no calibration tokens reached the head (all padding?)")
    if not torch.isfinite(H.sum()):
        raise LayercutError("quantize: the head's Hessian has NaN/Inf (non-finite final-norm outputs)")
    return H, n


@torch.no_grad()
def quantize_head(
    model: nn.Module,
    H: Tensor | None,
    bits: int,
    group_size: int,
    cfg: SolverConfig,
    result: QuantizeResult,
    device: str | torch.device | None = None,
    rows: int = HEAD_ROWS,
) -> QuantizedLinear:
    """GPTQ (or RTN, ``H`` None) the output head in slices of ``rows`` rows; record it in ``result``.

    A resident head's weight becomes its dequantized weight (as every other linear's does); a
    streamed model's head is read for this and released (its packed tensors are in ``result``).
    """
    name = check_head(model, bits, group_size)
    lazy = lazy_of(model)
    head = lazy.head() if lazy is not None else model.get_submodule(name)
    weight = head.weight  # [vocab, hidden]
    out_f, in_f = weight.shape
    dev = torch.device(device) if device is not None else weight.device
    hcfg = replace(cfg, bits=bits, group_size=group_size)
    if H is not None:
        H = H.to(device=dev, dtype=solve_dtype(cfg))  # one copy; each slice's solve copies it again
    rows = max(32, rows - rows % 32)
    parts: list[dict[str, Tensor]] = []
    loss, damp_used = 0.0, 0.0
    t0 = time.perf_counter()
    for r0 in range(0, weight.shape[0], rows):
        W = weight[r0 : r0 + rows].detach().to(device=dev, dtype=torch.float32)
        check_finite(W, name)
        res = solve(W, H, bits, hcfg)
        loss += res.loss
        damp_used = res.damp_used
        with solver_threads(torch.device("cpu")):
            parts.append(pack_gptq(res.q.cpu(), res.zeros.cpu(), res.scales.cpu(), res.g_idx.cpu(), bits))
        if lazy is None:
            weight.data[r0 : r0 + rows].copy_(res.dequant.to(weight.dtype))
        del W, res
    result.solve_seconds += time.perf_counter() - t0
    del weight, head
    if lazy is not None:
        lazy.release(name)
        lazy.release(f"{lazy.spec.base}.{lazy.spec.final_norm}")
    # qweight [in·b/32, out], qzeros [groups, out·b/32], scales [groups, out]: slices join along out
    packed = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("qweight", "qzeros", "scales")}
    packed["g_idx"] = parts[0]["g_idx"]
    stored = sum(t.numel() * t.element_size() * 8 for k, t in packed.items() if k != "g_idx")
    ql = QuantizedLinear(name, bits, group_size, in_f, out_f, packed, loss, damp_used, stored)
    result.layers[name] = ql
    result.head = name
    return ql
