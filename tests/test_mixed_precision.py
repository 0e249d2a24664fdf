"""Mixed precision over (bits, group size) pairs: costs, the exact DP, fits, checkpoints, the fallback.

Tiny llama (hidden 64, intermediate 128): qkv / o / gate_up have in_features 64, down 128,
so g128 fits down_proj only, as on SmolLM2 (576 / 1536).
"""

from __future__ import annotations

import itertools
import json
import random
import shutil

import pytest
import torch

from layercut.compress.core.arch import target_linears
from layercut.compress.core.errors import LayercutError
from layercut.compress.quant.config import QuantizeConfig
from layercut.compress.quant.format.checkpoint import dynamic_overrides, resolve_dynamic, save_quantized
from layercut.compress.quant.format.loader import load_quantized
from layercut.compress.quant.search.allocate import (
    Unit,
    allocate_bits,
    candidate_label,
    parse_candidate,
    uniform_avg_bits,
)
from layercut.compress.quant.search.mixed import DEFAULT_CANDIDATES, TWO_BIT_CANDIDATES, resolve_candidates
from layercut.compress.quant.search.sensitivity import allocation_units, measure_sensitivity
from layercut.compress.quant.solve.driver import quantize_model
from layercut.compress.workflow.cli import main
from tests.plain_solver import plain_solver
from tests.test_quantize import ATOL, _calib, _probe, small_model


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("small-llama-pairs")
    small_model().save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


PAIRS = [(2, 64), (3, -1), (3, 64), (3, 128), (4, 32), (8, -1)]


def _unit(name: str, shapes: list[tuple[int, int]], delta=None) -> Unit:
    """A unit of linears with (out, in) ``shapes``."""
    return Unit(name, sum(o * k for o, k in shapes), delta or {}, n_rows=sum(o for o, _ in shapes),
                in_features=tuple(k for _, k in shapes))


# ------------------------------------------------------------------- cost model


def test_pair_costs_by_hand():
    """Red if the group count ignores the group size (e.g. one global gs), or per channel is not
    priced by output rows, or the zero point is not counted at b bits."""
    qkv = _unit("qkv", [(960, 576)])  # SmolLM2's fused q/k/v: 960 rows, 576 columns
    n = 960 * 576
    assert qkv.cost((3, 64)) == n * 3 + 960 * 9 * (16 + 3)
    assert qkv.cost((4, 32)) == n * 4 + 960 * 18 * (16 + 4)
    assert qkv.cost((4, -1)) == n * 4 + 960 * (16 + 4)  # one (scale, zero) per row
    down = _unit("down", [(576, 1536)])
    assert down.cost((3, 128)) == 576 * 1536 * 3 + 576 * 12 * 19
    assert not qkv.fits(128) and down.fits(128) and qkv.fits(-1)
    # a unit of two linears with different in_features: a group size must divide both
    two = _unit("two", [(10, 64), (20, 128)])
    assert two.cost((2, 64)) == (640 + 2560) * 2 + (10 * 1 + 20 * 2) * 18
    assert two.fits(64) and not two.fits(128)
    # the SmolLM2 figures: uniform 2/3/4-bit g64 = 2.28 / 3.30 / 4.31 bits per weight
    units = [_unit(f"{i}.{k}", [s]) for i in range(30)
             for k, s in (("qkv", (960, 576)), ("o", (576, 576)), ("gate_up", (3072, 576)), ("down", (576, 1536)))]
    assert [round(uniform_avg_bits(units, (b, 64)), 2) for b in (2, 3, 4)] == [2.28, 3.30, 4.31]
    with pytest.raises(LayercutError, match="does not divide the input size"):
        uniform_avg_bits(units, (3, 128))


def test_parse_candidates_and_config():
    """Red if a bare width stopped meaning (bits, --group-size) or 'ch' were not -1."""
    assert parse_candidate("3g64", 32) == (3, 64) and parse_candidate("4CH", 32) == (4, -1)
    assert parse_candidate("4", 32) == (4, 32) and parse_candidate(8, 32) == (8, 32)
    assert QuantizeConfig(avg_bits=3.5, candidates="3g64,4ch,4", group_size=32).candidate_pairs() == [
        (3, 64), (4, -1), (4, 32)]
    assert QuantizeConfig(avg_bits=3.5, candidates=[4, 8], group_size=64).candidate_pairs() == [(4, 64), (8, 64)]
    assert QuantizeConfig(avg_bits=3.5).candidate_pairs() is None and QuantizeConfig(avg_bits=3.5).unit == "group"
    with pytest.raises(ValueError, match="candidates must be among"):
        QuantizeConfig(avg_bits=3.5, candidates="5g64")
    with pytest.raises(ValueError, match="group sizes must be -1"):
        QuantizeConfig(avg_bits=3.5, candidates="4g0")


def _brute(units: list[Unit], cands, budget: int) -> float:
    best = float("inf")
    opts = [[c for c in cands if u.fits(c[1])] for u in units]
    for combo in itertools.product(*opts):
        if sum(u.cost(c) for u, c in zip(units, combo)) <= budget:
            best = min(best, sum(u.delta[c] for u, c in zip(units, combo)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_dp_over_pairs_is_the_brute_force_optimum(seed):
    """Red if the DP picks a pair that does not fit a unit, exceeds the budget, or is not optimal
    (e.g. the gcd reduction or the inf entries for misfits broke exactness)."""
    rng = random.Random(seed)
    units = []
    for i in range(5):
        shapes = [(rng.choice((32, 64, 96)), rng.choice((64, 128)))]
        u = _unit(f"u{i}", shapes)
        delta = {c: rng.uniform(0, 1) * 4.0 ** (-c[0]) * u.n_weights for c in PAIRS if u.fits(c[1])}
        units.append(Unit(u.name, u.n_weights, delta, n_rows=u.n_rows, in_features=u.in_features))
    n_total = sum(u.n_weights for u in units)
    for avg in (2.4, 3.1, 3.6, 4.4, 6.0, 8.5):
        floor = sum(min(u.cost(c) for c in PAIRS if u.fits(c[1])) for u in units)
        if avg * n_total < floor:
            with pytest.raises(LayercutError, match="below the cheapest"):
                allocate_bits(units, avg, candidates=PAIRS)
            continue
        alloc = allocate_bits(units, avg, candidates=PAIRS)
        assert alloc.method == "dp-exact"
        assert all(units[i].fits(g) for i, g in enumerate(alloc.group_size.values()))
        assert alloc.total_cost_bits == sum(u.cost(alloc.choice[u.name]) for u in units) <= avg * n_total
        assert alloc.total_delta == pytest.approx(_brute(units, PAIRS, int(avg * n_total)), rel=1e-12)
        lag = allocate_bits(units, avg, candidates=PAIRS, method="lagrangian")
        assert lag.total_cost_bits <= avg * n_total and lag.total_delta >= alloc.total_delta - 1e-12
    # old int-keyed tables still mean (bits, group_size)
    old = [Unit("a", 1024, {2: 1.0, 4: 0.5}), Unit("b", 2048, {2: 2.0, 4: 0.1})]
    assert allocate_bits(old, 2.15, group_size=128).choice == {"a": (2, 128), "b": (2, 128)}


def test_candidate_fit_errors():
    """Red if a pair no unit can take were silently dropped, or a unit's missing Δ for a pair it
    cannot take were demanded."""
    qkv, down = _unit("qkv", [(96, 64)]), _unit("down", [(64, 128)])
    units = [Unit("qkv", qkv.n_weights, {(3, 64): 1.0, (4, 64): 0.1}, n_rows=96, in_features=(64,)),
             Unit("down", down.n_weights, {(3, 64): 1.0, (4, 64): 0.2, (3, 128): 0.5}, n_rows=64, in_features=(128,))]
    alloc = allocate_bits(units, 3.5, candidates=[(3, 64), (4, 64), (3, 128)])  # qkv has no (3, 128): fine
    assert alloc.choice["qkv"][1] == 64
    with pytest.raises(LayercutError, match="candidate 3g256: group size 256 divides the input size of no unit"):
        allocate_bits(units, 3.5, candidates=[(3, 64), (3, 256)])
    with pytest.raises(LayercutError, match="no sensitivity for bits"):
        allocate_bits(units, 3.5, candidates=[(3, 64), (3, -1)])


def test_default_candidates_and_baseline():
    """Red if 2-bit pairs joined a budget that uniform 3ch covers, g128 were offered where nothing
    fits, or the baseline were not the costliest uniform pair within the budget."""
    units = [_unit(f"{i}.{k}", [s]) for i in range(4)
             for k, s in (("qkv", (960, 576)), ("o", (576, 576)), ("gate_up", (3072, 576)), ("down", (576, 1536)))]
    cands, base = resolve_candidates(units, 3.5, None)
    assert cands == sorted(DEFAULT_CANDIDATES, key=lambda c: (c[0], 0 if c[1] == -1 else 1 / c[1]))
    assert base == (3, 64) and (3, -1) not in cands  # 3g32 costs 3.59 > 3.5; g128 cannot be uniform (qkv: 576)
    # 3ch joins exactly when no other default pair fits uniformly (3g64 is the cheapest uniform one)
    g64 = uniform_avg_bits(units, (3, 64))
    assert (3, -1) not in resolve_candidates(units, g64, None)[0]
    cands, base = resolve_candidates(units, g64 - 1e-3, None)
    assert (3, -1) in cands and base == (3, -1) and not set(TWO_BIT_CANDIDATES) & set(cands)
    cands, base = resolve_candidates(units, 2.9, None)
    assert set(TWO_BIT_CANDIDATES) <= set(cands) and base == (2, 32)
    three_ch = uniform_avg_bits(units, (3, -1))
    assert not set(TWO_BIT_CANDIDATES) & set(resolve_candidates(units, three_ch, None)[0])
    assert set(TWO_BIT_CANDIDATES) <= set(resolve_candidates(units, three_ch - 1e-3, None)[0])
    with pytest.raises(LayercutError, match="no candidate in --candidates 3g128,4ch fits"):
        resolve_candidates(units, 3.9, [(3, 128), (4, -1)])
    assert resolve_candidates(units, 3.9, [(3, 128), (4, -1)], need_baseline=False)[1] is None
    with pytest.raises(LayercutError, match="below the smallest candidate allocation"):
        resolve_candidates(units, 2.5, [(3, 64)])


# ----------------------------------------------------- quantizing with pairs, loading


def _pair_plan(model) -> dict[str, tuple[int, int]]:
    """Base 4-bit g32; layer 1 at 8-bit per channel; layer 2's gate/up at 3-bit g64; layer 0's down
    at 3-bit g128 (fits down only); layer 2's qkv at 4-bit g64 (same bits as the base, other gs)."""
    plan = {n: (4, 32) for _, _, n, _ in target_linears(model)}
    plan.update({n: (8, -1) for n in plan if ".layers.1." in n})
    plan.update({n: (3, 64) for n in plan if ".layers.2.mlp." in n and "down" not in n})
    plan["model.layers.0.mlp.down_proj"] = (3, 128)
    plan.update({n: (4, 64) for n in plan if ".layers.2.self_attn." in n and "o_proj" not in n})
    return plan


@pytest.fixture(scope="module")
def pair_ckpt(tmp_path_factory, tiny_tokenizer):
    model = small_model("llama")
    plan = _pair_plan(model)
    res = quantize_model(model, _calib(tiny_tokenizer), plain_solver(bits=4, group_size=32), plan, batch_size=4,
                         progress=False)
    path = tmp_path_factory.mktemp("pairs") / "mixed"
    save_quantized(model, tiny_tokenizer, res, path)
    probe = _probe(tiny_tokenizer)
    with torch.no_grad():
        logits = model(probe).logits
    return path, logits, probe, res, plan


def test_pairs_are_recorded_and_written(pair_ckpt):
    """Red if a linear were quantized at the global group size instead of its own, or the
    checkpoint's dynamic lost the group size (or the base were not the pair most weights have)."""
    path, _, _, res, plan = pair_ckpt
    assert res.configs() == plan
    assert res.layers["model.layers.0.mlp.down_proj"].tensors["scales"].shape[0] == 128 // 128
    assert res.layers["model.layers.1.self_attn.q_proj"].tensors["scales"].shape[0] == 1
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"]) == (4, 32)
    dyn = qc["dynamic"]
    assert dyn["+:model\\.layers\\.1\\..*"] == {"bits": 8, "group_size": -1}
    assert resolve_dynamic(dyn, "model.layers.0.mlp.down_proj") == {"bits": 3, "group_size": 128}
    assert resolve_dynamic(dyn, "model.layers.2.mlp.gate_up_proj") == {"bits": 3, "group_size": 64}  # vLLM's name
    assert resolve_dynamic(dyn, "model.layers.2.self_attn.qkv_proj") == {"bits": 4, "group_size": 64}
    assert resolve_dynamic(dyn, "model.layers.0.mlp.up_proj") is None


def test_pair_checkpoint_loads_in_layercut_and_gptqmodel(pair_ckpt):
    """Red if either loader applied a dynamic entry's bits but not its group size (scales would be
    read with the wrong grouping) or the packed tensors disagree with the in-memory model."""
    from gptqmodel import BACKEND, GPTQModel

    path, logits, probe, _, _ = pair_ckpt
    ours = load_quantized(path)
    assert ours.get_submodule("model.layers.0.mlp.down_proj").group_size == 128
    with torch.no_grad():
        torch.testing.assert_close(ours(probe).logits, logits, atol=ATOL, rtol=0)
    model = GPTQModel.load(str(path), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    layers = model.model.model.layers
    assert layers[0].mlp.down_proj.group_size == 128 and layers[1].mlp.up_proj.bits == 8
    assert layers[2].mlp.gate_proj.bits == 3 and layers[2].mlp.gate_proj.group_size == 64
    with torch.no_grad():
        torch.testing.assert_close(model.model(probe).logits.float(), logits, atol=ATOL, rtol=0)


def test_loader_rejects_dynamic_that_matches_nothing(pair_ckpt, tmp_path):
    """Red if a stale pattern (e.g. numbered before pruning) silently left modules at the base."""
    path = tmp_path / "bad"
    shutil.copytree(pair_ckpt[0], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["dynamic"]["+:model\\.layers\\.40\\..*"] = {"bits": 8, "group_size": -1}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LayercutError, match=r"pattern '\+:model\\\\.layers\\\\.40.*matches no module"):
        load_quantized(path)


def test_fused_groups_share_one_pair_and_sizes_must_divide():
    """Red if q/k/v could get different group sizes (servers fuse them), or a group size were
    checked against the global one instead of the linear's own."""
    model = small_model("llama")
    with pytest.raises(LayercutError, match="must share one bit width and group size"):
        quantize_model(model, None, plain_solver(method="rtn", group_size=32),
                       {"model.layers.0.self_attn.q_proj": (4, 64)})
    with pytest.raises(LayercutError, match="group size 128 does not divide in_features=64 of model.layers.0.mlp"):
        quantize_model(model, None, plain_solver(method="rtn", group_size=32),
                       {"model.layers.0.mlp.gate_proj": (4, 128), "model.layers.0.mlp.up_proj": (4, 128)})
    dyn = dynamic_overrides(model, {n: (4, -1) for _, _, n, _ in target_linears(model)}, (4, -1))
    assert dyn == {}  # uniform: no dynamic, so stock transformers loads it


def test_sensitivity_measures_only_fitting_pairs(tiny_tokenizer):
    """Red if g128 were measured (or demanded) for units whose in_features it does not divide."""
    model = small_model("llama", layers=2)
    units = allocation_units(model, "group")
    table = measure_sensitivity(model, _calib(tiny_tokenizer, n=2), units, [(3, 128), (4, 32), (8, -1)],
                                plain_solver(group_size=32), methods=("loss",), batch_size=2, progress=False)
    for u in units:
        keys = set(table.delta[u.name])
        assert keys == ({(3, 128), (4, 32), (8, -1)} if u.name.endswith("down") else {(4, 32), (8, -1)}), u.name
        assert table.delta[u.name][(4, 32)] > table.delta[u.name][(8, -1)] >= 0
    assert "3g128" in table.to_dict()["by_method"]["loss"]["model.layers.0.down"]


@pytest.mark.parametrize("unit", ["group", "layer"])
def test_loss_only_sensitivity_equals_the_general_pass(tiny_tokenizer, unit):
    """The lean losses-only pass (one group's Hessian at a time, no decoded copies) gives exactly the
    losses of the general pass that also measures the block output. Red if a loss went to another
    unit or candidate, or a layer unit summed the wrong linears."""
    model = small_model("llama", layers=2)
    units = allocation_units(model, unit)
    pairs = [(3, 128), (4, 32), (8, -1)] if unit == "group" else [(3, 64), (4, 32), (8, -1)]  # g128: down only
    args = (model, _calib(tiny_tokenizer, n=2), units, pairs, plain_solver(group_size=32))
    lean = measure_sensitivity(*args, methods=("loss",), batch_size=2, progress=False)
    full = measure_sensitivity(*args, methods=("loss", "output"), batch_size=2, progress=False)
    assert lean.delta == full.by_method["loss"] and all(lean.delta.values())


# --------------------------------------------------------------- the fallback check


def test_fallback_writes_uniform_when_mixed_loses(small_dir, tmp_path, capsys, monkeypatch):
    """Sensitivities inverted (2-bit 'harmless', 4-bit 'harmful'): the DP puts everything at 2
    bits, which must lose to uniform 4g32 on KL. Red if the mixed result were written anyway,
    or the decision and both KLs were not reported."""
    import layercut.compress.quant.search.sensitivity as sens_mod

    real = sens_mod.measure_sensitivity

    def inverted(*args, **kwargs):
        table = real(*args, **kwargs)
        for d in table.delta.values():
            for c in d:
                d[c] = float(c[0])  # fewer bits -> lower "damage"
        return table

    monkeypatch.setattr(sens_mod, "measure_sensitivity", inverted)
    out = tmp_path / "fb"
    code = main(["quantize", str(small_dir), "-o", str(out), "--avg-bits", "4.7", "--candidates", "2g32,4g32",
                 "--samples", "4", "--seq-len", "32", "--sensitivity-samples", "2", "--sensitivity", "loss", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["baseline"] == "4g32" and report["config_histogram"] == {"2g32": 12}
    fb = report["fallback"]
    assert report["written"] == "uniform" and fb["kept"] == "uniform" and fb["kl_mixed"] > fb["kl_uniform"] > 0
    assert "did not beat uniform 4g32" in captured.err and "disjoint" in fb["data"], fb  # held apart from calib
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"]) == (4, 32) and "dynamic" not in qc
    assert json.loads((out / "quantize.json").read_text())["fallback"]["kept"] == "uniform"
    assert json.loads((out / "allocation.json").read_text())["written"] == "uniform"
    assert not (out / "allocation.png").exists()
    assert {m.bits for m in load_quantized(out).modules() if hasattr(m, "qweight")} == {4}


def test_no_fallback_check_allows_a_list_without_baseline(small_dir, tmp_path, capsys):
    """2g128 (down only) + 4ch at 4.0 bits: no uniform baseline fits, which is fine without the
    check. Red if the switch did not skip the baseline requirement, or g128 reached a 64-wide unit."""
    out = tmp_path / "nb"
    code = main(["quantize", str(small_dir), "-o", str(out), "--avg-bits", "4.0", "--candidates", "2g128,4ch",
                 "--no-fallback-check", "--samples", "4", "--seq-len", "32", "--sensitivity-samples", "2",
                 "--sensitivity", "loss", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["fallback"]["checked"] is False and report["baseline"] is None and report["written"] == "mixed"
    assert report["avg_bits"] <= 4.0
    model = load_quantized(out)
    for u in json.loads((out / "allocation.json").read_text())["units"]:
        assert u["group_size"] == -1 or u["name"].endswith("down"), u
        assert all(model.get_submodule(n).group_size == u["group_size"] for n in u["linears"])
    assert candidate_label((2, 128)) in report["candidates"]


@pytest.mark.parametrize("fallback", [True, False])
def test_mixed_bits_stream_and_match_the_whole_model_path(small_dir, tmp_path, fallback):
    """--avg-bits block by block (sensitivity, mixed and uniform written as they go, the fallback KL
    streamed) == the whole-model path: same allocation, same verdict, the same tensors written, both
    KLs equal to float32 rounding (the head runs on position slices). Red if the streamed check
    compared other models, wrote the loser, or left a variant's folder behind."""
    from safetensors.torch import load_file

    from layercut.compress.workflow.stages.quantize import run

    kw = dict(avg_bits=4.3, candidates="3g32,4g32,8ch", samples=4, seq_len=32, sensitivity_samples=2,
              batch_size=2, fallback_check=fallback)
    streamed = run(QuantizeConfig(**kw), str(small_dir), tmp_path / "s")
    whole = run(QuantizeConfig(whole_model=True, **kw), str(small_dir), tmp_path / "w")
    assert streamed["unit_bits"] == whole["unit_bits"] and streamed["written"] == whole["written"]
    assert streamed["config_histogram"] == whole["config_histogram"]
    if fallback:
        for k in ("kl_mixed", "kl_uniform"):
            assert streamed["fallback"][k] == pytest.approx(whole["fallback"][k], rel=1e-4)
        assert streamed["fallback"]["tokens"] == whole["fallback"]["tokens"] > 0
    a = {k: v for f in sorted((tmp_path / "s").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    b = {k: v for f in sorted((tmp_path / "w").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.startswith(".")]
    assert {"allocation.json", "quantize.json", "config.json"} <= {p.name for p in (tmp_path / "s").iterdir()}
    probe = torch.randint(4, 300, (1, 12))
    assert torch.equal(load_quantized(tmp_path / "s")(input_ids=probe).logits,
                       load_quantized(tmp_path / "w")(input_ids=probe).logits)
