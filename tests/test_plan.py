"""`layercut plan`: candidate enumeration, exact bytes against what the stages write, bad input,
an end-to-end tiny plan, and a `target:` recipe run. Tiny models built from config."""

from __future__ import annotations

import json

import pytest

from layercut.compress.io.models import weight_bytes
from layercut.compress.workflow.cli import main
from layercut.compress.workflow.planner.config import PlanConfig
from layercut.compress.workflow.planner.space import Layout, enumerate_candidates, uniform_configs
from layercut.compress.workflow.stages.base import RunEnv

FAST = ["--samples", "8", "--seq-len", "32"]


@pytest.fixture(scope="module")
def layout(tiny_model_dir):
    return Layout.of(tiny_model_dir("llama"))


def test_enumeration_keeps_only_what_fits(layout):
    n = layout.num_blocks
    configs = uniform_configs(layout, [2, 3, 4, 8], [128, 64, -1])
    assert (4, 128) not in configs and (4, 64) in configs  # 128 does not divide the 64 inputs
    kept = {0: list(range(n)), 1: list(range(1, n)), 2: list(range(2, n))}
    target = layout.quantized_bytes(kept[2], (8, -1))  # 8 bits fit only once two blocks are gone
    cands = enumerate_candidates(layout, kept, target, configs)
    assert cands and all(c.bytes <= target for c in cands)
    full = {(c.bits, c.group_size) for c in cands if c.drop == 0 and c.quant == "uniform"}
    assert (4, 64) in full and (8, 64) not in full and (8, -1) not in full
    cut2 = {(c.bits, c.group_size) for c in cands if c.drop == 2 and c.quant == "uniform"}
    assert full < cut2 and (8, -1) in cut2  # two blocks fewer: more configs fit
    assert any(c.quant == "mixed" and c.pairs[0][0] < c.pairs[1][0] for c in cands if c.drop == 0)
    assert all(c.predicted_speedup == n / c.kept_blocks for c in cands)
    # dominated configs (fewer bits in groups no finer than a fitting one's) are not candidates
    assert {(2, 64), (3, 64), (2, -1), (3, -1), (4, -1)}.isdisjoint(full | cut2) and (8, -1) in cut2


def test_dominated_configs_are_left_out_only_when_the_dominating_one_fits(layout):
    from layercut.compress.workflow.planner.space import dominates

    n = layout.num_blocks
    configs = uniform_configs(layout, [2, 3, 4], [64, -1])
    full = list(range(n))
    sizes = {c: layout.quantized_bytes(full, c) for c in configs}
    for target in sorted(set(sizes.values())):
        got = {(c.bits, c.group_size) for c in enumerate_candidates(layout, {0: full}, target, configs, mixed=False,
                                                                     dense=False)}
        fitting = {c for c in configs if sizes[c] <= target}
        assert got == {c for c in fitting if not any(dominates(o, c) for o in fitting)} and got
    assert dominates((4, 64), (3, -1)) and not dominates((4, -1), (3, 64)) and not dominates((3, 64), (3, 64))


def test_predicted_bytes_equal_written_bytes(tiny_model_dir, layout, tmp_path):
    """Uniform, per-channel and mixed quantizations of the full and a cut model; the dense cut."""
    from layercut.compress.quant.config import QuantizeConfig
    from layercut.compress.workflow.stages import prune, quantize
    from layercut.compress.workflow.stages.prune import PruneConfig

    src, env, n = tiny_model_dir("llama"), RunEnv(progress=False), layout.num_blocks
    rep = prune.run(PruneConfig(drop=2, select="block-influence", replace="lstsq", samples=8, seq_len=32),
                    src, tmp_path / "cut", env)
    kept = [i for i in range(n) if i not in rep["layers"]]
    assert weight_bytes(tmp_path / "cut") == layout.dense_bytes(kept, "F32")
    for i, (base, k, c) in enumerate([(src, range(n), (4, 64)), (src, range(n), (3, 32)),
                                      (tmp_path / "cut", kept, (2, -1))]):
        quantize.run(QuantizeConfig(bits=c[0], group_size=c[1], samples=8, seq_len=32), base, tmp_path / f"q{i}", env)
        assert weight_bytes(tmp_path / f"q{i}") == layout.quantized_bytes(list(k), c), c
    budget = layout.quantized_bytes(kept, (4, 64)) + 40_000
    x = layout.mixed_avg_bits(kept, budget, ((4, 64), (8, -1)))
    quantize.run(QuantizeConfig(avg_bits=x, candidates=["4g64", "8ch"], fallback_check=False, samples=8, seq_len=32),
                 tmp_path / "cut", tmp_path / "mixed", env)
    units = json.loads((tmp_path / "mixed" / "allocation.json").read_text())["units"]
    assert {u["bits"] for u in units} == {4, 8}  # really mixed
    configs = {lin: (u["bits"], u["group_size"]) for u in units for lin in u["linears"]}
    assert weight_bytes(tmp_path / "mixed") == layout.quantized_bytes(kept, configs) <= budget


def _plan_cli(tmp_path, capsys, model, *args):
    out = tmp_path / "plan-out"
    capsys.readouterr()  # whatever the fixtures printed
    code = main(["plan", str(model), "-o", str(out), *FAST, *args])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err, out


@pytest.mark.parametrize("args, needle", [
    (["--target-size", "40"], "has no unit"),
    (["--target-size=-5%"], "target size"),
    (["--target-size", "40%", "--min-speedup", "-2"], "--min-speedup must be a number >= 1"),
    (["--target-size", "40%", "--min-speedup", "fast"], "expected a number"),
    (["--target-size", "150%"], "not below the source's size in bf16"),
    (["--target-size", "1%"], "below the smallest candidate"),
    (["--target-size", "40%", "--min-speedup", "10"], "largest reachable speedup is 2"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tiny_model_dir, tmp_path, capsys, args, needle):
    code, err, out = _plan_cli(tmp_path, capsys, tiny_model_dir("llama"), *args)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not out.exists() and not any(p.name.startswith(".plan-out") for p in tmp_path.iterdir())


def test_smallest_reachable_size_is_named(tiny_model_dir, tmp_path, capsys, layout):
    from layercut.compress.workflow.planner.space import smallest_bytes

    code, err, _ = _plan_cli(tmp_path, capsys, tiny_model_dir("llama"), "--target-size", "1%")
    smallest = smallest_bytes(layout, PlanConfig(size="1%").max_drop_count(layout.num_blocks),
                              uniform_configs(layout, [2, 3, 4, 8], [128, 64, -1]))
    assert f"smallest candidate, {smallest:,} bytes" in err[0] and "3 of 6 blocks removed, 2ch" in err[0]


def test_plan_end_to_end_writes_a_loadable_model_within_target(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from layercut.compress.depth import prune as depth_prune  # where the prune stage's selection scores
    from layercut.compress.io.models import load_model
    from layercut.compress.workflow.recipe import load_recipe

    calls = []
    real = depth_prune.compute_scores
    monkeypatch.setattr(depth_prune, "compute_scores", lambda *a, **k: calls.append(1) or real(*a, **k))

    code = main(["plan", str(tiny_model_dir("llama")), "--target-size", "45%", "-o", str(tmp_path / "p"),
                 "--top-k", "2", "--json", *FAST])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    out = tmp_path / "p"
    report = json.loads((out / "plan.json").read_text())
    assert weight_bytes(out / "model") == line["bytes"] <= report["target_bytes"] == line["target_bytes"]
    assert (out / "model" / "README.md").is_file() and (out / "plan.png").stat().st_size > 0
    verified = [c for c in report["candidates"] if c["verified"]]
    assert len(verified) == 2 and all(c["measured_kl"] > 0 and c["measured_bytes"] <= c["bytes"] for c in verified)
    assert line["kl"] == min(c["measured_kl"] for c in verified)
    assert all(c["bytes"] <= report["target_bytes"] for c in report["candidates"])
    model, _ = load_model(out / "model")
    assert model.config.num_hidden_layers == line["kept_blocks"]
    recipe = load_recipe(out / "recipe.yaml")
    assert [s.stage for s in recipe.stages][-1] == "export" and recipe.target is None
    assert not (out / ".work").exists()
    assert len(calls) <= 1  # the blocks are scored once, whatever the number of cuts


def test_target_recipe_with_stages_is_refused(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nmodel: bundled:smollm2-135m\ntarget: {size: 40%}\nstages:\n  - export: {}\n")
    code = main(["run", str(recipe), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "give target or stages, not both" in err[0]
    assert not (tmp_path / "out").exists()


def test_target_recipe_plans_then_runs(tiny_model_dir, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nmodel: {tiny_model_dir('llama')}\ntarget:\n  size: 45%\n  min_speedup: 1.2\n"
                      "  top_k: 1\n  samples: 8\n  prune_samples: 8\n  seq_len: 32\n")
    code = main(["run", str(recipe), "-o", str(tmp_path / "out"), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    out = tmp_path / "out"
    plan = json.loads((out / "00-plan" / "plan.json").read_text())
    final = out / report["final_model"]
    assert weight_bytes(final) <= plan["target_bytes"]
    assert plan["winner"]["kept_blocks"] <= 5  # 6 blocks / 1.2
    # the run rebuilt the plan's winner from its recipe: the same bytes
    assert weight_bytes(final) == weight_bytes(out / "00-plan" / "model")
    assert [s["stage"] for s in report["stages"]][-1] == "export"


def test_block_scores_are_computed_once_for_all_cuts(tiny_model_dir, tmp_path, monkeypatch):
    """The first cut scores the blocks; later cuts select from those scores (nested removed sets),
    and pick exactly what the prune stage picks on its own."""
    from layercut.calibrate.sources import TextSource
    from layercut.compress.depth import prune as depth_prune  # where the prune stage's selection scores
    from layercut.compress.io.models import load_tokenizer
    from layercut.compress.workflow.planner.measure import KLJudge
    from layercut.compress.workflow.planner.search import _cut, _prune_config, _removed
    from layercut.compress.workflow.stages import prune

    calls = []
    real = depth_prune.compute_scores
    monkeypatch.setattr(depth_prune, "compute_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    src = tiny_model_dir("llama")
    cfg = PlanConfig(size="45%", samples=8, prune_samples=8, seq_len=32, kl_samples=2)
    judge = KLJudge(src, load_tokenizer(src), [TextSource(source=cfg.calib)], cfg.kl_samples, cfg.seq_len, cfg.seed,
                    calib_samples=cfg.samples)
    work = tmp_path / "work"
    work.mkdir()
    first = _cut(cfg, str(src), src, 1, work, judge, False)
    assert len(calls) == 1 and first["scores"]
    cuts = [first] + [_cut(cfg, str(src), src, d, work, judge, False, first["scores"]) for d in (2, 3)]
    assert len(calls) == 1  # not rescored per cut
    removed = [c["removed"] for c in cuts]
    assert all(set(a) < set(b) for a, b in zip(removed, removed[1:]))
    assert removed[2] == _removed(first["scores"], 3)
    alone = prune.run(_prune_config(cfg, 3), src, tmp_path / "alone", RunEnv(progress=False))
    assert alone["layers"] == removed[2] and len(calls) == 2
    assert judge.kl_path(tmp_path / "alone") == cuts[2]["kl"]


def test_cut_bound_skips_cuts_that_cannot_beat_the_best():
    from layercut.compress.workflow.planner.search import cut_bound

    assert cut_bound(0.3, [0.4, 0.2], 20, 30) == pytest.approx(0.3 + 0.2 * 20 / 30)
    assert cut_bound(0.3, [], 20, 30) == float("inf")  # nothing fits: nothing to measure
    assert cut_bound(0.3, [0.0, 0.5], 20, 30) == 0.3  # a dense candidate: the old rule (cut KL alone)


def test_rtn_prediction_leaves_the_source_weights_unchanged(tiny_model_dir):
    import torch

    from layercut.calibrate.sources import TextSource
    from layercut.compress.io.models import load_tokenizer
    from layercut.compress.workflow.planner.measure import KLJudge

    src = tiny_model_dir("llama")
    judge = KLJudge(src, load_tokenizer(src), [TextSource(source=PlanConfig(size="45%").calib)], 2, 32, 0,
                    calib_samples=8)
    before = {k: v.clone() for k, v in judge.model.state_dict().items()}
    first = judge.rtn_kl((2, -1))
    assert first > 0 and judge.kl_model(judge.model) == pytest.approx(0.0, abs=1e-6)
    assert all(torch.equal(before[k], v) for k, v in judge.model.state_dict().items())
    assert judge.rtn_kl((2, -1)) == first


def test_first_cut_is_verified_before_deeper_cuts(tiny_model_dir, tmp_path, monkeypatch):
    """The first cut's best predicted candidate runs for real before any deeper cut (so the depth
    search works with the RTN -> GPTQ scale learnt from it): red if verification waits for the
    end of the depth search."""
    from layercut.compress.workflow.planner import search

    events = []
    real_cut, real_realize = search._cut, search._realize
    monkeypatch.setattr(search, "_cut", lambda c, spec, src, d, *a, **k: events.append(("cut", d))
                        or real_cut(c, spec, src, d, *a, **k))
    monkeypatch.setattr(search, "_realize", lambda c, cand, *a, **k: events.append(("verify", cand.drop))
                        or real_realize(c, cand, *a, **k))
    report = search.plan(PlanConfig(size="45%", top_k=2, samples=8, prune_samples=8, seq_len=32, kl_samples=2,
                                    max_drop=2), str(tiny_model_dir("llama")), tmp_path / "p", progress=False)
    assert events[:2] == [("cut", 0), ("verify", 0)] and ("cut", 1) in events
    assert sum(kind == "verify" for kind, _ in events) == report["verified"] == 2
    first = next(c for c in report["candidates"] if c["verified"])
    assert first["drop"] == 0 and first["predicted_kl"] == min(
        c["predicted_kl"] for c in report["candidates"] if c["drop"] == 0)


def test_cuts_where_nothing_fits_are_not_run(tiny_model_dir, tmp_path, monkeypatch, layout):
    """A target only 3 removed blocks reach: cut 1 runs (it scores the blocks), cut 2 is known
    from the scores to have no fitting candidate and is not run: red if every cut is run."""
    from layercut.compress.workflow.planner import search
    from layercut.compress.workflow.planner.space import smallest_bytes

    events = []
    real_cut = search._cut
    monkeypatch.setattr(search, "_cut", lambda c, spec, src, d, *a, **k: events.append(d)
                        or real_cut(c, spec, src, d, *a, **k))
    target = smallest_bytes(layout, 3, uniform_configs(layout, [2, 3, 4, 8], [128, 64, -1]))
    report = search.plan(PlanConfig(size=f"{target}B", top_k=1, samples=8, prune_samples=8, seq_len=32, kl_samples=2,
                                    max_drop=3), str(tiny_model_dir("llama")), tmp_path / "p", progress=False)
    assert events == [0, 1, 3] and report["skipped_cuts"] == {"2": None}
    assert report["winner"]["drop"] == 3 and report["winner"]["measured_bytes"] <= target
