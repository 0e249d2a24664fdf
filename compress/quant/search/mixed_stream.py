"""Mixed bits with one decoder block in memory: both candidates written as they go, the fallback KL streamed.

Used by ``layercut quantize MODEL --avg-bits X`` on a streamed (lazily loaded) model::

    outputs = StreamedOutputs(lazy, tmp_dir, torch.float16)
    result = quantize_model(lazy.model, calib, cfg, plan, after_block=outputs.block_writer("mixed"))
    verdict, kept = outputs.fallback_check(calib, held, cfg, result, uniform_plan)
    outputs.keep(verdict.keep)            # the kept checkpoint's files move up into tmp_dir

The sensitivity pass (:func:`layercut.compress.quant.search.sensitivity.measure_sensitivity`, measures
``loss`` / ``output``) already runs on the capture driver, so it streams as it is. The
mixed plan is quantized block by block into ``<folder>/.mixed``; with the fallback check the
uniform baseline is quantized the same way into ``<folder>/.uniform``, from the source's own
float weights (each block is re-read for its turn, so no float copy is kept). The check's
KL(p_fp ‖ p_variant) runs the held-apart sequences through the source block by block with
one hidden stream per model: at each block's turn the float block runs the float stream,
then its target linears take each variant's weights, decoded from that variant's written
tensors, for the variant's stream. The final norm and head run on 128-position slices.
Memory: one block, its float target weights once more, and one [N, L, D] stream per model.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from layercut.calibrate.capture import BlockRun, first_tensor, run_blocks
from layercut.calibrate.data import CalibSet
from layercut.compress.core.shards import ShardWriter
from layercut.compress.eval.stream_eval import head_logprobs
from layercut.compress.io.lazy import LazyModel, TensorIndex
from layercut.compress.quant.format.checkpoint import write_block_fn, write_rest
from layercut.compress.quant.format.pack import dequantize_gptq
from layercut.compress.quant.format.result import QuantizeResult
from layercut.compress.quant.search.mixed import FallbackVerdict
from layercut.compress.quant.solve.driver import linear_weight, quantize_model, set_weight
from layercut.compress.quant.solve.settings import SolverConfig

POSITIONS = 128  # positions per head slice: [128, V] log-probs at a time


class StreamedOutputs:
    """The checkpoints a streamed mixed-bit run writes: ``.mixed`` and, if checked, ``.uniform``."""

    def __init__(self, lazy: LazyModel, folder: str | os.PathLike, save_dtype: torch.dtype,
                 max_shard_size: str | int = "2GB") -> None:
        self.lazy, self.folder, self.save_dtype, self.max_shard_size = lazy, Path(folder), save_dtype, max_shard_size
        self.writers: dict = {}
        self.results: dict[str, QuantizeResult] = {}

    def block_writer(self, kind: str) -> Callable[[BlockRun, QuantizeResult], None]:
        """The ``after_block`` callback that writes ``kind``'s quantized blocks into ``.kind``."""
        sub = self.folder / f".{kind}"
        sub.mkdir()
        self.writers[kind] = ShardWriter(sub, self.max_shard_size, always_index=True)
        return write_block_fn(self.lazy, self.writers[kind], self.save_dtype)

    def discard(self, kind: str) -> None:
        """Drop ``kind``'s unfinished checkpoint (its blocks so far), so it can be written again."""
        self.writers.pop(kind).abort()
        shutil.rmtree(self.folder / f".{kind}")

    def finish(self, kind: str, result: QuantizeResult) -> None:
        """After ``kind``'s last block: its non-block tensors, index and config."""
        write_rest(self.lazy, result, self.writers.pop(kind), self.folder / f".{kind}", self.save_dtype)
        self.results[kind] = result

    def keep(self, kind: str) -> None:
        """Move ``kind``'s files up into the folder; delete every other variant."""
        for name in list(self.results):
            sub = self.folder / f".{name}"
            if name == kind:
                for file in sub.iterdir():
                    os.replace(file, self.folder / file.name)
                sub.rmdir()
            else:
                shutil.rmtree(sub)

    def fallback_check(self, calib: CalibSet | None, check: CalibSet, cfg: SolverConfig, mixed: QuantizeResult,
                       uniform_plan: Mapping[str, tuple[int, int]], batch_size: int = 8,
                       device: str | torch.device | None = None,
                       progress: bool = True) -> tuple[FallbackVerdict, QuantizeResult]:
        """Quantize the uniform baseline (streamed; unless ``.uniform`` is already finished, as
        kl-swap's baseline pass leaves it), then keep whichever of mixed / uniform has the
        lower KL to the source on ``check`` (ties keep uniform, as the whole-model check does)."""
        self.finish("mixed", mixed)
        if "uniform" not in self.results:
            uniform = quantize_model(self.lazy.model, calib, cfg, dict(uniform_plan), batch_size=batch_size,
                                     device=device, progress=progress, after_block=self.block_writer("uniform"))
            self.finish("uniform", uniform)
        kls, tokens = streamed_kl(self.lazy, check, {k: (self.folder / f".{k}", r) for k, r in self.results.items()},
                                  batch_size=batch_size, device=device, progress=progress)
        keep = "mixed" if kls["mixed"] < kls["uniform"] else "uniform"
        verdict = FallbackVerdict(kls["mixed"], kls["uniform"], keep, check.num_samples, tokens)
        return verdict, self.results[keep]


def _decoded(index: TensorIndex, name: str, bits: int) -> Tensor:
    """W [out, in] of linear ``name`` decoded from a written GPTQ checkpoint."""
    t = {k: index.get(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
    return dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)


@torch.no_grad()
def streamed_kl(lazy: LazyModel, check: CalibSet, variants: Mapping[str, tuple[Path, QuantizeResult]],
                batch_size: int = 8, device: str | torch.device | None = None,
                progress: bool = True) -> tuple[dict[str, float], int]:
    """Mean over non-pad tokens of KL(p_source ‖ p_variant) for each written variant; (kls, tokens)."""
    spec = lazy.spec
    indexes = {k: TensorIndex(path) for k, (path, _) in variants.items()}
    streams: dict[str, list[Tensor]] = {}

    def on_block(run: BlockRun) -> None:
        prefix = f"{spec.layers_path()}.{run.index}."
        names = [n for n in next(iter(variants.values()))[1].layers if n.startswith(prefix)]
        modules = {n: run.block.get_submodule(n[len(prefix):]) for n in names}
        original = {n: linear_weight(m, spec.conv1d).detach().clone() for n, m in modules.items()}
        for kind, (_, result) in variants.items():
            hidden = streams.get(kind, run.inputs)
            for n, m in modules.items():
                set_weight(m, _decoded(indexes[kind], n, result.layers[n].bits).to(original[n].device), spec.conv1d)
            streams[kind] = [first_tensor(run.block(h, *run.call_args[i][0], **run.call_args[i][1]))
                             for i, h in enumerate(hidden)]
        for n, m in modules.items():
            set_weight(m, original[n], spec.conv1d)
        run.invalidate()  # the float stream runs on the float weights

    h_fp = run_blocks(lazy.model, check, [on_block], batch_size=batch_size, device=device, progress=progress,
                      desc="fallback check")
    totals = {k: 0.0 for k in variants}
    count = 0
    for i, (_, mask) in enumerate(check.split(batch_size)):
        keep = mask.bool().reshape(-1)
        ref_h = h_fp[i].reshape(-1, h_fp[i].shape[-1])[keep.to(h_fp[i].device)]
        var_h = {k: s[i].reshape(-1, s[i].shape[-1])[keep.to(s[i].device)] for k, s in streams.items()}
        for p0 in range(0, ref_h.shape[0], POSITIONS):
            ref = head_logprobs(lazy, ref_h[p0 : p0 + POSITIONS].cpu())
            for k, h in var_h.items():
                lp = head_logprobs(lazy, h[p0 : p0 + POSITIONS].cpu())
                totals[k] += float((ref.exp() * (ref - lp)).sum())
        count += int(keep.sum())
    lazy.release_outside()
    return {k: v / max(count, 1) for k, v in totals.items()}, count
