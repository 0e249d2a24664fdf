"""Δ_u(c) as the true KL of swapping one unit between full quantizations (``--sensitivity kl-swap``).

Run it (what ``layercut quantize MODEL --avg-bits X --sensitivity kl-swap`` does)::

    from layercut.compress.quant.search.swap import swap_candidates, quantize_variants, measure_swaps
    cands = swap_candidates(table, baseline, None)        # e.g. [(3, -1), (3, 64), (4, 64)]
    base, variants = quantize_variants(model, calib, cfg, units, baseline, cands)
    swaps = measure_swaps(model, held, units, variants, baseline)        # held apart from calib
    alloc = allocate_bits([u.to_unit(swaps.delta[u.name]) for u in units], X, candidates=cands)

**Full quantizations.** One sequential GPTQ pass quantizes every unit at the uniform
``baseline`` (the cheap quant, e.g. 3g64): block l's Hessians come from the inputs of blocks
0..l−1 at the baseline. At each fused group's turn the same Hessian and float weights also
solve every other candidate (the probe of :func:`~layercut.compress.quant.solve.driver.quantize_model`),
so each unit has a full quantization at every candidate, all at the baseline's operating
point. Their packed tensors are kept (CPU); the baseline's are the uniform checkpoint the
fallback check compares with, so it is not quantized a second time.

**Swaps.** Δ_u(c) = KL(p_fp ‖ p_{base, u@c}) − KL(p_fp ‖ p_base): mean over the non-pad tokens
of ``held`` (calibration sequences held apart from those behind the Hessians) when unit u alone
takes its candidate-c weights and every other unit keeps the baseline's. It is measured
exactly and with one decoder block in memory: the held-apart sequences run through the blocks
once with one hidden stream per model: the float stream (the driver's own), the baseline's
stream, and one stream per swap (u, c), which starts at u's block from the baseline stream's
input and runs every later block at the baseline weights. So a swap costs the forward from its
block onward (not a whole model), and the final norm and head run once per stream at the end
(on 128-position slices). Streams live together: each is [N, L, D] float32; when they would
exceed ``max_stream_bytes`` the swaps are split over several passes (each re-runs the float and
baseline streams). Cost: Σ over swaps of (blocks after the unit + the head) on N·L tokens.

The DP (:func:`~layercut.compress.quant.search.allocate.allocate_bits`) then minimises Σ Δ_u(c_u) under
the byte budget; the stage quantizes the chosen plan sequentially and the fallback check keeps
it only when its KL beats the baseline's on a second held-apart set.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from layercut.calibrate.capture import BlockRun, first_tensor, run_blocks
from layercut.calibrate.data import CalibSet
from layercut.compress.core.arch import arch_for
from layercut.compress.core.errors import LayercutError
from layercut.compress.eval.stream_eval import head_logprobs
from layercut.compress.io.lazy import lazy_of
from layercut.compress.quant.format.pack import dequantize_gptq, pack_gptq
from layercut.compress.quant.format.result import SUPPORTED_BITS, QuantizeResult
from layercut.compress.quant.search.allocate import Candidate, Unit, candidate_label, candidate_order
from layercut.compress.quant.search.mixed import float_weights, load_weights
from layercut.compress.quant.solve.driver import linear_weight, quantize_model, set_weight
from layercut.compress.quant.solve.linear import solve_group
from layercut.compress.quant.solve.settings import SolverConfig

POSITIONS = 128  # head slices: [128, V] log-probs at a time
MAX_STREAM_BYTES = 2 << 30  # live hidden streams per pass (float32)

Packed = dict[str, Tensor]  # qweight, qzeros, scales, g_idx


def swap_candidates(units: Sequence[Unit], baseline: Candidate, explicit: Sequence[Candidate] | None,
                    ) -> list[Candidate]:
    """The candidates kl-swap measures: the user's list, or by default the baseline, the baseline's
    bits at one group per row (cheaper) and the next supported width at the baseline's group size
    (dearer) — e.g. 3ch, 3g64, 4g64 around a 3g64 baseline. Each Δ costs a forward from the unit's
    block onward, so the default set is kept to two swaps per unit."""
    if explicit is not None:
        return sorted(dict.fromkeys(explicit), key=candidate_order)
    b, gs = baseline
    out = [baseline]
    if gs != -1:
        out.append((b, -1))
    wider = [x for x in SUPPORTED_BITS if x > b]
    if wider:
        out.append((wider[0], gs))
    return sorted((c for c in out if any(u.fits(c[1]) for u in units)), key=candidate_order)


@dataclass
class Variants:
    """Packed tensors of every linear at every candidate (all solved at the baseline's operating point)."""

    baseline: Candidate
    packed: dict[Candidate, dict[str, Packed]] = field(default_factory=dict)
    solves: int = 0
    probe_seconds: float = 0.0

    def weight(self, c: Candidate, name: str) -> Tensor:
        """W [out, in] float32 of linear ``name`` at candidate ``c``."""
        t = self.packed[c][name]
        return dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], c[0])


def quantize_variants(model: nn.Module, calib: CalibSet, cfg: SolverConfig, units: Sequence, baseline: Candidate,
                      cands: Sequence[Candidate], batch_size: int = 8, device: str | torch.device | None = None,
                      progress: bool = True, after_block=None) -> tuple[QuantizeResult, Variants]:
    """Quantize ``model`` in place at the uniform ``baseline`` (sequential GPTQ) and, on the same
    Hessians and float weights, solve each unit's other fitting candidates; returns (the baseline's
    result, every candidate's packed tensors). ``units``: the allocator's units
    (:class:`~layercut.compress.quant.search.sensitivity.AllocUnit`); every one must fit the baseline.
    ``after_block(run, result)`` (e.g. a streamed writer) runs after the baseline's tensors are kept."""
    if cfg.method != "gptq":
        raise LayercutError("quantize: --sensitivity kl-swap solves GPTQ at each candidate: use --method gptq")
    bad = [u.name for u in units if not u.fits(baseline[1])]
    if bad:
        raise LayercutError(f"quantize: kl-swap baseline {candidate_label(baseline)} does not fit unit {bad[0]}")
    unit_of = {n: u for u in units for n in u.linears}
    variants = Variants(baseline, {c: {} for c in cands})

    def probe(names: list[str], Ws: list[Tensor], H: Tensor) -> None:
        t0 = time.perf_counter()
        for c in cands:
            if c == baseline:
                continue
            fit = [i for i, n in enumerate(names) if unit_of[n].fits(c[1])]
            if not fit:
                continue
            parts = solve_group([Ws[i] for i in fit], H, c[0], replace(cfg, group_size=c[1]))
            variants.solves += 1
            for i, res in zip(fit, parts):
                variants.packed[c][names[i]] = pack_gptq(res.q.cpu(), res.zeros.cpu(), res.scales.cpu(),
                                                         res.g_idx.cpu(), c[0])
        variants.probe_seconds += time.perf_counter() - t0

    def keep(run: BlockRun, result: QuantizeResult) -> None:
        prefix = f"{arch_for(model).layers_path()}.{run.index}."
        for n, q in result.layers.items():
            if n.startswith(prefix) and n not in variants.packed[baseline]:
                variants.packed[baseline][n] = dict(q.tensors)  # a streamed writer frees result's copy next
        if after_block is not None:
            after_block(run, result)

    plan = {n: baseline for u in units for n in u.linears}
    result = quantize_model(model, calib, cfg, plan, batch_size=batch_size, device=device, progress=progress,
                            probe=probe, after_block=keep)
    return result, variants


@dataclass
class SwapTable:
    """Δ_u(c) per unit (baseline 0), the baseline's own KL, and what the measurement cost."""

    delta: dict[str, dict[Candidate, float]]
    base_kl: float
    swaps: int
    passes: int
    tokens: int
    seconds: float = 0.0
    quantize_seconds: float = 0.0
    method: str = "kl-swap"
    data: str = ""  # how the held-apart sequences were drawn

    def to_dict(self) -> dict:
        return {"method": self.method, "seconds": self.seconds, "quantize_seconds": self.quantize_seconds,
                "tokens": self.tokens, "data": self.data, "base_kl": self.base_kl, "swaps": self.swaps, "passes": self.passes,
                "by_method": {self.method: {u: {candidate_label(c): v for c, v in d.items()}
                                            for u, d in self.delta.items()}}}


def _head_logprobs(model: nn.Module, h: Tensor) -> Tensor:
    """[S, D] raw last-block output -> [S, V] float32 log-probs (final norm, head, softcap)."""
    lazy = lazy_of(model)
    if lazy is not None:
        return head_logprobs(lazy, h.cpu())
    spec = arch_for(model)
    norm = model.get_submodule(f"{spec.base}.{spec.final_norm}")
    head = model.get_output_embeddings()
    x = norm(h.unsqueeze(0)).squeeze(0).to(head.weight.dtype)
    logits = head(x)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return F.log_softmax(logits.float(), dim=-1)


def _kl_sums(model: nn.Module, h_fp: list[Tensor], streams: Mapping, masks: list[Tensor]) -> tuple[dict, int]:
    """Σ over non-pad tokens of KL(p_fp ‖ p_stream) per stream; (sums, tokens)."""
    totals = {k: 0.0 for k in streams}
    count = 0
    for i, mask in enumerate(masks):
        keep = mask.bool().reshape(-1)
        ref_h = h_fp[i].reshape(-1, h_fp[i].shape[-1])[keep.to(h_fp[i].device)]
        var_h = {k: s[i].reshape(-1, s[i].shape[-1])[keep.to(s[i].device)] for k, s in streams.items()}
        for p0 in range(0, ref_h.shape[0], POSITIONS):
            ref = _head_logprobs(model, ref_h[p0 : p0 + POSITIONS])
            p = ref.exp()
            for k, h in var_h.items():
                lp = _head_logprobs(model, h[p0 : p0 + POSITIONS].to(ref_h.device))
                totals[k] += float((p * (ref - lp.to(ref.device))).sum())
        count += int(keep.sum())
    return totals, count


@torch.no_grad()
def measure_swaps(model: nn.Module, held: CalibSet, units: Sequence, variants: Variants, batch_size: int = 8,
                  device: str | torch.device | None = None, progress: bool = True,
                  max_stream_bytes: int = MAX_STREAM_BYTES) -> SwapTable:
    """Δ_u(c) for every unit and every candidate of ``variants`` it fits (see module doc).

    ``model`` must hold its *float* weights (a streamed model re-reads them per block); it is
    left unchanged. ``units``: the allocator's units, in forward order.
    """
    start = time.perf_counter()
    spec = arch_for(model)
    base = variants.baseline
    others = [c for c in variants.packed if c != base]
    swaps = [(u, c) for u in units for c in others if u.fits(c[1])]
    dim = model.config.get_text_config().hidden_size
    per_stream = held.num_samples * held.input_ids.shape[1] * dim * 4
    per_pass = max(1, int(max_stream_bytes // max(per_stream, 1)) - 1)  # the baseline stream is one of them
    chunks = [swaps[i : i + per_pass] for i in range(0, len(swaps), per_pass)] or [[]]
    by_block: dict[int, list] = {}
    for u in units:
        by_block.setdefault(u.block, []).append(u)
    kl: dict = {}
    tokens = 0
    for p, chunk in enumerate(chunks):
        starting: dict[int, list] = {}
        for u, c in chunk:
            starting.setdefault(u.block, []).append((u, c))
        streams: dict = {}

        def on_block(run: BlockRun, starting=starting, streams=streams) -> None:
            block_units = by_block.get(run.index, [])
            names = [n for u in block_units for n in u.linears]
            if "base" not in streams:
                streams["base"] = run.inputs
            prefix = f"{spec.layers_path()}.{run.index}."
            modules = {n: run.block.get_submodule(n[len(prefix):]) for n in names}
            original = {n: linear_weight(m, spec.conv1d).detach().clone() for n, m in modules.items()}
            dev = next(run.block.parameters()).device
            w_base = {n: variants.weight(base, n).to(dev) for n in names}

            def fwd(hidden: list[Tensor]) -> list[Tensor]:
                return [first_tensor(run.block(h, *run.call_args[i][0], **run.call_args[i][1]))
                        for i, h in enumerate(hidden)]

            for n, m in modules.items():
                set_weight(m, w_base[n], spec.conv1d)
            base_in = streams["base"]
            for key in list(streams):  # the baseline stream and every swap started in an earlier block
                streams[key] = fwd(streams[key])
            for u, c in starting.get(run.index, []):
                for n in u.linears:
                    set_weight(modules[n], variants.weight(c, n).to(dev), spec.conv1d)
                streams[(u.name, c)] = fwd(base_in)
                for n in u.linears:
                    set_weight(modules[n], w_base[n], spec.conv1d)
            for n, m in modules.items():
                set_weight(m, original[n], spec.conv1d)
            run.invalidate()  # the float stream runs on the float weights

        h_fp = run_blocks(model, held, [on_block], batch_size=batch_size, device=device, progress=progress,
                          desc=f"kl-swap {p + 1}/{len(chunks)}")
        masks = [m for _, m in held.split(batch_size)]
        sums, tokens = _kl_sums(model, h_fp, streams, masks)
        for k, v in sums.items():
            kl.setdefault(k, v / max(tokens, 1))
        lazy = lazy_of(model)
        if lazy is not None:
            lazy.release_outside()
    if tokens == 0:
        raise LayercutError("quantize: kl-swap: no non-pad tokens in the held-apart sequences")
    base_kl = kl["base"]
    delta = {u.name: {base: 0.0} for u in units}
    for u, c in swaps:
        delta[u.name][c] = kl[(u.name, c)] - base_kl
    return SwapTable(delta, base_kl, len(swaps), len(chunks), tokens, time.perf_counter() - start)


def check_swap_table(table: SwapTable, units: Sequence, cands: Sequence[Candidate]) -> None:
    """Every unit has a finite Δ at each candidate it fits (what the allocator needs)."""
    for u in units:
        for c in cands:
            if u.fits(c[1]):
                v = table.delta[u.name].get(c)
                if v is None or not torch.isfinite(torch.tensor(v)):
                    raise LayercutError(f"quantize: kl-swap: no finite Δ for {u.name} at {candidate_label(c)} "
                                        "(non-finite logits?)")



def kl_swap_table(model: nn.Module, calib: CalibSet, held: CalibSet, units: Sequence, cands: Sequence[Candidate],
                  baseline: Candidate, cfg: SolverConfig, batch_size: int = 8,
                  device: str | torch.device | None = None, progress: bool = True,
                  stream=None) -> tuple[SwapTable, QuantizeResult | None]:
    """Both steps for the stage: the full quantizations, then the swaps on ``held``; returns (the
    table, the baseline's result for the fallback check; None when streamed, where the baseline
    was written into ``stream``'s ``.uniform`` as it went). ``model`` holds its float weights again
    on return (a copy of the target linears is restored; a streamed model re-reads them)."""
    t0 = time.perf_counter()
    fp = float_weights(model) if stream is None else None
    writer = stream.block_writer("uniform") if stream is not None else None
    base, variants = quantize_variants(model, calib, cfg, units, baseline, cands, batch_size=batch_size,
                                       device=device, progress=progress, after_block=writer)
    if stream is not None:
        stream.finish("uniform", base)
    else:
        load_weights(model, fp)
        del fp
    quantize_s = time.perf_counter() - t0
    table = measure_swaps(model, held, units, variants, batch_size=batch_size, device=device, progress=progress)
    check_swap_table(table, units, cands)
    table.quantize_seconds = quantize_s
    table.seconds += quantize_s
    return table, (base if stream is None else None)
