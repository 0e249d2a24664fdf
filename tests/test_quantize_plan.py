"""The quantize plan (compress/quant/plan.py): built once from the options and the model, printed by
``--dry-run`` (no work, nothing written), stored in quantize.json and equal to what the checkpoint's
quantization_config says, compared by ``layercut run --resume``; and the solver's settings, which
have no defaults of their own."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.quant.format.checkpoint import resolve_dynamic
from layercut.compress.quant.plan import QuantPlan, build_plan, solver_settings
from layercut.compress.quant.solve.settings import SolverConfig
from layercut.compress.workflow.cli import main
from layercut.compress.workflow.pipeline import run_recipe
from layercut.compress.workflow.recipe import Recipe
from tests.test_quantize import GS, small_dir, small_model  # noqa: F401  (small_dir: a fixture)

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
QUICK = ["--samples", "4", "--seq-len", "32"]


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ the solver's settings


def test_solver_config_has_no_defaults_and_is_built_from_the_options():
    """Red if SolverConfig grew a default again (a second set of defaults beside QuantizeConfig's)."""
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(SolverConfig))
    with pytest.raises(TypeError):
        SolverConfig()
    with pytest.raises(TypeError):
        SolverConfig(bits=4, group_size=GS)
    cfg = solver_settings(QuantizeConfig(bits=3, group_size=GS, method="rtn", refit_scales=False))
    assert (cfg.bits, cfg.group_size, cfg.method, cfg.scale_search, cfg.tune) == (3, GS, "rtn", "none", None)
    stage = QuantizeConfig(bits=4)  # every option at its default: the options' defaults reach the solver
    cfg = solver_settings(stage, 64)
    for name in ("sym", "act_order", "static_groups", "group_aware", "damp", "sequential", "solve_dtype",
                 "scale_search", "scale_min", "scale_steps", "scale_bounds", "refit_scales"):
        assert getattr(cfg, name) == getattr(stage, name), name
    with pytest.raises(LayercutError, match="not resolved"):
        solver_settings(stage)  # no group size yet: the plan resolves it per model


# ------------------------------------------------------------------ the plan


def test_plan_resolves_the_group_size_once_and_round_trips():
    model = small_model()  # hidden 64, intermediate 128: 128 does not divide 64
    plan = build_plan(QuantizeConfig(bits=4, quantize_head="8"), model)
    assert (plan.group_size, plan.group_size_from, plan.solver.group_size) == (64, "default", 64)
    assert plan.head == (8, 64)  # a bare head width takes the resolved group size, not the unresolved 128
    assert set(plan.pairs().values()) == {(4, 64)} and len(plan.pairs()) == 3 * 7
    assert QuantPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.difference(build_plan(QuantizeConfig(bits=4, quantize_head="8"), model)) is None
    assert plan.difference(build_plan(QuantizeConfig(bits=3, quantize_head="8"), model)) == "bits: 4 -> 3"
    mixed = build_plan(QuantizeConfig(avg_bits=3.5, candidates="3,4g32"), model)
    assert mixed.candidates == ((3, 64), (4, 32)) and not mixed.allocated
    with pytest.raises(LayercutError):
        mixed.pairs()
    chosen = mixed.with_pairs({name: (3, 64) for name in plan.pairs()})
    assert chosen.allocated and chosen.difference(mixed) is None  # the allocation is data, not an option


def test_plan_refuses_what_the_model_cannot_take():
    with pytest.raises(LayercutError, match="group size 48 does not divide"):
        build_plan(QuantizeConfig(bits=4, group_size=48), small_model())
    with pytest.raises(LayercutError, match="group size 48 does not divide the hidden size"):
        build_plan(QuantizeConfig(bits=4, group_size=32, quantize_head="8g48"), small_model())


# ------------------------------------------------------------------ --dry-run


def test_dry_run_prints_the_plan_and_does_no_work(small_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    """One table (method, group size, bits, one row per run of blocks, the head); no calibration
    drawn, no solve, nothing written, exit 0 -- with and without -o."""
    import layercut.compress.workflow.stages.quantize as stage

    def boom(*args, **kwargs):
        raise AssertionError("a dry run did work")

    for name in ("calibration_batch", "quantize_linears", "quantize_mixed"):
        monkeypatch.setattr(stage, name, boom)
    out = tmp_path / "q"
    code = main(["quantize", str(small_dir), "-o", str(out), "--bits", "4", "--group-size", str(GS), "--dry-run",
                 *QUICK])
    text = capsys.readouterr().out
    assert code == 0
    assert list(tmp_path.iterdir()) == []  # not even the output folder
    rows = dict(re.match(r"^(.*?)\s{2,}(.*)$", line).groups() for line in text.strip().splitlines())
    assert rows["blocks 0-2"].split() == ["qkv", "4g32", "o", "4g32", "gate_up", "4g32", "down", "4g32"]
    assert rows["bits"] == "4 (uniform)" and rows["group size"] == "32 (given)" and rows["dry_run"] == "True"
    assert rows["head lm_head"].startswith("not quantized")
    code = main(["quantize", str(small_dir), "--avg-bits", "3.5", "--candidates", "3g32,4g32", "--dry-run", "--json",
                 *QUICK])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["dry_run"] and report["output"] is None
    assert report["blocks 0-2"] == "qkv chosen  o chosen  gate_up chosen  down chosen"
    assert report["group size"].startswith("64 (default") and "3g32,4g32" in report["bits"]
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the stored plan


def _written_pairs(folder) -> dict[str, tuple[int, int]]:
    """(bits, group size) per quantized linear as the checkpoint's quantization_config says."""
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    plan = json.loads((folder / "quantize.json").read_text())["plan"]
    out = {}
    for name in plan["linears"]:
        o = resolve_dynamic(qc.get("dynamic"), name)
        assert o is not False, name
        o = o or {}
        out[name] = (o.get("bits", qc["bits"]), o.get("group_size", qc["group_size"]))
    return out


@pytest.mark.parametrize("flags", [["--bits", "3", "--group-size", str(GS)],
                                   ["--avg-bits", "3.8", "--candidates", "3g32,4g32,8ch", "--no-fallback-check",
                                    "--sensitivity-samples", "2"]], ids=["uniform", "mixed"])
def test_the_stored_plan_is_what_the_checkpoint_says(small_dir, tmp_path, flags):  # noqa: F811
    out = tmp_path / "q"
    assert main(["-q", "quantize", str(small_dir), "-o", str(out), *flags, *QUICK]) == 0
    plan = QuantPlan.from_dict(json.loads((out / "quantize.json").read_text())["plan"])
    assert plan.allocated and plan.pairs() == _written_pairs(out)
    if "--avg-bits" in flags:  # an allocation that mixes pairs, else the comparison says little
        assert len(set(plan.pairs().values())) > 1 and plan.avg_bits == 3.8


# ------------------------------------------------------------------ --resume


def test_resume_with_other_bits_stops_at_the_plan_and_touches_nothing(small_dir, tmp_path, capsys):  # noqa: F811
    def recipe(bits: int) -> Recipe:
        return Recipe.from_dict({"version": 1, "model": str(small_dir), "stages": [
            {"quantize": {"bits": bits, "group_size": GS, "samples": 4, "seq_len": 32}}]})

    out = tmp_path / "run"
    run_recipe(recipe(4), out, progress=False)
    before = {k: v for k, v in _tree(out).items() if k != "run.log"}
    path = tmp_path / "changed.yaml"
    path.write_text(recipe(3).to_yaml())
    code = main(["run", str(path), "-o", str(out), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: --resume: the quantize plan differs"), err
    assert "(bits: 4 -> 3)" in err[-1]
    assert {k: v for k, v in _tree(out).items() if k != "run.log"} == before
    run_recipe(recipe(4), out, resume=True, progress=False)  # the same options resume (nothing to do)


def test_resume_names_a_solver_difference(small_dir, tmp_path):  # noqa: F811
    """A difference the recipe does not show (a checkpoint written with other solver settings) is
    still found, because the plans are compared, not only the recipe keys."""
    from layercut.compress.workflow.stages.quantize import check_resume

    out = tmp_path / "q"
    assert main(["-q", "quantize", str(small_dir), "-o", str(out), "--bits", "4", "--group-size", str(GS),
                 "--no-act-order", *QUICK]) == 0
    check_resume(QuantizeConfig(bits=4, group_size=GS, act_order=False, samples=4, seq_len=32), out)
    with pytest.raises(LayercutError, match=r"solver\.act_order: False -> True"):
        check_resume(QuantizeConfig(bits=4, group_size=GS), out)
