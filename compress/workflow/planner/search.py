"""``layercut plan``: the best model for a size target, over depth cuts × bits.

Usage::

    layercut plan bundled:smollm2-135m --target-size 40% -o plans/p40
    from layercut.compress.workflow.planner.search import plan
    report = plan(PlanConfig(size="40%"), "bundled:smollm2-135m", "plans/p40")

How (predict cheaply, then verify):

1. **Exact bytes** of every candidate from the shapes alone (:mod:`.space`); everything that
   cannot fit, and every bad request, is refused before any work.
2. **Depth cuts** d = d_min, d_min+1, …: each is the prune stage as it is today (blocks
   chosen by block influence, each replaced by a least-squares map), written and measured:
   its KL to the source on held-apart calibration windows (:class:`.measure.KLJudge`). The
   blocks are scored once (the first cut) and every later cut selects from those scores
   (block influence does not depend on how many go, so the removed sets are nested). The
   first cut's best predicted candidate is verified (step 5) before any deeper cut, so the
   depth search works with calibrated predictions and a measured best. A cut none of whose
   candidates fits is not run (its blocks are known from the scores). A cut is skipped when
   even its best candidate cannot beat the best so far: its KL is at least the deepest
   measured cut's, plus its cheapest (calibrated) quantization term (its removed blocks, hence
   its candidates' bytes, are known from the scores before it runs). The loop stops once a cut
   alone is worse than the best so far (deeper cuts only lose more), at ``max_drop``, or at a
   third of the time budget.
3. **Quantization** is predicted with round-to-nearest on the full-depth source (no data):
   KL_q(c) per uniform (bits, group size); a mixed ``--avg-bits`` budget X reads KL_q off the
   uniform frontier (log-linear in average bits between its two neighbours).
4. **Composition**: KL(d, q) ≈ KL(d) + s·KL_q(q)·kept/depth (additive; the quantization term
   scaled by the share of blocks left, and by s, GPTQ's KL per RTN KL, 1 until a candidate is
   verified). How good that is: ``plan.json`` has predicted and measured KL of every verified
   candidate and their Spearman.
5. **Verify** ``top_k`` candidates, one at a time (the first during the depth search, above):
   after each, s is re-learnt (the median over the verified of (measured − KL(d)) /
   (KL_q·kept/depth)) and the rest re-ranked by that calibrated prediction. Quantize (GPTQ,
   the stage's defaults with the plan's calibration) or export (bf16) for real, measure bytes
   and KL; the best measured that fits wins, is exported with a model card (``OUT/model``),
   and its resolved recipe is written so ``layercut run OUT/recipe.yaml`` rebuilds it.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

from layercut.calibrate.sources import TextSource
from layercut.compress.core.errors import LayercutError
from layercut.compress.core.hfconfig import is_quantized
from layercut.compress.core.save import atomic_dir, check_output_dir
from layercut.compress.depth.config import PruneConfig
from layercut.compress.depth.prune import choose_layers
from layercut.compress.io.models import load_tokenizer, resolve_model, weight_bytes
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.workflow.planner.config import PlanConfig
from layercut.compress.workflow.planner.measure import KLJudge, decode_tokens_per_s, spearman
from layercut.compress.workflow.planner.report import plot_pareto, table
from layercut.compress.workflow.planner.space import (
    Candidate,
    Layout,
    enumerate_candidates,
    pair_label,
    smallest_bytes,
    uniform_configs,
)
from layercut.compress.workflow.recipe import Recipe
from layercut.compress.workflow.stages import export as export_stage
from layercut.compress.workflow.stages import prune as prune_stage
from layercut.compress.workflow.stages import quantize as quantize_stage
from layercut.compress.workflow.stages.base import RunEnv
from layercut.export.config import ExportConfig
from layercut.export.export import probe_writable

log = logging.getLogger("layercut.plan")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def check_request(config: PlanConfig, layout: Layout) -> dict:
    """Every refusal that needs only the shapes: one LayercutError line each."""
    n = layout.num_blocks
    bf16 = layout.bf16_bytes
    target = config.target_bytes(bf16)
    configs = uniform_configs(layout, config.bits, config.group_sizes)
    if not configs:
        raise LayercutError(f"plan: none of the group sizes {config.group_sizes} divides every quantized layer's "
                            f"inputs ({sorted(layout.linear_inputs())})")
    if target >= bf16:
        raise LayercutError(f"plan: target {config.size} ({_mb(target)}) is not below the source's size in bf16 "
                            f"({_mb(bf16)}): nothing to compress")
    max_drop = config.max_drop_count(n)
    d_min = config.min_drop(n)
    if d_min > max_drop or n - d_min < 1:
        best = n / max(n - max_drop, 1)
        raise LayercutError(f"plan: --min-speedup {config.min_speedup:g} needs at most {n - d_min} of {n} blocks "
                            f"kept, but at most {max_drop} may be removed (max_drop {config.max_drop}); the "
                            f"largest reachable speedup is {best:.3g}")
    smallest = smallest_bytes(layout, max_drop, configs)
    if target < smallest:
        cheapest = min(configs, key=lambda c: layout.quantized_bytes(range(n - max_drop), c))
        raise LayercutError(f"plan: target {config.size} ({target:,} bytes) is below the smallest candidate, "
                            f"{smallest:,} bytes = {_mb(smallest)} ({100 * smallest / bf16:.1f}% of bf16: "
                            f"{max_drop} of {n} blocks removed, {pair_label(cheapest)}); raise the target or "
                            "--max-drop")
    return {"target": target, "configs": configs, "max_drop": max_drop, "d_min": d_min}


def _interp(x: float, points: list[tuple[float, float]]) -> float:
    """log-linear interpolation of KL over average bits on the frontier ``points`` (sorted by bits)."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            t = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
            return math.exp((1 - t) * math.log(max(y0, 1e-9)) + t * math.log(max(y1, 1e-9)))
    return pts[-1][1]


def plan(config: PlanConfig, source: str, output: str | Path, progress: bool = True,
         overwrite: bool = False) -> dict:
    """Search, verify, write the winner into ``output``; returns the report (also ``plan.json``)."""
    start = time.perf_counter()
    check_output_dir(output, overwrite)
    src = resolve_model(source)
    if is_quantized(src):
        raise LayercutError(f"plan: {src} is already quantized; plan from the dense original")
    try:
        layout = Layout.of(src)
    except LayercutError as exc:
        raise LayercutError(f"plan: {exc}") from None
    req = check_request(config, layout)
    probe_writable(Path(output))
    with atomic_dir(output, overwrite) as tmp:
        report = _search(config, source, src, layout, req, Path(tmp), progress, start)
    report["output"] = str(output)
    return report


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"plan: {text}", file=sys.stderr, flush=True)


def _search(config: PlanConfig, spec: str, src: Path, layout: Layout, req: dict, out: Path, progress: bool,
            start: float) -> dict:
    budget_s = config.budget_minutes * 60 if config.budget_minutes else math.inf
    work = out / ".work"
    work.mkdir()
    n, target = layout.num_blocks, req["target"]
    tokenizer = load_tokenizer(src)
    judge = KLJudge(src, tokenizer, [TextSource(source=config.calib)], config.kl_samples, config.seq_len,
                    config.seed, calib_samples=max(config.samples, config.prune_samples))
    _say(progress, f"target {_mb(target)} ({100 * target / layout.bf16_bytes:.1f}% of bf16); KL judged on "
                   f"{judge.tokens} tokens ({judge.how})")
    timings: dict[str, float] = {}
    kl_q: dict = {}  # RTN KL per config, measured the first time a fitting candidate needs it
    timings["predict_quant_s"] = 0.0
    full = list(range(n))

    def rtn(c) -> float:
        if c not in kl_q:
            t = time.perf_counter()
            kl_q[c] = judge.rtn_kl(c)
            timings["predict_quant_s"] += time.perf_counter() - t
            _say(progress, f"RTN {pair_label(c)}: KL {kl_q[c]:.4g}")
        return kl_q[c]

    def mixed_kl(c: Candidate) -> float:  # log-linear between the two uniform configs it mixes
        return _interp(c.avg_bits, [(layout.allocator_bits(full, p), rtn(p)) for p in c.pairs])

    def quant_term(c: Candidate) -> float:  # 0 where an RTN KL it needs is not measured yet (a lower bound)
        if c.quant == "dense":
            return 0.0
        pairs = [(c.bits, c.group_size)] if c.quant == "uniform" else list(c.pairs)
        if any(p not in kl_q for p in pairs):
            return 0.0
        return kl_q[pairs[0]] if c.quant == "uniform" else mixed_kl(c)

    candidates: list[Candidate] = []
    verified: list[Candidate] = []
    cuts: dict[int, dict] = {}
    skipped: dict[int, float | None] = {}  # cut -> the bound that showed it cannot beat the best (None: nothing fits)
    scores: dict | None = None  # block influence, scored by the first cut and reused by every later one
    last_kl, best = None, None
    scale = 1.0  # GPTQ's KL / RTN's, learnt from the verified candidates (starts at 1: plain RTN)
    timings["verify_s"] = 0.0

    def calibrate(c: Candidate) -> float:  # the prediction with the RTN term rescaled by what was learnt
        c.calibrated_kl = c.kl_depth + scale * c.kl_quant * c.kept_blocks / n
        return c.calibrated_kl

    def verify(c: Candidate) -> float:  # run it for real; returns the re-learnt RTN -> GPTQ scale
        t = time.perf_counter()
        c.path = _realize(config, c, cuts[c.drop], src, work / f"cand{len(verified)}", progress)
        c.measured_bytes = weight_bytes(c.path)
        c.measured_kl = judge.kl_path(c.path)
        c.verified = True
        verified.append(c)
        timings["verify_s"] += time.perf_counter() - t
        _say(progress, f"verified {c.label}: predicted KL {c.predicted_kl:.4g} (calibrated {c.calibrated_kl:.4g}), "
                       f"measured {c.measured_kl:.4g}, {_mb(c.measured_bytes)}")
        ratios = sorted(max(v.measured_kl - v.kl_depth, 0.0) / (v.kl_quant * v.kept_blocks / n)
                        for v in verified if v.quant != "dense" and v.kl_quant > 0)
        return ratios[len(ratios) // 2] if ratios else scale

    def best_known() -> float | None:  # measured where verified, else the calibrated prediction
        return min((c.measured_kl if c.verified else calibrate(c) for c in candidates), default=None)

    t0 = time.perf_counter()
    for d in range(req["d_min"], req["max_drop"] + 1):
        if d and scores is not None:  # the cut's blocks, hence its candidates' bytes, are known: look first
            kept = [i for i in range(n) if i not in _removed(scores, d)]
            ahead = enumerate_candidates(layout, {d: kept}, target, req["configs"], mixed=config.mixed,
                                         dense=config.dense)
            if not ahead:
                skipped[d] = None
                _say(progress, f"cut {d}: skipped (no candidate fits)")
                continue
            bound = math.inf if last_kl is None or best is None else cut_bound(
                last_kl, [scale * quant_term(c) for c in ahead], len(kept), n)
            if best is not None and bound >= best:
                skipped[d] = bound
                _say(progress, f"cut {d}: skipped (its candidates' KL is at least {bound:.4g}, best so far "
                               f"{best:.4g})")
                continue
        cut = _cut(config, spec, src, d, work, judge, progress, scores)
        scores = scores if scores is not None else cut.get("scores")
        last_kl = cut["kl"]
        cuts[d] = cut
        new = enumerate_candidates(layout, {d: cut["kept"]}, target, req["configs"], mixed=config.mixed,
                                   dense=config.dense)
        share = len(cut["kept"]) / n
        for c in new:
            c.kl_depth = cut["kl"]
            c.kl_quant = 0.0 if c.quant == "dense" else rtn((c.bits, c.group_size)) if c.quant == "uniform" \
                else mixed_kl(c)
            c.predicted_kl = c.kl_depth + c.kl_quant * share
            calibrate(c)
        candidates += new
        if new and not verified:
            # verify the first cut's best predicted candidate before going deeper: RTN's KL is several
            # times GPTQ's, and the learnt scale keeps the depth search from chasing that overestimate
            scale = verify(min(new, key=lambda c: c.predicted_kl))
        best = best_known()
        _say(progress, f"cut {d}: KL {cut['kl']:.4g}, {len(new)} candidates fit"
                       + (f", best so far {best:.4g}" if best is not None else ""))
        if best is not None and cut["kl"] >= best:
            break  # deeper cuts alone already lose more than the best candidate
        if time.perf_counter() - start > budget_s / 3 and best is not None:
            _say(progress, "a third of the time budget is spent: no deeper cuts")
            break
    timings["predict_depth_s"] = time.perf_counter() - t0 - timings["predict_quant_s"] - timings["verify_s"]
    if not candidates:
        raise LayercutError(f"plan: no candidate fits {_mb(target)} within {req['max_drop']} removed blocks")
    ranked = sorted(candidates, key=lambda c: c.predicted_kl)
    pool = [c for c in ranked if not c.verified]
    while pool and len(verified) < config.top_k:
        if verified and time.perf_counter() - start > budget_s:
            _say(progress, "time budget spent: stopping verification")
            break
        pool.sort(key=calibrate)
        scale = verify(pool.pop(0))
    fitting = [c for c in verified if c.measured_bytes <= target]
    if not fitting:
        raise LayercutError(f"plan: no verified candidate fits {_mb(target)} (measured "
                            f"{', '.join(_mb(c.measured_bytes) for c in verified)})")
    winner = min(fitting, key=lambda c: c.measured_kl)

    recipe = Recipe(model=spec, name=f"layercut plan: {winner.label} for {config.size}", seed=config.seed,
                    stages=_stages(config, winner, cuts[winner.drop]))
    (out / "recipe.yaml").write_text(recipe.to_yaml())
    export_stage.run(ExportConfig(), winner.path, out / "model", RunEnv(progress=False),
                     extra_files={"recipe.yaml": recipe.to_yaml()})
    speed = None
    if config.min_speedup is not None:
        base = decode_tokens_per_s(src, tokenizer)
        cut = decode_tokens_per_s(cuts[winner.drop]["path"], tokenizer) if winner.drop else base
        mine = decode_tokens_per_s(out / "model", tokenizer)
        speed = {"source_tokens_per_s": round(base, 2), "cut_tokens_per_s": round(cut, 2),
                 "winner_tokens_per_s": round(mine, 2), "depth_speedup": round(cut / base, 3),
                 "measured_speedup": round(mine / base, 3),
                 "how": "batch-1 greedy decode of 8 tokens after a 32-token prompt, float32 compute on this "
                        "machine; depth_speedup: the dense cut vs the source (what the removed blocks buy); "
                        "measured_speedup: the written checkpoint (on CPU, GPTQ layers run layercut's "
                        "dequantizing reference kernel)"}
    shutil.rmtree(work)
    predicted = [c.predicted_kl for c in verified]
    calibrated = [c.calibrated_kl for c in verified]
    measured = [c.measured_kl for c in verified]
    composition = [{"label": c.label, "kl_depth": c.kl_depth, "kl_quant_rtn": c.kl_quant,
                    "predicted": c.predicted_kl, "calibrated": c.calibrated_kl, "measured": c.measured_kl,
                    "ratio": round(c.measured_kl / c.predicted_kl, 4) if c.predicted_kl else None}
                   for c in verified]
    report = {
        "layercut_plan": 1,
        "model": spec,
        "target": config.size,
        "target_bytes": target,
        "bf16_bytes": layout.bf16_bytes,
        "bytes_counted": "safetensors weight files (data + headers), as `layercut eval` reports bytes; "
                         "JSON side files not counted",
        "config": config.model_dump(mode="json"),
        "kl_text": f"{judge.tokens} tokens of {config.calib}: {judge.how}",
        "rtn_kl": {f"{b}{'ch' if g == -1 else f'g{g}'}": v for (b, g), v in kl_q.items()},
        "cuts": {str(d): {"kl": c["kl"], "removed": c["removed"]} for d, c in cuts.items()},
        "skipped_cuts": {str(d): b for d, b in skipped.items()},
        "candidates": [c.to_dict() | {"path": None} for c in ranked],
        "verified": len(verified),
        "spearman_topk": spearman(predicted, measured),
        "spearman_topk_calibrated": spearman(calibrated, measured),
        "rtn_to_gptq_scale": round(scale, 4),
        "composition": composition,
        "winner": winner.to_dict() | {"path": "model"},
        "speed": speed,
        "timings": {k: round(v, 2) for k, v in timings.items()} | {"total_s": round(time.perf_counter() - start, 2)},
    }
    (out / "plan.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    report["plot"] = plot_pareto(report, out / "plan.png")
    if progress:
        print(table(report), file=sys.stderr)
    return report


def cut_bound(last_kl: float, quant_terms: list[float], kept: int, n: int) -> float:
    """The least predicted KL any candidate of a deeper cut can have: its depth term is at least
    ``last_kl`` (the deepest cut measured; deeper cuts only lose more) plus its cheapest
    quantization term scaled by the share of blocks kept. No candidate fits: infinite.

    >>> cut_bound(0.5, [0.5, 0.25], 15, 30)
    0.625
    """
    return last_kl + min(quant_terms) * kept / n if quant_terms else math.inf


def _removed(scores: dict, d: int) -> list[int]:
    """The blocks the prune stage removes for cut ``d`` (block influence, block 0 kept), from ``scores``."""
    return choose_layers(None, None, "block", d, "block-influence", None, 1, False, keep_first=True,
                         scores=scores)[0]


def _cut(config: PlanConfig, spec: str, src: Path, d: int, work: Path, judge, progress: bool,
         scores: dict | None = None) -> dict:
    """Depth cut ``d`` through the prune stage (written to ``work``), and its KL. ``scores``: the
    block influence of an earlier cut (the same calibration), so the stage does not score again;
    the cut returns the scores it selected with."""
    n = judge.model.config.num_hidden_layers
    if d == 0:
        return {"kept": list(range(n)), "kl": 0.0, "removed": [], "path": src}

    path = work / f"cut{d}"
    rep = prune_stage.run(_prune_config(config, d), src, path, RunEnv(progress=False), scores=scores)
    removed = list(rep["layers"])
    kept = [i for i in range(n) if i not in removed]
    if scores is None:
        scores = json.loads((path / "layercut_prune.json").read_text()).get("scores")
    return {"kept": kept, "kl": judge.kl_path(path), "removed": removed, "path": path, "scores": scores}


def _prune_config(config: PlanConfig, d: int):
    return PruneConfig(drop=d, select="block-influence", replace="lstsq", samples=config.prune_samples,
                       seq_len=config.seq_len, calib=config.calib)


def _quantize_config(config: PlanConfig, c: Candidate):
    common = dict(samples=config.samples, seq_len=config.seq_len, seed=config.seed, calib=config.calib)
    if c.quant == "uniform":
        return QuantizeConfig(bits=c.bits, group_size=c.group_size, **common)
    labels = [f"{b}ch" if g == -1 else f"{b}g{g}" for b, g in c.pairs]
    return QuantizeConfig(avg_bits=c.avg_bits, candidates=labels, fallback_check=False, **common)


def _stages(config: PlanConfig, c: Candidate, cut: dict) -> list:
    stages = [_prune_config(config, c.drop)] if c.drop else []
    if c.quant == "dense":
        return stages + [ExportConfig(save_dtype="bf16")]
    return stages + [_quantize_config(config, c), ExportConfig()]


def _realize(config: PlanConfig, c: Candidate, cut: dict, src: Path, path: Path, progress: bool) -> Path:
    """Write candidate ``c`` for real: quantize the cut, or export it in bf16."""
    env = RunEnv(progress=False)
    if c.quant == "dense":
        export_stage.run(ExportConfig(save_dtype="bf16", card=False), cut["path"], path, env)
    else:
        quantize_stage.run(_quantize_config(config, c), cut["path"], path, env)
    return path
